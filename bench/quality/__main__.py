"""Real-data quality benchmark, one command: ``python -m bench.quality`` (``--help`` for the options).

1. Queries: the LAMA probe (T-REx relations that have evidence files, Google-RE, SQuAD) built as
   ``python -m evaluation lama`` builds them, the first ``--limit`` facts per relation (default 30).
2. Corpus (``bench/quality/corpus.py``): the subject articles of those facts (T-REx evidence sentences grouped
   per subject; the Google-RE Wikipedia snippets of those facts) plus ``--distractors`` vital Wikipedia articles
   (default 500, a fixed sample by title hash) as distractors for BM25 and the whole-datastore kNN. ``--full`` takes every
   article of ``wiki/`` and every T-REx subject instead (hours on 2 CPU cores).
3. Datastore: built with the real builder (``--model``, default the proxy MiniLM MLM), BM25 + TF-IDF + IVF-PQ
   indexes; reused when the corpus and model are unchanged (``--rebuild`` forces a new build).
4. Evaluation, one in-process pipeline (each query's forward pass runs once for all runs), service defaults
   (k=128, temperature auto, lambda=0.3) unless said otherwise:
   - ``retrieval``: the service's article choice: the subject's own article alone when it has one (T-REx,
     Google-RE), else the BM25 top N=3 (SQuAD);
   - ``no_retrieval``: kNN over the whole datastore (IVF-PQ);
   each with the full vocabulary and with LAMA's common vocabulary; then a grid search on the dev split (20 %,
   by hash of the fact id) with the best setting evaluated on the rest (``tuned``), once on the paper's grid and
   once with l up to 32 (``tuned_wide_l``: the l range suits bert-base's distance scale, not every model's), and
   the default settings on that same rest (``retrieval_test``), to compare like with like; ``--no-grid`` skips
   the three;
   - ``--factor-sweep``: the defaults with temperature auto's factor scaled, on all facts and on that rest;
   - ``--prior-sweep``: the defaults with the vote's ``mlm_prior`` set to each value, over both vocabularies (the
     figures behind docs/decisions/mlm-weighted-vote.md).

Writes ``bench/results/quality.json`` (every report in the ``--out`` format of ``python -m evaluation lama``,
with the subset, corpus, datastore and wall times) and ``bench/results/quality.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_json

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
PROXY_MODEL = SHARED / "models" / "proxy-minilm-l6-mlm"

logger = logging.getLogger("bench.quality")


def _numbers(text: str, example: str) -> list[float]:
    """Comma-separated numbers (empty: none); ``example`` goes into the error."""
    try:
        return [float(m) for m in text.split(",") if m.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated numbers, e.g. {example}") from None


def _multiples(text: str) -> list[float]:
    """``--factor-sweep``: comma-separated positive numbers (empty: none)."""
    values = _numbers(text, "0.75,1,1.5")
    if not all(v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every multiple must be > 0")
    return values


def _priors(text: str) -> list[float]:
    """``--prior-sweep``: comma-separated numbers >= 0 (empty: none)."""
    values = _numbers(text, "0,0.15,0.5")
    if not all(v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every mlm_prior must be >= 0")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=str(PROXY_MODEL), help="masked LM directory or name")
    p.add_argument("--data", type=Path, default=SHARED / "data", help="directory holding lama/ and wiki/")
    p.add_argument(
        "--work", type=Path, default=REPO / "runs" / "bench-quality", help="corpus and datastore go here"
    )
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results", help="reports go here")
    p.add_argument("--limit", type=int, default=30, help="facts per relation (first N kept, file order)")
    p.add_argument("--distractors", type=int, default=300, help="vital articles added as distractors")
    p.add_argument(
        "--fact-sentences", type=int, default=20, help="evidence sentences kept per evaluated T-REx fact (the median "
        "fact has 3; a few have thousands)"
    )
    p.add_argument(
        "--other-sentences",
        type=int,
        default=5,
        help="per T-REx subject article, evidence sentences of facts not evaluated kept at most",
    )
    p.add_argument("--full", action="store_true", help="every article and every fact (hours on 2 CPU cores)")
    p.add_argument(
        "--vocab", type=Path, help="LAMA common vocabulary (default lama/common_vocab_lowercased.txt)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = CPU quota)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    p.add_argument("--batch-size", type=int, default=32, help="evaluation batch size")
    p.add_argument("--rebuild", action="store_true", help="build the datastore again even if it is current")
    p.add_argument(
        "--no-grid", dest="grid", action="store_false", help="skip the grid search on the dev split"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--codecs",
        default="int8,pq96,pq64,pq32,pq16,pq8,pq64-opq",
        help="compact copies of the datastore evaluated as rows (`recode`; reused when current): int8, pqM (M-byte "
        "product-quantizer codes, no rotation), pqM-opq (after an OPQ rotation), pqM-pcaD (PCA to D dimensions); "
        "empty: none",
    )
    p.add_argument(
        "--factor-sweep",
        type=_multiples,
        default="0.75,0.9,1,1.1,1.25,1.5,2",
        help="multiples of temperature auto's factor (the builder's a) evaluated at otherwise default settings, on all "
        "facts and on the grid's test split; empty: none",
    )
    p.add_argument(
        "--prior-sweep",
        type=_priors,
        default="0,0.05,0.1,0.15,0.2,0.25,0.5",
        help="values of the vote's mlm_prior evaluated at otherwise default settings, over the full and the common "
        "vocabulary; empty: none",
    )
    return p


def codec_spec(name: str):  # noqa: ANN201 (bertknn is imported late, in main)
    """``int8``, ``pq64``, ``pq64-opq``, ``pq64-pca192`` -> the CodecSpec."""
    from bertknn.core.format.codec import CodecSpec

    if name == "int8":
        return CodecSpec("int8")
    head, _, rot = name.partition("-")
    if not head.startswith("pq") or not head[2:].isdigit():
        raise SystemExit(f"--codecs: {name!r} is not int8, pqM, pqM-none or pqM-pcaD")
    if rot.startswith("pca") and rot[3:].isdigit():
        return CodecSpec("pq", int(head[2:]), "pca", int(rot[3:]))
    if rot in ("", "none"):
        return CodecSpec("pq", int(head[2:]), "none")
    if rot == "opq":
        return CodecSpec("pq", int(head[2:]), "opq")
    raise SystemExit(f"--codecs: {name!r}: the rotation is none (default), opq or pcaD")


def storage(manifest, root: Path) -> dict:  # noqa: ANN001
    """Bytes per context on disk: what the codec budget counts (vectors or codes, labels, references; everything in
    the shards but the sentences' text), the text apart, and the codec file (fixed, whatever the size)."""
    contexts = max(1, manifest.counts.contexts)
    files: dict[str, int] = {}
    for s in manifest.shards:
        for name, f in s.files.items():
            files[name] = files.get(name, 0) + f.bytes
    text = files.get("sentences.txt", 0)
    codec = (root / manifest.codec.file).stat().st_size if manifest.codec else 0
    return {
        "bytes_per_context": round((sum(files.values()) - text) / contexts, 1),
        "text_bytes_per_context": round(text / contexts, 1),
        "per_file_bytes_per_context": {k: round(v / contexts, 2) for k, v in sorted(files.items())},
        "codec_file_bytes": codec,
    }


def search_ms(datastore, title_sets: list[list[str]], queries: list, *, k: int = 128, repeats: int = 3) -> dict:  # noqa: ANN001
    """The restricted kNN's cost per query over the same articles (so the same rows) for every datastore: read the
    rows, index them, search k. Best of ``repeats`` passes (the page cache is warm after the first)."""
    from bertknn.service.retrieval.knn import RestrictedKnn

    knn = RestrictedKnn(datastore)
    rows = sum(len(knn.prepare(t).rows) for t in title_sets)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for titles, q in zip(title_sets, queries, strict=True):
            knn.prepare(titles).search(q, k)
        best = min(best, time.perf_counter() - t0)
    return {"ms_per_query": round(1000 * best / len(title_sets), 4), "rows_per_query": round(rows / len(title_sets), 1)}


def _auto(pipeline) -> dict:  # noqa: ANN001
    """What temperature auto stands for with a pipeline's datastore: the factor of each query's median neighbour
    distance (None: one l for every query) and the l at the builder's sample's median."""
    auto = pipeline.assembler.auto_temperature
    return {"factor": auto.factor, "typical": auto.typical}


def _calibrated(ds: Path) -> None:
    """Measure the distance scale again when a reused datastore was measured with another statistic (what
    `python -m datastore_builder calibrate` does), so its rows show the current ``temperature: auto``."""
    from bertknn.core.calibration import STATISTIC, recalibrate
    from bertknn.core.format import read_manifest

    man = read_manifest(ds)
    if man.distance_scale is None or man.distance_scale.statistic != STATISTIC:
        recalibrate(ds, man)


def _datastore_is_current(ds: Path, corpus_sha: str, model_sha: str) -> bool:
    from bertknn.core.format import read_manifest, validate_datastore

    if not (ds / "manifest.json").is_file():
        return False
    man = read_manifest(ds)
    same = [s.sha256 for s in man.sources] == [corpus_sha] and man.model.weights_sha256 == model_sha
    return same and {"bm25", "ivfpq"} <= set(man.indexes) and not validate_datastore(ds, hashes=False)


RUN_LABELS = {
    "retrieval": "subject article (no subject: BM25 top 3)",
    "retrieval_paper": "subject article (no subject: BM25 top 3), the paper's vote (mlm_prior 0, articles equal)",
    "retrieval_l6": "subject article (no subject: BM25 top 3), the paper's method (l=6, its vote)",
    "retrieval_test": "subject article (no subject: BM25 top 3), test split",
    "no_retrieval": "none: whole datastore (IVF-PQ)",
    "tuned": "grid-tuned on dev, test split",
    "tuned_wide_l": "grid-tuned, l up to 32, test split",
}
# The paper's l range (5-12) suits bert-base-uncased's distances; other models' distance scales differ (the proxy
# MiniLM's squared distances are ~70-160), so the benchmark also searches a wider l axis and reports both.
WIDE_L = (5.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)
NAMES = {"mlm": "MLM", "knn": "kNN", "bert_knn": "BERT-kNN"}


def _search_sets(pipeline, queries: list) -> dict[str, tuple[list[list[str]], list[np.ndarray]]]:  # noqa: ANN001
    """Three sizes of row sets, the same for every codec: each query's subject article (the subject rule), and the
    BM25 top 3 (the service's default without a subject) and top 30 of its text; the query vector is a stored
    vector of the first article (what a query near its facts looks like)."""
    from bertknn.service.results import Query

    rng = np.random.default_rng(0)
    fp16 = pipeline.datastore
    sizes: dict[str, tuple[list[list[str]], list[np.ndarray]]] = {"subject": ([], []), "bm25-3": ([], []),
                                                                   "bm25-30": ([], [])}  # fmt: skip
    for q in queries:
        entry = fp16.articles.get(q.subject) if q.subject else None
        if entry is None or entry.rows == 0:
            continue
        vec = fp16.float_rows(entry.shard, np.array([entry.row_start + int(rng.integers(entry.rows))]))[0]
        sizes["subject"][0].append([entry.title])
        sizes["subject"][1].append(vec)
        for name, n in (("bm25-3", 3), ("bm25-30", 30)):
            hits, _ = pipeline.articles.retrieve(Query(text=q.text, retriever="bm25", num_articles=n))
            sizes[name][0].append([h.title for h in hits])
            sizes[name][1].append(vec)
    return sizes


def _recoded(args, ds: Path, man, name: str) -> tuple[Path, float]:  # noqa: ANN001
    """The datastore recoded with codec ``name`` (reused when it was made from this datastore with the same
    codec), calibrated; and the seconds it took."""
    from bertknn.builder.recode import recode_datastore

    spec = codec_spec(name)
    dst = args.work / f"datastore-{name}"
    marker = args.work / f"datastore-{name}.source.json"
    want = {"source": man.datastore_id, "spec": repr(spec)}
    t = time.perf_counter()
    if not (marker.is_file() and json.loads(marker.read_text()) == want and (dst / "manifest.json").is_file()):
        shutil.rmtree(dst, ignore_errors=True)
        recode_datastore(ds, dst, spec)
        marker.write_text(json.dumps(want))
    _calibrated(dst)
    return dst, time.perf_counter() - t


def _codec_rows(args, encoder, ds: Path, man, queries: list, pipeline, run) -> dict:  # noqa: ANN001
    """Each --codecs entry: a compact copy of the datastore (recode, reused when current), evaluated at the default
    settings (full vocabulary) with its own pipeline; its bytes per context and restricted search time, the latter
    over the same articles (so the same rows) as fp16's."""
    from bertknn.core.format import Datastore, read_manifest
    from bertknn.evaluation.runner import RunSettings
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.pipeline import AnswerPipeline

    sizes = _search_sets(pipeline, queries)

    def searches(datastore) -> dict:  # noqa: ANN001
        return {name: search_ms(datastore, sets, vecs) for name, (sets, vecs) in sizes.items()}

    rows: dict[str, dict] = {
        "fp16": {"codec": "fp16", **storage(man, ds), "search": searches(pipeline.datastore),
                 "temperature_auto": _auto(pipeline), "run": "retrieval_full"},
    }  # fmt: skip
    for name in [n for n in args.codecs.split(",") if n]:
        dst, recode_s = _recoded(args, ds, man, name)
        coded = read_manifest(dst)
        pipe = AnswerPipeline(encoder, Datastore(dst), cache=InMemoryCache(1 << 18))
        try:
            key = f"codec_{name}_full"
            run("retrieval", "full", queries, RunSettings(batch_size=args.batch_size), {"codec": name}, pipe, key)
            rows[name] = {
                "codec": coded.codec.factory if coded.codec else name, **storage(coded, dst),
                "search": searches(pipe.datastore), "temperature_auto": _auto(pipe),
                "recode_s": round(recode_s, 1), "run": key,
            }  # fmt: skip
        finally:
            pipe.close()
    return rows

def _factor_rows(args, pipeline, ds: Path, man, probe, run) -> list[dict]:  # noqa: ANN001
    """--factor-sweep: the default settings with auto's factor ``a`` scaled by each multiple (the datastore opened
    with a manifest whose distance scale is scaled; nothing on disk changes), on all facts and on the grid's test
    split: how far the builder's leave-one-out ``a`` lies from LAMA's own optimum, for P@1 and for P@10. Each
    pipeline shares ``pipeline``'s model and cache (encodings and retrieval results do not depend on the
    temperature), so no query's forward pass runs again."""
    from bertknn.core.calibration import STATISTIC
    from bertknn.core.format import Datastore
    from bertknn.evaluation.runner import RunSettings
    from bertknn.service.pipeline import AnswerPipeline

    scale = man.distance_scale
    multiples: list[float] = args.factor_sweep
    if not multiples or scale is None or scale.statistic != STATISTIC or not scale.typical:
        return []
    rows = []
    for m in multiples:
        scaled = scale.model_copy(update={"value": scale.value * m, "typical": scale.typical * m})
        pipe = AnswerPipeline(pipeline.encoder, Datastore(ds, man.model_copy(update={"distance_scale": scaled})),
                              cache=pipeline.cache)  # fmt: skip
        try:
            keys = {}
            for split, queries in (("all", probe.queries), ("test", probe.for_split("test"))):
                keys[split] = f"factor_{m:g}_{split}"
                extra = {"factor_multiple": m, "split": split}
                run("retrieval", "full", queries, RunSettings(batch_size=args.batch_size), extra, pipe, keys[split])
            rows.append({"multiple": m, "factor": scaled.value, "typical": scaled.typical, "runs": keys})
        finally:
            pipe.release()  # its retrievers; the shared cache stays open
    return rows


def _prior_rows(args, qs: _Queries, run) -> list[dict]:  # noqa: ANN001
    """--prior-sweep: the default settings with the vote's ``mlm_prior`` set to each value (``article_sharpness``
    stays the default's), over all facts in both vocabularies. The pipeline's cache keeps every query's forward
    pass and retrieval, so each row costs only its votes."""
    from bertknn.evaluation.runner import RunSettings

    rows = []
    for b in args.prior_sweep:
        keys = {vocab: f"prior_{b:g}_{vocab}" for vocab in ("full", "common")}
        for vocab, queries in (("full", qs.probe.queries), ("common", qs.common_queries)):
            settings = RunSettings(batch_size=args.batch_size).with_(mlm_prior=b)
            run("retrieval", vocab, queries, settings, {"prior_sweep": b}, None, keys[vocab])
        rows.append({"mlm_prior": b, "runs": keys})
    return rows


def _md_header(runs: dict[str, dict], meta: dict) -> list[str]:
    """The report's title, model, datastore, settings, timings and grid lines."""
    t = meta["timings_s"]
    lines = [
        "# Quality benchmark (LAMA)",
        "",
        f"- Model: `{Path(meta['model']).name}` ({meta['model']}); datastore: {meta['datastore']['articles']} "
        f"articles, {meta['datastore']['contexts']} contexts, layer {meta['datastore']['layer']}.",
        f"- Subset: {meta['subset']['description']}.",
        "- Settings: k=128, lambda=0.3, the vote weighted by p_MLM^0.15 (mlm_prior), lower-ranked articles' "
        "neighbours counting less (article_sharpness 10), "
        f"temperature auto (the service's defaults; auto is the datastore's own l, "
        f"relative to each query's neighbours: l = {meta['temperature_auto']['factor']:.3f} x their median squared "
        f"distance, the factor measured by the builder; {meta['temperature_auto']['typical']:.2f} at its sample's "
        "median) unless the row says otherwise; no retrieval = "
        "kNN over the whole datastore (IVF-PQ, nprobe 64, candidates re-ranked with their stored vectors).",
        f"- Wall time: {t['total']:.0f} s on {meta['machine']['cores']} CPU cores "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in t.items() if k != 'total')}).",
        "- Macro P@k (%): per relation first, then the mean over relations; 'overall' is the mean over all relations of "
        "all datasets (each relation weighs the same).",
    ]
    for name, axes in (("tuned", "l 5-12 (the paper's grid)"), ("tuned_wide_l", "l " + "/".join(f"{x:g}" for x in WIDE_L))):
        if name not in runs:
            continue
        g = runs[name]["settings"]["grid"]
        b = g["best"]
        lines.append(
            f"- Grid (N 1-5, lambda 0.2-0.8, k 64/128/512, {axes}) on the dev split ({g['dev_queries']} queries): "
            f"best N={b['num_articles']}, lambda={b['lambda']}, k={b['k']}, l={b['temperature']} "
            f"(dev macro P@1 {g['best_dev_macro_bert_knn']['p@1']:.1f}); its rows are on the other 80 %."
        )
    lines.append("")
    return lines


