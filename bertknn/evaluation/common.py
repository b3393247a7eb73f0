"""What every evaluation command shares: the datastore it evaluates (built from a corpus when asked), the
pipeline over it, and how settings, reports and predictions are written."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertknn.core.errors import EvaluationError
from bertknn.evaluation.base import RunSettings
from bertknn.evaluation.lama import LamaQuery
from bertknn.evaluation.metrics import QueryResult

if TYPE_CHECKING:
    from bertknn.service.pipeline import AnswerPipeline

logger = logging.getLogger("evaluation")

AVERAGES_NOTE = (
    "P@k per relation first; a dataset's macro is the mean over its relations; 'macro' (overall) is the mean over "
    "all relations of all datasets, each relation weighing the same"
)


def resolve_layer(layer: int, num_layers: int) -> int:
    """A hidden_states index as the builder takes it (negative counts from the end) -> its absolute value."""
    absolute = layer if layer >= 0 else num_layers + 1 + layer
    if not 0 <= absolute <= num_layers:
        raise EvaluationError(
            f"--layer {layer} is out of range for a {num_layers}-layer model (0..{num_layers})"
        )
    return absolute


def prepare_datastore(args: argparse.Namespace) -> Path:
    """The datastore to evaluate: checked against --layer, built from --corpus when asked and missing."""
    from bertknn.core.format import MANIFEST, read_manifest

    if args.datastore is None:
        raise EvaluationError("pass --datastore DIR (or --url URL to evaluate a running service)")
    ds = Path(args.datastore)
    if args.corpus and not (ds / MANIFEST).is_file():
        if args.model is None:
            raise EvaluationError("building a datastore from --corpus needs --model")
        from bertknn.builder.build import build
        from bertknn.builder.settings import BuildSettings

        layer = -2 if args.layer is None else args.layer
        logger.info("building %s from %s at layer %d", ds, ", ".join(map(str, args.corpus)), layer)
        build(
            BuildSettings(
                corpus=list(args.corpus),
                model=args.model,
                out=ds,
                layer=layer,
                device=args.device,
                ivfpq=bool(args.no_retrieval),
                targets="whole-word" if args.multi_piece else "single-piece",
                threads=args.threads,
            )
        )
    man = read_manifest(ds)
    if args.layer is not None:
        want = resolve_layer(args.layer, man.model.num_layers)
        if man.layer != want:
            raise EvaluationError(
                f"{ds} was built at layer {man.layer} (hidden_states index), not {want} (--layer {args.layer}). "
                f"Pass --datastore pointing at a datastore built with `bert-knn build --layer "
                f"{args.layer} ...`, or --corpus FILE with a new --datastore DIR to build one here."
            )
    needed = "ivfpq" if args.no_retrieval else args.retriever
    if needed not in man.indexes:
        fix = (
            f"`bert-knn ivfpq {ds}` adds it"
            if needed == "ivfpq"
            else "rebuild the datastore with sparse indexes (the default)"
        )
        raise EvaluationError(
            f"{ds} has no {needed} index ({'no-retrieval' if needed == 'ivfpq' else 'retrieval'}); {fix}"
        )
    return ds


def open_pipeline(
    datastore: Path, *, model: str | None, device: str, threads: int, cache_items: int
) -> AnswerPipeline:
    import torch

    from bertknn.core.runtime import cpu_quota_threads
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.pipeline import AnswerPipeline

    torch.set_num_threads(threads or cpu_quota_threads())
    # The cache holds every query's forward pass and retrieval, so repeated runs (grid, ablations) skip them.
    return AnswerPipeline.open(datastore, model=model, device=device, cache=InMemoryCache(cache_items))


def linked_pipeline(args: argparse.Namespace, stack: ExitStack) -> AnswerPipeline:
    if args.datastore is None:
        raise EvaluationError("pass --datastore DIR: entity evaluations run in process")
    pipeline = open_pipeline(args.datastore, model=args.model, device=args.device, threads=args.threads,
                             cache_items=1 << 16)  # fmt: skip
    stack.callback(pipeline.close)
    if not pipeline.datastore.linked:
        raise EvaluationError(
            f"{args.datastore} has no entity links; build it with links (the builder's default), e.g. from "
            "`python -m bench.quality --links`'s corpus"
        )
    return pipeline


def run_settings_dict(s: RunSettings) -> dict[str, object]:
    return {
        "retriever": s.retriever,
        "num_articles": None if s.retriever == "none" else s.num_articles,
        "k": s.k,
        "temperature": s.temperature if s.temperature is not None else "auto",
        "lambda": s.lambda_,
        "mlm_prior": s.mlm_prior,
        "article_sharpness": s.article_sharpness,
        "batch_size": s.batch_size,
    }


def write_report(path: Path | None, report: dict[str, Any]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        logger.info("report written to %s", path)


def write_predictions(path: Path, queries: Sequence[LamaQuery], results: Sequence[QueryResult]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for q, r in zip(queries, results, strict=True):
            row: dict[str, Any] = {
                "relation": q.relation,
                "dataset": q.dataset,
                "uid": q.uid,
                "text": q.text,
                "subject": q.subject,
                "gold": q.obj,
                "rank": {"mlm": r.mlm, "knn": r.knn, "bert_knn": r.bert_knn},
                "top1": dict(zip(("mlm", "knn", "bert_knn"), r.top, strict=True)),
            }
            if r.knn_skipped is not None:
                row["rank"]["bert_knn_adaptive"] = r.bert_knn_adaptive
                row["adaptive"] = {"knn_skipped": r.knn_skipped, "lambda": r.lambda_adaptive}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
