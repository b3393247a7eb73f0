"""Every measured figure in README.md and docs/ must be a value that the command its section cites wrote.

A section (a heading and its text, with its parent sections' citations inherited) cites commands
(`python -m bench.NAME`: every ``bench/results/NAME*.json``) and result files (``bench/results/FILE.json``). A figure
is a number with a decimal point, a thousands separator or a unit (``x``, ``%``, ``ms``, ``s``, ``/s``, bytes...; in
``99 / 93 / 95 %`` each number has the last one's unit),
outside code spans, links and version numbers. It passes when some value in the cited files, as a fraction, a
percentage or in thousandths, rounds to it; when it is a setting's default (the settings classes); or when it is a
published figure (``bench/results/published.json``) in a section that names the paper.

Figures that no results file holds yet are listed in ``scripts/figures_unverified.tsv``: each entry is one figure
with the text around it, so editing that figure or its sentence by hand makes the check fail. ``--prune`` deletes
entries that no longer occur; nothing adds one but an edit of that file.

A results file records the command line that wrote it (``command``). A paragraph, list item or table row that
names such a file and quotes a command of the same benchmark must quote that very command.

    python scripts/check_figures.py            # CI: exit 1 and one line per unsupported figure
    python scripts/check_figures.py --prune    # drop stale entries from the unverified list
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
UNVERIFIED = REPO / "scripts" / "figures_unverified.tsv"
PUBLISHED = RESULTS / "published.json"

CITE = re.compile(r"python -m bench\.([a-z_]+)|bench/results/([\w.-]+\.json)")
UNIT = r"x\b|%|ms\b|µs\b|s\b|req/s|contexts/s|/s|MiB|GiB|MB|GB|TB|KiB|bytes|points|core-h|h\b|min\b"
FIGURE = re.compile(
    r"(?<![\w.,/=^@-])(\d+(?:\.\d+)?e[-+]?\d+|\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+)(?![\w.,]*\d)(?:\s*(" + UNIT
    + r"))?"
)
# Versions, and numbers that name things rather than measure them.
NOT_A_FIGURE = re.compile(
    r"\b(?:python|torch|pyserini|java|jdk|faiss(?:-gpu|-cpu)?|cuda|onnx(?:runtime)?|version|v|p|top|rank|step|"
    r"lambda|k|n|l|hop|beam|limit|layer|layers|stage|issue|#)\s*$",
    re.IGNORECASE,
)
# the rest of a list of numbers separated by " / " that ends in a unit
SHARED_UNIT = re.compile(r"(?:\s*/\s*\d[\d,]*(?:\.\d+)?)+\s*(" + UNIT + r")")
CONTEXT = 40  # characters of text each side kept with an unverified figure


@dataclass(frozen=True)
class Figure:
    doc: str  # path relative to the repository
    text: str  # as written: "34.0", "1,557", "2.75 ms"
    value: float
    decimals: int
    unit: str  # "", "ms", "x", "%"...
    context: str  # the text around it, code spans and links removed
    cited: tuple[str, ...]  # result files its section cites
    unit_id: int = 0  # figures of one table row, list item or paragraph share it

    def key(self) -> str:
        return f"{self.doc}\t{self.text}\t{self.context}"


# what made a results file (bench.common.provenance): its command line's and commit's digits are no figures
PROVENANCE = frozenset({"command", "source"})


def numbers(obj: object) -> Iterator[float]:
    """Every finite number in a JSON document, numbers written inside strings included, except in what made it
    (``PROVENANCE``)."""
    if isinstance(obj, bool):
        return
    if isinstance(obj, int | float):
        if math.isfinite(obj):
            yield float(obj)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            if key not in PROVENANCE:
                yield from numbers(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from numbers(value)
    elif isinstance(obj, str):
        yield from (float(m) for m in re.findall(r"\d+(?:\.\d+)?", obj.replace(",", "")))


def cited_files(section: str) -> set[str]:
    out: set[str] = set()
    for command, name in CITE.findall(section):
        if command:
            stem = command.replace("_", "-")
            out.update(p.name for p in RESULTS.glob("*.json") if p.stem.replace("_", "-").startswith(stem))
        elif (RESULTS / name).exists():
            out.add(name)
    return out


def plain(text: str) -> str:
    """The prose of a section: code blocks, code spans, link targets and HTML comments removed."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def sections(text: str) -> Iterator[tuple[str, set[str]]]:
    """(section text, the result files it and its parent sections cite)."""
    stack: list[tuple[int, set[str]]] = []
    for part in re.split(r"\n(?=#{1,6} )", "\n" + text):
        level = len(part.lstrip("\n").split(" ", 1)[0]) if part.lstrip("\n").startswith("#") else 0
        while stack and stack[-1][0] >= level > 0:
            stack.pop()
        own = cited_files(part)
        inherited = set().union(*(files for _, files in stack)) if stack else set()
        stack.append((level, own))
        yield part, own | inherited