def _md_vocab_tables(runs: dict[str, dict], meta: dict) -> list[str]:
    """Per vocabulary, a table of each dataset's and the overall macro P@1 and P@10 by run."""
    cols = ("mlm", "knn", "bert_knn")
    lines: list[str] = []
    for vocab_name, title in (
        ("full", "Full vocabulary"),
        ("common", "LAMA common vocabulary (ranking and facts)"),
    ):
        subset = {
            k: v for k, v in runs.items()
            if v["settings"]["vocab_name"] == vocab_name and not {"codec", "factor_multiple", "prior_sweep"} & set(v["settings"])
        }
        if not subset:
            continue
        lines += [f"## {title}", ""]
        lines.append(
            "| dataset | rel. | facts | retrieval | "
            + " | ".join(f"{NAMES[c]} P@1" for c in cols)
            + " | "
            + " | ".join(f"{NAMES[c]} P@10" for c in cols)
            + " |"
        )
        lines.append("|---|---:|---:|---|" + "---:|" * (2 * len(cols)))
        datasets = list(next(iter(subset.values()))["datasets"])
        for ds in [*datasets, "overall"]:
            for run_name, rep in subset.items():
                if ds == "overall":
                    block = rep["macro"]
                    nrel, nfacts = len(rep["relations"]), sum(r["facts"] for r in rep["relations"].values())
                else:
                    block = rep["datasets"][ds]
                    nrel, nfacts = block["relations"], block["facts"]
                cells = [f"{block[c]['p@1']:.1f}" for c in cols] + [f"{block[c]['p@10']:.1f}" for c in cols]
                name = f"**{ds}**" if ds == "overall" else ds
                lines.append(
                    f"| {name} | {nrel} | {nfacts} | {RUN_LABELS[run_name.rsplit('_', 1)[0]]} | "
                    + " | ".join(cells)
                    + " |"
                )
        lines.append("")
    return lines


