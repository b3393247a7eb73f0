"""Plots of an evaluation report (``bert-knn eval lama --plots DIR``), each as PNG and SVG.

- ``relations``: P@1 per relation for the MLM, the kNN and BERT-kNN (and the adaptive column when it was run);
- ``popularity``: P@1 by the subject's popularity bucket (``--by-popularity``);
- ``lambda-sweep``: the grid's macro P@1 against lambda at the best N and l, one line per k (``--grid``);
- `sweep_plot`: any one-parameter sweep of macro P@1 (``bench.quality``'s temperature factors).

matplotlib is an optional dependency (``pip install 'bertknn[plots]'``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from bertknn.core.errors import EvaluationError

COLUMNS = {"mlm": "MLM", "knn": "kNN", "bert_knn": "BERT-kNN", "bert_knn_adaptive": "adaptive"}
COLOURS = {"MLM": "#dd8a2c", "kNN": "#2b6cb0", "BERT-kNN": "#2f855a", "adaptive": "#805ad5"}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, no display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise EvaluationError("--plots needs matplotlib: pip install 'bertknn[plots]' (or matplotlib)") from exc
    return plt


def _save(fig: Any, out: Path, name: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.png", out / f"{name}.svg"]
    fig.tight_layout()
    plt = _pyplot()
    # no date, and element ids from a fixed salt: the same report draws the same SVG bytes, so a re-run does not
    # show unchanged plots as changed
    with plt.rc_context({"svg.hashsalt": "bertknn"}):
        for path in paths:
            fig.savefig(path, dpi=120, metadata={"Date": None} if path.suffix == ".svg" else None)
    plt.close(fig)
    return paths


def relations_plot(report: Mapping[str, Any], out: Path, title: str = "") -> list[Path]:
    """Grouped horizontal bars: P@1 of each column per relation (the report's ``relations``)."""
    plt = _pyplot()
    relations = report["relations"]
    names = sorted(relations, key=lambda r: (relations[r]["dataset"], r))
    columns = [c for c in COLUMNS if all(c in relations[r] for r in names)]
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(names) * len(columns) / 2 + 1.5))
    height = 0.8 / max(1, len(columns))
    for j, col in enumerate(columns):
        ys = [i + (j - (len(columns) - 1) / 2) * height for i in range(len(names))]
        label = COLUMNS[col]
        ax.barh(ys, [relations[r][col]["p@1"] for r in names], height=height, label=label, color=COLOURS[label])
    ax.set_yticks(range(len(names)), [f"{r} ({relations[r]['facts']})" for r in names], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("P@1 (%)")
    ax.set_xlim(0, 100)
    macro = report.get("macro", {})
    summary = ", ".join(f"{COLUMNS[c]} {macro[c]['p@1']:.1f}" for c in columns if c in macro)
    ax.set_title(f"{title or 'P@1 per relation'}\nmacro P@1: {summary}", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    return _save(fig, out, "relations")


def popularity_plot(popularity: Mapping[str, Any], out: Path) -> list[Path]:
    """P@1 per popularity bucket (``--by-popularity``), one line per column."""
    plt = _pyplot()
    buckets = popularity["buckets"]
    labels = [f"{b['popularity'][0]:g}-{b['popularity'][1]:g}\n(n={b['n']})" for b in buckets]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("MLM", "kNN", "BERT-kNN", "adaptive"):
        if all(name in b for b in buckets):
            ax.plot(labels, [b[name] for b in buckets], marker="o", label=name, color=COLOURS[name])
    ax.set_xlabel("subject's inbound links in the datastore (bucket)")
    ax.set_ylabel("P@1 (%, micro)")
    ax.set_title("P@1 by the subject's popularity", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out, "popularity")


def lambda_sweep_plot(points: Sequence[Mapping[str, Any]], out: Path) -> list[Path]:
    """The grid's macro P@1 against lambda at its best N and l, one line per k."""
    plt = _pyplot()
    best = max(points, key=lambda p: p["p@1"])
    at_best = [p for p in points if p["num_articles"] == best["num_articles"] and p["temperature"] == best["temperature"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    for k in sorted({p["k"] for p in at_best}):
        line = sorted((p["lambda"], p["p@1"]) for p in at_best if p["k"] == k)
        ax.plot([x for x, _ in line], [y for _, y in line], marker="o", label=f"k={k}")
    ax.set_xlabel("lambda (kNN weight)")
    ax.set_ylabel("macro P@1 (%), dev split")
    ax.set_title(f"lambda sweep at N={best['num_articles']}, l={best['temperature']:g}", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out, "lambda-sweep")


def sweep_plot(xs: Sequence[float], series: Mapping[str, Sequence[float]], out: Path, *, name: str, xlabel: str,
               title: str) -> list[Path]:  # fmt: skip
    """Macro P@1 of several columns against one swept parameter."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, ys in series.items():
        ax.plot(xs, ys, marker="o", label=label, color=COLOURS.get(label))
    ax.set_xlabel(xlabel)
    ax.set_ylabel("macro P@1 (%)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, out, name)


def write_plots(report: Mapping[str, Any], out: Path, title: str = "") -> list[Path]:
    """Every plot the report has the data for."""
    paths = relations_plot(report, out, title)
    if report.get("popularity"):
        paths += popularity_plot(report["popularity"], out)
    grid = report.get("settings", {}).get("grid") or {}
    if grid.get("sweep"):
        paths += lambda_sweep_plot(grid["sweep"], out)
    return paths