def units(section: str) -> Iterator[str]:
    """A section's table rows, list items and paragraphs."""
    for block in re.split(r"\n\s*\n", section):
        yield from re.split(r"\n(?=\s*(?:\||[-*] |\d+\. ))", block)


def figures(doc: Path, root: Path = REPO) -> Iterator[Figure]:
    rel = doc.relative_to(root).as_posix()
    count = 0
    for part, section_cites in sections(doc.read_text(encoding="utf-8")):
        for unit in units(part):
            cited = cited_files(unit) or section_cites
            count += 1
            yield from _unit_figures(rel, plain(unit), cited, count)


def _unit_figures(rel: str, body: str, cited: set[str], unit_id: int) -> Iterator[Figure]:
    for line in body.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for m in FIGURE.finditer(line):
            number, unit = m.group(1), m.group(2)
            if not unit and (shared := SHARED_UNIT.match(line, m.end())):
                unit = shared.group(1)  # "99 / 93 / 95 %": each number of the list carries its unit
            if not any(c in number for c in ".,e") and not unit:
                continue
            if NOT_A_FIGURE.search(line[: m.start()]) or re.match(r"\d+-\d", line[m.start():]):
                continue
            mantissa, _, exponent = number.partition("e")  # 9.5e-7: rounded at the 8th decimal
            decimals = (len(mantissa.split(".")[1]) if "." in mantissa else 0) - int(exponent or 0)
            context = line[max(0, m.start() - CONTEXT): m.end() + CONTEXT].strip()
            yield Figure(rel, m.group(0).strip(), float(number.replace(",", "")), decimals, unit or "", context,
                         tuple(sorted(cited)), unit_id)


def settings_defaults() -> set[float]:
    """The numeric defaults of every setting (docs/configuration.md is generated from them)."""
    from bertknn.builder.settings import AddSettings, BuildSettings
    from bertknn.core.settings_cli import iter_fields
    from bertknn.service.settings import ServiceSettings

    out: set[float] = set()
    for cls in (ServiceSettings, BuildSettings, AddSettings):
        for f in iter_fields(cls):
            if isinstance(f.default, int | float) and not isinstance(f.default, bool):
                out.add(float(f.default))
    return out


def scales(fig: Figure) -> tuple[float, ...]:
    """How a stored value may be written: as is; a fraction as a percentage; seconds as ms, ms as s."""
    out = [1.0]
    if fig.value <= 100 and fig.unit not in ("x",):
        out.append(100.0)
    if fig.unit in ("ms", "µs"):
        out.append(1000.0)
    if fig.unit == "s":
        out.append(0.001)
    return tuple(out)


def supported(fig: Figure, values: Iterable[float]) -> bool:
    tol = 0.5 * 10.0**-fig.decimals + 1e-9
    factors = scales(fig)
    return any(abs(v * scale - fig.value) <= tol for v in values for scale in factors)


class Checker:
    def __init__(self) -> None:
        self._cache: dict[str, list[float]] = {}
        self.defaults = sorted(settings_defaults())
        self.published = sorted(numbers(json.loads(PUBLISHED.read_text(encoding="utf-8"))["figures"]))

    def values(self, names: Iterable[str]) -> list[float]:
        out: list[float] = []
        for name in names:
            if name not in self._cache:
                self._cache[name] = sorted(set(numbers(json.loads((RESULTS / name).read_text(encoding="utf-8")))))
            out += self._cache[name]
        return out

    def ok(self, fig: Figure) -> bool:
        if supported(fig, self.values(fig.cited)) or supported(fig, self.defaults):
            return True
        return bool(re.search(r"paper|Kassner", fig.context, re.IGNORECASE)) and supported(fig, self.published)


def documents(root: Path = REPO) -> list[Path]:
    return [p for p in (root / "README.md", *sorted((root / "docs").rglob("*.md"))) if p.exists()]