def _md_codecs(runs: dict[str, dict], meta: dict) -> list[str]:
    """The codecs' table: bytes per context, quality and search time against fp16."""
    cols = ("mlm", "knn", "bert_knn")
    lines: list[str] = []
    codecs = meta.get("codecs") or {}
    if codecs:
        base = codecs["fp16"]["search"]
        sizes = list(base)
        lines += [
            "## Codecs (compact copies of the same datastore: `recode`), full vocabulary, default settings",
            "",
            "Bytes per context: the shards' files but the sentences' text (vectors or codes, labels, sentence ids, "
            "spans, sentence offsets, article lists); the text and the codec file (a fixed size) apart. Search: the "
            "restricted kNN (read the rows, index, search k=128) per query, ms and the ratio to fp16 on the same rows, "
            "best of 3 passes, over each query's subject article ("
            + ", ".join(f"{s}: {base[s]['rows_per_query']:.0f} rows" for s in sizes)
            + " per query on average; bm25-N: the BM25 top N of the query's text).",
            "",
            "| codec | bytes/context | text bytes/context | codec file | l (auto) | MLM P@1 | kNN P@1 | BERT-kNN P@1 "
            "| MLM P@10 | kNN P@10 | BERT-kNN P@10 | " + " | ".join(f"search {s}" for s in sizes) + " |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(sizes),
        ]
        for name, row in codecs.items():
            m = runs[row["run"]]["macro"]
            lines.append(
                f"| {name} ({row['codec']}) | {row['bytes_per_context']:.1f} | {row['text_bytes_per_context']:.1f} | "
                f"{row['codec_file_bytes']:,} | {row['temperature_auto']['typical']:.1f} | "
                + " | ".join(f"{m[c]['p@1']:.1f}" for c in cols) + " | "
                + " | ".join(f"{m[c]['p@10']:.1f}" for c in cols)
                + " | "
                + " | ".join(
                    f"{row['search'][s]['ms_per_query']:.3f} ({row['search'][s]['ms_per_query'] / base[s]['ms_per_query']:.2f}x)"
                    for s in sizes
                )
                + " |"
            )
        lines.append("")
    return lines


