"""The benchmarks a user runs, one line each: ``python -m bench``.

Each line gives the command, how long its last kept run took
(``wall_s`` in its results file, or the sum of the stage times it records; "not recorded" where the kept file is
older than that field) and what it measures. ``python -m bench.NAME --help`` gives a benchmark's options. Settled one-off experiments are not
here: their pages in docs/decisions/ name the commit that still has their code.
"""

from __future__ import annotations

import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"


@dataclass(frozen=True)
class Benchmark:
    name: str
    results: str  # glob under bench/results/
    group: str


BENCHMARKS = (
    Benchmark("bert_base", "", "setup"),
    Benchmark("serving", "serving*.json", "speed"),
    Benchmark("hostwork", "hostwork*.json", "speed"),
    Benchmark("stages", "stages*.json", "speed"),
    Benchmark("width_groups", "width-groups*.json", "speed"),
    Benchmark("steps", "steps*.json", "speed"),
    Benchmark("startup", "startup*.json", "speed"),
    Benchmark("first_requests", "first_requests*.json", "speed"),
    Benchmark("builder", "builder*.json", "speed"),
    Benchmark("build_memory", "build_memory*.json", "speed"),
    Benchmark("preprocess", "preprocess.json", "speed"),
    Benchmark("retrieval", "retrieval*.json", "speed"),
    Benchmark("load", "load*.json", "speed"),
    Benchmark("scale", "scale*.json", "speed"),
    Benchmark("families", "families*.json", "speed"),
    Benchmark("entity_cost", "entity-cost*.json", "speed"),
    Benchmark("numerics", "numerics*.json", "speed"),
    Benchmark("knn_batch", "knn-batch-*.json", "speed"),
    Benchmark("vote_batch", "vote-batch-*.json", "speed"),
    Benchmark("heap", "heap.json", "speed"),
    Benchmark("gpu", "gpu.json", "speed"),
    Benchmark("quality", "quality.json", "quality"),
    Benchmark("realtext", "realtext*.json", "quality"),
    Benchmark("calibration", "calibration*.json", "quality"),
    Benchmark("entities", "entities-*.json", "quality"),
    Benchmark("languages", "languages*.json", "quality"),
    Benchmark("vote_bound", "vote_bound*.json", "quality"),
    Benchmark("defaults", "defaults*.json", "quality"),
    Benchmark("plots", "", "docs"),
    Benchmark("capacity", "capacity.json", "docs"),
)


def summary(name: str) -> str:
    """The first line of the benchmark's module docstring, read without importing it."""
    path = BENCH / f"{name}.py"
    if not path.exists():
        path = BENCH / name / "__main__.py"
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
    first = doc.split("\n\n", 1)[0].replace("\n", " ")
    first = first.split("::")[0].split(", one command")[0].split(". One command")[0].split(". ")[0].rstrip(":. ")
    return first if len(first) <= 84 else first[:83].rsplit(" ", 1)[0] + "…"


def last_run_s(pattern: str) -> float | None:
    """The longest recorded wall time among the benchmark's kept results files (one per model or mode)."""
    times: list[float] = []
    for path in RESULTS.glob(pattern) if pattern else ():
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            continue
        stages = data.get("timings_s") or data.get("stage_seconds")
        if isinstance(data.get("wall_s"), int | float):
            times.append(float(data["wall_s"]))
        elif isinstance(stages, dict):
            times.append(sum(float(v) for v in stages.values() if isinstance(v, int | float)))
    return max(times) if times else None


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "not recorded"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def lines() -> list[str]:
    out = [f"  {'command':<29} {'last run':>12}  what it measures (results: bench/results/)"]
    for group in ("setup", "speed", "quality", "docs"):
        out.append(f"{group}:")
        for b in (b for b in BENCHMARKS if b.group == group):
            took = duration(last_run_s(b.results)) if b.results else "-"
            out.append(f"  python -m bench.{b.name:<13} {took:>12}  {summary(b.name)}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if args:
        print(f"python -m bench takes no arguments (got {args[0]!r}); run python -m bench.NAME for one benchmark",
              file=sys.stderr)
        return 2
    print("\n".join(lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