def new_figures(root: Path = REPO, listed: Iterable[str] | None = None) -> list[Figure]:
    """The figures that fail the check: unsupported and not on the unverified list."""
    known = set(read_unverified() if listed is None else listed)
    return [fig for fig in unsupported(documents(root), root) if fig.key() not in known]


def derived(fig: Figure, sources: list[Figure]) -> bool:
    """A ratio (``1.08x``) of two other supported figures of its passage, or a difference in points."""
    if fig.unit not in ("x", "points"):
        return False
    tol = 0.5 * 10.0**-fig.decimals + 1e-9
    for a in sources:
        for b in sources:
            if a is b or {a.unit, b.unit} & {"x", "points", "%"}:
                continue
            ha, hb = 0.5 * 10.0**-a.decimals, 0.5 * 10.0**-b.decimals  # the sources were rounded too
            if fig.unit == "x" and a.value and b.value:
                ratio = a.value / b.value
                if abs(ratio - fig.value) <= tol + ratio * (ha / a.value + hb / b.value):
                    return True
            if fig.unit == "points" and abs(abs(a.value - b.value) - fig.value) <= tol + ha + hb:
                return True
    return False


def unsupported(docs: Iterable[Path], root: Path = REPO) -> list[Figure]:
    checker = Checker()
    out: list[Figure] = []
    for doc in docs:
        found = list(figures(doc, root))
        good = [fig for fig in found if checker.ok(fig)]
        for fig in found:
            if fig in good:
                continue
            if not derived(fig, [g for g in good if g.unit_id == fig.unit_id]):
                out.append(fig)
    return out


QUOTED_COMMAND = re.compile(r"`(python -m bench\.[^`]+)`")


def recorded_command(name: str) -> str | None:
    """The command line a results file records having been written by (bench.common.provenance), if any."""
    path = RESULTS / name
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    command = data.get("command") if isinstance(data, dict) else None
    return " ".join(command.split()) if isinstance(command, str) else None


def wrong_commands(docs: Iterable[Path], root: Path = REPO) -> list[str]:
    """Where a paragraph, list item or table row names a results file that records its command and quotes a
    command of the same benchmark, yet none of its quotes is that command: the command a reader would run is not
    the one that wrote the figures."""
    out = []
    for doc in docs:
        for part, _ in sections(doc.read_text(encoding="utf-8")):
            for unit in units(part):
                quoted = {" ".join(q.split()) for q in QUOTED_COMMAND.findall(unit)}
                named = {name for _, name in CITE.findall(unit) if name} if quoted else set()
                for name in sorted(named):
                    command = recorded_command(name)
                    same = {q for q in quoted if command and q.split()[:3] == command.split()[:3]}
                    if same and command not in same:
                        where = doc.relative_to(root).as_posix()
                        out.append(f"{where}: quotes {sorted(same)[0]!r} beside {name}, which `{command}` wrote")
    return out


def read_unverified(path: Path = UNVERIFIED) -> list[str]:
    if not path.exists():
        return []
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prune", action="store_true", help="drop entries of the unverified list that no longer occur")
    p.add_argument("--list", action="store_true", help="print every unsupported figure, listed or not")
    args = p.parse_args(argv)
    bad = unsupported(documents())
    keys = {fig.key() for fig in bad}
    listed = read_unverified()
    if args.prune:
        kept = [line for line in listed if line in keys]
        header = [line for line in UNVERIFIED.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
        UNVERIFIED.write_text("\n".join(header + kept) + "\n", encoding="utf-8")
        print(f"figures: {len(listed) - len(kept)} stale entries dropped, {len(kept)} left")
        return 0
    new = [fig for fig in bad if fig.key() not in set(listed)]
    for fig in bad if args.list else new:
        cites = ", ".join(fig.cited) or "no result file"
        print(f"{fig.doc}: {fig.text!r} is in none of {cites}: ...{fig.context}...")
    commands = wrong_commands(documents())
    for line in commands:
        print(line)
    stale = len(listed) - len(keys & set(listed))
    print(f"figures: {len(bad) - len(new)} listed as unverified in {UNVERIFIED.relative_to(REPO)}, "
          f"{len(new)} unsupported, {stale} stale entries (--prune); {len(commands)} commands quoted beside a "
          "results file that another command wrote", file=sys.stderr)
    return 1 if new or commands else 0


if __name__ == "__main__":
    sys.exit(main())