def _md_factor_sweep(runs: dict[str, dict], meta: dict) -> list[str]:
    """Temperature auto's factor scaled: quality and the P@10 gap per multiple."""
    lines: list[str] = []
    sweep = meta.get("factor_sweep") or []
    if sweep:
        n_all = sum(r["facts"] for r in runs[sweep[0]["runs"]["all"]]["relations"].values())
        n_test = sum(r["facts"] for r in runs[sweep[0]["runs"]["test"]]["relations"].values())
        lines += [
            "## Temperature auto's factor scaled (full vocabulary, default settings otherwise)",
            "",
            f"Each row multiplies the builder's factor a = {meta['temperature_auto']['factor']:.3f} (l = a x the "
            "median of each query's neighbour distances); gap = kNN P@10 - BERT-kNN P@10. "
            f"All: {n_all} facts; test: the grid's test split ({n_test} facts).",
            "",
            "| multiple | a | l at the sample's median | BERT-kNN P@1 / P@10, all | kNN P@10, all | gap, all "
            "| BERT-kNN P@1 / P@10, test | kNN P@10, test | gap, test |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in sweep:
            cells = [f"{row['multiple']:g}", f"{row['factor']:.3f}", f"{row['typical']:.1f}"]
            for split in ("all", "test"):
                m = runs[row["runs"][split]]["macro"]
                cells += [
                    f"{m['bert_knn']['p@1']:.2f} / {m['bert_knn']['p@10']:.2f}",
                    f"{m['knn']['p@10']:.2f}",
                    f"{m['knn']['p@10'] - m['bert_knn']['p@10']:.2f}",
                ]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _md_prior_sweep(runs: dict[str, dict], meta: dict) -> list[str]:
    """The vote's mlm_prior: BERT-kNN's and kNN's P@1 / P@10 per value, in both vocabularies."""
    sweep = meta.get("prior_sweep") or []
    if not sweep:
        return []
    lines = [
        "## The vote's mlm_prior (default settings otherwise)",
        "",
        "Each row weights the neighbours' vote by p_MLM to this power (0: the paper's plain vote); the articles stay "
        "weighted by their score (article_sharpness 10). Macro P@1 / P@10.",
        "",
        "| mlm_prior | BERT-kNN, full | kNN, full | BERT-kNN, common | kNN, common |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in sweep:
        cells = [f"{row['mlm_prior']:g}"]
        for vocab in ("full", "common"):
            m = runs[row["runs"][vocab]]["macro"]
            cells += [f"{m[c]['p@1']:.1f} / {m[c]['p@10']:.1f}" for c in ("bert_knn", "knn")]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _markdown(runs: dict[str, dict], meta: dict) -> str:
    lines = [
        *_md_header(runs, meta), *_md_vocab_tables(runs, meta), *_md_codecs(runs, meta), *_md_factor_sweep(runs, meta),
        *_md_prior_sweep(runs, meta),
    ]
    return "\n".join(lines) + "\n"

@dataclass
class _Queries:
    """The probe's queries (the model's tokenizer decides which objects are single wordpieces), the same facts
    within LAMA's common vocabulary, and which facts' subjects the corpus needs."""

    probe: Any
    common: Any  # ObjectVocabulary restricted to the common vocabulary
    common_queries: list
    vocab_path: Path
    trex_subjects: set[str]
    trex_uids: set[str]
    gre_uids: set[str]


def _queries(args: argparse.Namespace, limit: int | None) -> _Queries:
    from transformers import AutoTokenizer

    from bertknn.evaluation.lama import (
        GOOGLE_RE,
        TREX,
        ObjectVocabulary,
        discover_relations,
        load_probe,
        load_vocab_file,
    )

    lama_dir = args.data / "lama"
    tokenizer = AutoTokenizer.from_pretrained(args.model, use_fast=True)
    probe = load_probe(discover_relations(lama_dir, trex="evidence"), ObjectVocabulary(tokenizer), limit=limit)
    vocab_path = args.vocab or lama_dir / "common_vocab_lowercased.txt"
    common = ObjectVocabulary(tokenizer, load_vocab_file(vocab_path))
    # the same facts (their subject articles are in the corpus), minus those whose object is outside the common
    # vocabulary: here the limit applies before that filter
    allowed_tokens = common.restrict or frozenset()
    return _Queries(
        probe, common, [q for q in probe.queries if q.obj in allowed_tokens], vocab_path,
        {q.subject for q in probe.queries if q.dataset == TREX and q.subject},
        {q.uid for q in probe.queries if q.dataset == TREX}, {q.uid for q in probe.queries if q.dataset == GOOGLE_RE},
    )  # fmt: skip


def _corpus(args: argparse.Namespace, qs: _Queries, distractors: int | None) -> tuple[Path, Any]:
    """The benchmark corpus (`bench.quality.corpus`) for these queries: its path and its statistics."""
    from bench.quality.corpus import write_corpus

    args.work.mkdir(parents=True, exist_ok=True)
    path = args.work / "corpus.jsonl"
    full = bool(args.full)
    stats = write_corpus(
        path, wiki_dir=args.data / "wiki", lama_dir=args.data / "lama",
        trex_subjects=None if full else qs.trex_subjects, trex_uids=None if full else qs.trex_uids,
        google_re_uids=None if full else qs.gre_uids, distractors=distractors,
        max_fact_sentences=None if full else args.fact_sentences,
        max_other_sentences=None if full else args.other_sentences,
    )  # fmt: skip
    return path, stats


def _datastore(args: argparse.Namespace, encoder: Any, corpus: Path, threads: int) -> tuple[Path, bool]:
    """The datastore of the corpus (with IVF-PQ; reused when the corpus and the model are unchanged), calibrated;
    whether it was reused."""
    from bertknn.builder.build import build
    from bertknn.builder.settings import BuildSettings
    from bertknn.core.format import sha256_file

    ds = args.work / "datastore"
    reused = not args.rebuild and _datastore_is_current(ds, sha256_file(corpus), encoder.weights_sha256)
    if not reused:
        if ds.exists():
            shutil.rmtree(ds)
        build(
            BuildSettings(corpus=[corpus], model=args.model, out=ds, device=args.device, ivfpq=True, threads=threads,
                          workers=1, batch_size=128),
            encoder=encoder,
        )  # fmt: skip
    _calibrated(ds)
    return ds, reused


@dataclass
class _Runs:
    """The evaluation runs of one benchmark: each a report under its key, its time in ``timings``."""

    args: argparse.Namespace
    ds: Path
    pipeline: Any  # AnswerPipeline: one, so each query's forward pass (and retrieval) is computed once for all runs
    qs: _Queries
    limit: int | None
    timings: dict[str, float]
    runs: dict[str, dict] = field(default_factory=dict)

    def run(
        self, name: str, vocab_name: str, queries: list, settings: Any, extra: dict | None = None,
        pipe: Any = None, key: str | None = None,
    ) -> None:  # fmt: skip
        from bertknn.evaluation.metrics import format_table, report_dict, summarize
        from bertknn.evaluation.runner import PipelineRunner

        allowed = self.qs.common.allowed_ids() if vocab_name == "common" else None
        runner = PipelineRunner(pipe or self.pipeline, allowed_ids=allowed, progress=not self.args.quiet)
        t0 = time.perf_counter()
        summary = summarize(runner.run(queries, settings))
        elapsed = time.perf_counter() - t0
        self.timings[f"eval {key or name} {vocab_name}"] = elapsed
        self.runs[key or f"{name}_{vocab_name}"] = report_dict(summary, {
            "model": self.args.model, "datastore": str(self.ds), "run": RUN_LABELS[name],
            "retriever": settings.retriever,
            "num_articles": None if settings.retriever == "none" else settings.num_articles,
            "k": settings.k, "temperature": settings.temperature if settings.temperature is not None else "auto",
            "temperature_used": settings.temperature if settings.temperature is not None else "auto: per query",
            "temperature_auto": _auto(pipe or self.pipeline), "lambda": settings.lambda_,
            "mlm_prior": settings.mlm_prior, "article_sharpness": settings.article_sharpness,
            "vocab_name": vocab_name, "vocab": str(self.qs.vocab_path) if vocab_name == "common" else None,
            "limit": self.limit, "queries": len(queries), "wall_s": round(elapsed, 1),
            "averages": "macro: per relation first, then mean over relations; 'macro' = mean over all relations of "
            "all datasets",
            **(extra or {}),
        })  # fmt: skip
        print(format_table(summary, title=f"\n{RUN_LABELS[name]}, {vocab_name} vocabulary: P@1/P@5/P@10 in %"))

    def grid_rows(self, base: Any) -> None:
        """--grid: the paper's grid and one with l up to 32, each searched on dev, its best run on test (beside
        the defaults on the same test queries)."""
        from bertknn.evaluation.grid import GridSpace, grid_search
        from bertknn.evaluation.lama import DEV_PERCENT

        probe = self.qs.probe
        self.run("retrieval_test", "full", probe.for_split("test"), base, {"split": "test"})
        for name, space in (("tuned", GridSpace()), ("tuned_wide_l", GridSpace(temperatures=WIDE_L))):
            t = time.perf_counter()
            result = grid_search(self.pipeline, probe.for_split("dev"), space=space, batch_size=self.args.batch_size,
                                 progress=not self.args.quiet)  # fmt: skip
            self.timings[f"grid {name}"] = time.perf_counter() - t
            print(result.format())
            grid_info = {
                "space": {"N": space.num_articles, "lambda": space.lambdas, "k": space.ks, "l": space.temperatures},
                "dev_split": f"sha256(fact id) mod 100 < {DEV_PERCENT}",
                "dev_queries": result.queries,
                "best": result.best.as_dict(),
                "best_dev_macro_bert_knn": {k: round(v, 2) for k, v in result.ranking[0][1].items()},
                "top10": [{**pt.as_dict(), **{k: round(v, 2) for k, v in p.items()}} for pt, p in result.ranking[:10]],
            }
            self.run(name, "full", probe.for_split("test"), result.best.apply(base), {"split": "test", "grid": grid_info})


def _meta(args: argparse.Namespace, qs: _Queries, limit: int | None, distractors: int | None, corpus_stats: Any,
          man: Any, reused: bool, codecs: dict, sweep: list, priors: list, timings: dict[str, float],
          threads: int) -> dict:  # fmt: skip
    """The report's description of what was run, on what, and how long it took."""
    probe, common_queries = qs.probe, qs.common_queries
    n_rel = len({q.relation for q in probe.queries})
    return {
        "model": args.model,
        "subset": {
            "full": bool(args.full),
            "limit_per_relation": limit,
            "distractor_vital_articles": distractors,
            "evidence_sentences_per_fact": None if args.full else args.fact_sentences,
            "other_sentences_per_subject": None if args.full else args.other_sentences,
            "relations": n_rel,
            "queries_full_vocab": len(probe.queries),
            "queries_common_vocab": len(common_queries),
            "description": (
                "every fact, every article"
                if args.full
                else f"the first {limit} facts per relation of T-REx (the 22 relations with evidence files), "
                f"Google-RE (2) and SQuAD: {len(probe.queries)} queries, {n_rel} relations "
                f"({len(common_queries)} with the common vocabulary); corpus = their subject articles (T-REx: the "
                f"first {args.fact_sentences} evidence sentences of each evaluated fact + at most "
                f"{args.other_sentences} sentences of other facts per subject; Google-RE: the facts' Wikipedia "
                f"snippets) + {distractors} vital Wikipedia articles"
            ),
        },
        "corpus": corpus_stats.as_dict(),
        "datastore": {**man.counts.model_dump(), "layer": man.layer, "id": man.datastore_id, "reused": reused},
        "codecs": codecs,
        "temperature_auto": codecs["fp16"]["temperature_auto"],
        "factor_sweep": sweep,
        "prior_sweep": priors,
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "machine": {"cores": os.cpu_count(), "torch_threads": threads, "python": platform.python_version()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    import torch

    from bertknn.core.encoder import MaskedLMEncoder
    from bertknn.core.format import Datastore, read_manifest
    from bertknn.core.runtime import cpu_quota_threads
    from bertknn.evaluation.runner import RunSettings
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.pipeline import AnswerPipeline

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    threads = args.threads or cpu_quota_threads()
    torch.set_num_threads(threads)
    limit = None if args.full else args.limit
    distractors = None if args.full else args.distractors
    qs = _queries(args, limit)  # 1. queries
    t = time.perf_counter()
    corpus, corpus_stats = _corpus(args, qs, distractors)  # 2. corpus
    timings["corpus"] = time.perf_counter() - t
    t = time.perf_counter()
    encoder = MaskedLMEncoder.load(args.model, layer=-2, device=args.device)
    ds, reused = _datastore(args, encoder, corpus, threads)  # 3. datastore
    timings["build"] = time.perf_counter() - t
    man = read_manifest(ds)
    logger.info("datastore %s: %s%s", ds, man.counts.model_dump(), " (reused)" if reused else "")
    # 4. evaluation
    runs = _Runs(args, ds, AnswerPipeline(encoder, Datastore(ds), cache=InMemoryCache(1 << 18)), qs, limit, timings)
    base = RunSettings(batch_size=args.batch_size)
    plan = [
        ("retrieval", base),
        ("retrieval_paper", base.with_(mlm_prior=0.0, article_sharpness=0.0)),
        ("retrieval_l6", base.with_(temperature=6.0, mlm_prior=0.0, article_sharpness=0.0)),
        ("no_retrieval", base.with_(retriever="none")),
    ]
    try:
        for vocab_name, queries in (("full", qs.probe.queries), ("common", qs.common_queries)):
            for name, settings in plan:
                runs.run(name, vocab_name, queries, settings)
        if args.grid:
            runs.grid_rows(base)
        codecs = _codec_rows(args, encoder, ds, man, qs.probe.queries, runs.pipeline, runs.run)
        sweep = _factor_rows(args, runs.pipeline, ds, man, qs.probe, runs.run)
        priors = _prior_rows(args, qs, runs.run)
    finally:
        runs.pipeline.close()
    timings["total"] = time.perf_counter() - t_start
    meta = _meta(args, qs, limit, distractors, corpus_stats, man, reused, codecs, sweep, priors, timings, threads)
    write_json(args.results / "quality.json", {**meta, "runs": runs.runs})
    md = _markdown(runs.runs, meta)
    (args.results / "quality.md").write_text(md)
    from bench.plots import main as plots

    plots(["--results", str(args.results)])  # docs/img/quality: the figures docs/evaluation.md shows
    print("\n" + md)
    print(f"wall time {timings['total']:.0f} s; reports: {args.results / 'quality.json'}, {args.results / 'quality.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
