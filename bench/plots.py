"""The evaluation's plots for docs/evaluation.md, drawn from the benchmarks' stored reports::

    python -m bench.plots [--results bench/results] [--out docs/img]

From ``quality.json`` (``python -m bench.quality``): P@1 per relation for the MLM, the kNN and BERT-kNN (its
retrieval run over the full vocabulary) and the temperature-factor sweep; from ``entities-popularity.json``
(``python -m bench.entities``): P@1 by the subject's popularity. Each as PNG and SVG.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import REPO, RESULTS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = p.parse_args(argv)
    from bertknn.evaluation.plots import popularity_plot, relations_plot, sweep_plot

    written: list[Path] = []
    quality = args.results / "quality.json"
    if quality.is_file():
        q = json.loads(quality.read_text(encoding="utf-8"))
        model = Path(q["model"]).name
        written += relations_plot(q["runs"]["retrieval_full"], args.out / "quality",
                                  f"LAMA, {q['datastore']['contexts']:,} contexts, {model}")  # fmt: skip
        sweep = q.get("factor_sweep") or []
        if sweep:
            xs = [s["multiple"] for s in sweep]
            runs = [q["runs"][s["runs"]["all"]]["macro"] for s in sweep]
            written += sweep_plot(
                xs, {"BERT-kNN": [r["bert_knn"]["p@1"] for r in runs], "kNN": [r["knn"]["p@1"] for r in runs]},
                args.out / "quality", name="temperature-sweep", xlabel="temperature factor (x the builder's fit)",
                title=f"temperature auto: l = factor x median distance ({model})",
            )  # fmt: skip
    popularity = args.results / "entities-popularity.json"
    if popularity.is_file():
        report = json.loads(popularity.read_text(encoding="utf-8"))
        if report.get("popularity"):
            written += popularity_plot(report["popularity"], args.out / "entities")
    if not written:
        p.error(f"no report to draw in {args.results} (run bench.quality or bench.entities first)")
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
