"""CLI: ``bert-knn eval lama|follow --data DIR --datastore DIR [options]`` (see ``--help``)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bertknn.core.errors import EvaluationError, LamaError
from bertknn.evaluation.base import Runner, RunSettings
from bertknn.evaluation.lama import (
    DEV_PERCENT,
    LamaQuery,
    ObjectVocabulary,
    Probe,
    discover_relations,
    load_probe,
    load_vocab_file,
    select_relations,
)
from bertknn.evaluation.metrics import (
    QueryResult,
    Summary,
    format_table,
    report_dict,
    skipped_fraction,
    summarize,
)
from bertknn.service.interpolate import DEFAULT_ARTICLE_SHARPNESS, DEFAULT_MLM_PRIOR

if TYPE_CHECKING:
    from bertknn.evaluation.adaptive import AdaptiveFit
    from bertknn.evaluation.grid import GridSpace
    from bertknn.service.interpolate import AdaptiveRule
    from bertknn.service.pipeline import AnswerPipeline

logger = logging.getLogger("evaluation")

AVERAGES_NOTE = (
    "P@k per relation first; a dataset's macro is the mean over its relations; 'macro' (overall) is the mean over "
    "all relations of all datasets, each relation weighing the same"
)



def _temperature_arg(value: str) -> float | None:
    """``--temperature``: a number > 0, or auto (None)."""
    if value == "auto":
        return None
    try:
        t = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give a number > 0, or auto") from None
    if not t > 0:
        raise argparse.ArgumentTypeError(f"{value}: the temperature must be > 0")
    return t


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def grid_space(args: argparse.Namespace) -> GridSpace:
    """The grid's axes: the paper's unless ``--grid-n/--grid-lambda/--grid-k/--grid-l`` name others."""
    from bertknn.evaluation.grid import GridSpace

    default = GridSpace()

    def axis(values: list[str] | None, kind: type, flag: str, fallback: tuple) -> tuple:
        if values is None:
            return fallback
        try:
            return tuple(kind(v) for v in values)
        except ValueError:
            raise EvaluationError(f"{flag}: {','.join(values)!r} is not a comma-separated list of numbers") from None

    try:
        return GridSpace(
            num_articles=axis(args.grid_n, int, "--grid-n", default.num_articles),
            lambdas=axis(args.grid_lambda, float, "--grid-lambda", default.lambdas),
            ks=axis(args.grid_k, int, "--grid-k", default.ks),
            temperatures=axis(args.grid_l, float, "--grid-l", default.temperatures),
        )
    except ValueError as exc:
        raise EvaluationError(f"--grid axes: {exc}") from exc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m evaluation", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    la = sub.add_parser("lama", help="P@1/5/10 of MLM, kNN and BERT-kNN on the LAMA probe")
    la.add_argument("--data", type=Path, default=Path("../shared/data/lama"), help="LAMA probe directory")
    la.add_argument("--datastore", type=Path, help="datastore directory (in-process runs)")
    la.add_argument(
        "--model", help="masked LM name or directory (default: the one the datastore's manifest names)"
    )
    la.add_argument("--url", help="evaluate a running service at this URL instead of in process")
    la.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    la.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = the CPU quota)")
    la.add_argument(
        "--vocab", type=Path, help="restrict ranking (and facts) to this vocabulary, e.g. LAMA's common vocab"
    )
    la.add_argument(
        "--limit", type=int, help="at most N facts per relation (the first N kept, in file order)"
    )
    la.add_argument(
        "--relations", type=_csv, help="comma-separated relation ids: P19,P27,place_of_birth,squad"
    )
    la.add_argument("--datasets", type=_csv, help="comma-separated datasets: Google-RE,T-REx,SQuAD")
    la.add_argument(
        "--trex",
        choices=["all", "evidence", "facts"],
        default="all",
        help="T-REx files: evidence (TREx/), facts (TREx_facts_all41/), all (TREx/ first, fact-only for the rest)",
    )
    la.add_argument("--retriever", choices=["bm25", "tfidf"], default="bm25", help="article ranker")
    la.add_argument("--no-retrieval", action="store_true", help="kNN over the whole datastore (IVF-PQ index)")
    la.add_argument("--num-articles", type=int, default=3, help="N articles searched")
    la.add_argument("--k", type=int, default=128, help="neighbours")
    la.add_argument(
        "--temperature", type=_temperature_arg, default=None, help="l in softmax(-d/l), or auto (default): the "
        "datastore's own, measured when it was built",
    )
    la.add_argument("--lambda", dest="lambda_", type=float, default=0.3, help="kNN weight")
    la.add_argument(
        "--mlm-prior", type=float, default=DEFAULT_MLM_PRIOR,
        help="the neighbours' vote weighted by p_MLM to this power (0: the paper's plain vote; word answers, not entities)",
    )  # fmt: skip
    la.add_argument(
        "--article-sharpness", type=float, default=DEFAULT_ARTICLE_SHARPNESS,
        help="lower-ranked articles' neighbours count exp(-this * (1 - score / top score)) as much (0: the same)",
    )  # fmt: skip
    la.add_argument("--layer", type=int, help="hidden_states index the datastore must be built at (ablation)")
    la.add_argument(
        "--corpus",
        type=Path,
        action="append",
        help="with --layer: build the --datastore from this corpus at that layer when it does not exist yet",
    )
    la.add_argument(
        "--grid", action="store_true", help="search N, lambda, k, l on the dev split; evaluate the rest"
    )
    la.add_argument("--grid-n", type=_csv, help="with --grid: N values (default the paper's 1,2,3,4,5)")
    la.add_argument("--grid-lambda", type=_csv, help="with --grid: lambda values (default 0.2,0.3,...,0.8)")
    la.add_argument("--grid-k", type=_csv, help="with --grid: k values (default 64,128,512)")
    la.add_argument(
        "--grid-l", type=_csv, help="with --grid: l values (default 5,6,...,12; a model with other distance scales "
        "may want a wider range, e.g. 5,6,8,12,16,24,32)"
    )
    la.add_argument(
        "--adaptive",
        action="store_true",
        help="fit the adaptive interpolation rule on the dev split (after --grid, if given) and add its column "
        "(bert_knn_adaptive) on the test split",
    )
    la.add_argument("--adaptive-out", type=Path, help="with --adaptive: write the fitted rule (JSON) here")
    la.add_argument(
        "--adaptive-rule", type=Path, help="add the adaptive column with this rule file (no fit; e.g. --adaptive-out's)"
    )
    la.add_argument("--batch-size", type=int, default=32)
    la.add_argument("--out", type=Path, help="write the JSON report here")
    la.add_argument(
        "--plots", type=Path, metavar="DIR", help="write plots (PNG and SVG) here: P@1 per relation for MLM, kNN and "
        "BERT-kNN; by popularity with --by-popularity; the lambda sweep with --grid (needs matplotlib)"
    )
    la.add_argument(
        "--predictions", type=Path, help="write one JSON line per query (ranks, top-1 tokens) here"
    )
    la.add_argument("--quiet", action="store_true", help="no progress bars")
    la.add_argument(
        "--multi-piece",
        action="store_true",
        help="also evaluate T-REx facts whose object is one word of several wordpieces, as whole words (needs a "
        "datastore built with --targets whole-word); a separate table and report['multi_piece']",
    )
    la.add_argument(
        "--answer",
        choices=["word", "entity"],
        default="word",
        help="entity: entity-level P@1/P@10 (the gold entity is the object's article; every fact, whatever its "
        "object's length), on a datastore with links",
    )
    la.add_argument(
        "--adaptive-popularity",
        action="store_true",
        help="with --adaptive: the rule may also weigh the subject's log popularity (a datastore with links); the "
        "fit without it is reported beside it, on dev and on test (report['adaptive_popularity'])",
    )
    la.add_argument(
        "--by-popularity",
        action="store_true",
        help="also P@1 per quartile of the subjects' popularity (inbound links; a datastore with links)",
    )

    fo = sub.add_parser("follow", help="two-hop questions: relation following (/follow) against one composed template")
    fo.add_argument("--data", type=Path, default=Path("../shared/data/lama"), help="LAMA probe directory")
    fo.add_argument("--datastore", type=Path, required=True, help="a datastore with links")
    fo.add_argument("--model", help="masked LM name or directory (default: the manifest's)")
    fo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    fo.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = the CPU quota)")
    fo.add_argument(
        "--pairs", type=_csv, help="r1:r2 relation pairs (default: every pair with a composed template and facts)"
    )
    fo.add_argument("--limit", type=int, default=50, help="questions per pair (the first N, in file order)")
    fo.add_argument("--beam", type=int, default=5, help="entities of hop 1 that hop 2 starts from")
    fo.add_argument("--retriever", choices=["bm25", "tfidf"], default="bm25", help="for entities without an article")
    fo.add_argument("--num-articles", type=int, default=3)
    fo.add_argument("--k", type=int, default=128, help="neighbours")
    fo.add_argument("--temperature", type=_temperature_arg, default=None, help="a number, or auto (default)")
    fo.add_argument("--lambda", dest="lambda_", type=float, default=0.3, help="kNN weight")
    fo.add_argument("--out", type=Path, help="write the JSON report here")
    fo.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


# ---- datastore and layer ----------------------------------------------------------------------------------


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


# ---- running ----------------------------------------------------------------------------------------------


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


def _vocab_note(args: argparse.Namespace, vocab: ObjectVocabulary) -> dict[str, object] | None:
    if args.vocab is None:
        return None
    assert vocab.restrict is not None
    return {
        "file": str(args.vocab),
        "tokens": len(vocab.restrict),
        "note": "ranking restricted to this vocabulary (LAMA common vocabulary); facts whose object is outside it "
        "are dropped",
    }


def _adaptive_rule(
    args: argparse.Namespace,
    pipeline: AnswerPipeline,
    probe: Probe,
    settings: RunSettings,
    vocab: ObjectVocabulary,
    identity: dict[str, object],
) -> tuple[AdaptiveRule, AdaptiveFit | None]:
    """--adaptive-rule: read the rule. --adaptive: fit it on the dev split at this run's setting (N, k, l)."""
    from bertknn.service.interpolate import AdaptiveRule

    if args.adaptive_rule:
        return AdaptiveRule.load(args.adaptive_rule), None
    from bertknn.evaluation.adaptive import AdaptiveSpace, collect, fit_rule

    space = AdaptiveSpace().with_base_lambda(settings.lambda_)
    if args.adaptive_popularity:
        if not pipeline.datastore.linked:
            raise EvaluationError("--adaptive-popularity needs a datastore with links (popularity = inbound links)")
        space = replace(space, popularity_weights=POPULARITY_WEIGHTS)
    dev = probe.for_split("dev")
    if not dev:
        raise EvaluationError("--adaptive: the dev split has no queries to fit on; raise --limit or add relations")
    scored = collect(
        pipeline, dev, settings, measures=space.measures, allowed_ids=vocab.allowed_ids(),
        progress=not args.quiet, popularity=args.adaptive_popularity,
    )  # fmt: skip
    fit = fit_rule(scored, space, fixed_lambda=settings.lambda_)
    print(fit.format())
    datastore = identity.get("datastore")
    rule = fit.best.rule.model_copy(
        update={
            "fitted": {
                "by": "bert-knn eval lama --adaptive",
                "dev_split": f"sha256(fact id) mod 100 < {DEV_PERCENT}",
                "dev_queries": fit.queries,
                "dev_macro": {"fixed": _round(fit.fixed), "adaptive": _round(fit.best.macro)},
                "dev_skipped": round(fit.best.skipped, 4),
                "setting": {k: v for k, v in run_settings_dict(settings).items() if k != "batch_size"},
                "vocab": str(args.vocab) if args.vocab else None,
                "datastore_id": datastore.get("id") if isinstance(datastore, dict) else None,
            }
        }
    )
    if args.adaptive_out:
        args.adaptive_out.parent.mkdir(parents=True, exist_ok=True)
        rule.save(args.adaptive_out)
        logger.info("adaptive rule written to %s", args.adaptive_out)
    return rule, fit


POPULARITY_WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


def _without_popularity(
    args: argparse.Namespace, pipeline: AnswerPipeline, probe: Probe, settings: RunSettings, vocab: ObjectVocabulary
) -> tuple[AdaptiveRule, AdaptiveFit]:
    """The rule fitted on the same dev queries with popularity left out (the comparison --adaptive-popularity
    reports)."""
    from bertknn.evaluation.adaptive import AdaptiveSpace, collect, fit_rule

    space = AdaptiveSpace().with_base_lambda(settings.lambda_)
    scored = collect(pipeline, probe.for_split("dev"), settings, measures=space.measures,
                     allowed_ids=vocab.allowed_ids(), progress=not args.quiet)  # fmt: skip
    fit = fit_rule(scored, space, fixed_lambda=settings.lambda_)
    return fit.best.rule, fit


def _macro_adaptive(summary: Summary) -> dict[str, float]:
    """Macro P@k of the adaptive column (over all relations)."""
    return _round(dict(summary.overall["bert_knn_adaptive"]))


def _round(p: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 2) for k, v in p.items()}


def _adaptive_note(
    rule: AdaptiveRule | None, fit: AdaptiveFit | None, path: Path | None, results: Sequence[QueryResult]
) -> dict[str, object] | None:
    if rule is None:
        return None
    evaluated = [r for r in results if r.knn_skipped is not None]
    lambdas = [r.lambda_adaptive for r in evaluated if not r.knn_skipped and r.lambda_adaptive is not None]
    return {
        "rule": rule.model_dump(),
        "source": "fitted on the dev split" if fit is not None else str(path),
        "column": "bert_knn_adaptive: the interpolation with the rule's lambda (p_MLM alone when kNN is skipped)",
        "knn_skipped": round(skipped_fraction(evaluated), 4) if evaluated else None,
        "mean_lambda_not_skipped": round(sum(lambdas) / len(lambdas), 4) if lambdas else None,
        "fit": None
        if fit is None
        else {
            "dev_queries": fit.queries,
            "rules": fit.rules,
            "dev_macro_fixed": _round(fit.fixed),
            "dev_macro_adaptive": _round(fit.best.macro),
            "dev_skipped": round(fit.best.skipped, 4),
            "seconds": fit.seconds,
        },
    }


def _lama(args: argparse.Namespace) -> int:
    with ExitStack() as stack:
        return _run_lama(args, stack)


def _run_lama(args: argparse.Namespace, stack: ExitStack) -> int:
    t0 = time.perf_counter()
    if args.limit is not None and args.limit < 1:
        raise EvaluationError("--limit must be >= 1")
    if args.url and args.grid:
        raise EvaluationError("--grid runs in process (it recomputes p_kNN from the neighbours); drop --url")
    if args.url and (args.adaptive or args.adaptive_rule):
        raise EvaluationError("--adaptive/--adaptive-rule run in process (from both distributions); drop --url")
    if args.adaptive and args.adaptive_rule:
        raise EvaluationError("--adaptive fits a rule and --adaptive-rule reads one; pass only one of them")
    if args.adaptive_out and not args.adaptive:
        raise EvaluationError("--adaptive-out writes the rule that --adaptive fits; add --adaptive")
    if args.adaptive_popularity and not args.adaptive:
        raise EvaluationError("--adaptive-popularity changes what --adaptive fits; add --adaptive")
    if args.url and (args.corpus or args.datastore):
        raise EvaluationError("--url evaluates the service's own datastore; drop --datastore/--corpus")
    if args.multi_piece and (args.url or args.vocab or args.grid):
        raise EvaluationError(
            "--multi-piece runs in process over the full vocabulary (it scores gold words by sequential fill); "
            "drop --url, --vocab and --grid"
        )
    settings = RunSettings(
        retriever="none" if args.no_retrieval else args.retriever,
        num_articles=args.num_articles,
        k=args.k,
        temperature=args.temperature,
        lambda_=args.lambda_,
        mlm_prior=args.mlm_prior,
        article_sharpness=args.article_sharpness,
        batch_size=args.batch_size,
    )
    restrict = load_vocab_file(args.vocab) if args.vocab else None
    relations = select_relations(discover_relations(args.data, trex=args.trex), args.relations, args.datasets)
    if args.answer == "entity":
        if args.plots:
            raise EvaluationError("--plots draws the word answers' report; drop it with --answer entity")
        return _entity_lama(args, settings, relations, stack)
    if args.by_popularity and args.url:
        raise EvaluationError("--by-popularity reads the datastore's entity table in process; drop --url")

    identity: dict[str, object] = {}
    pipeline: AnswerPipeline | None = None
    if args.url:
        from bertknn.service.client import BertKnnClient

        client = stack.enter_context(BertKnnClient(args.url, timeout=120.0))
        ready = client.ready()
        if ready.get("status") != "ready":
            raise EvaluationError(f"the service at {args.url} is not ready: {ready.get('detail') or ready}")
        model_info = ready.get("model") or {}
        if args.layer is not None and model_info.get("layer") != resolve_layer(
            args.layer, int(model_info["num_layers"])
        ):
            raise EvaluationError(
                f"the service's datastore is at layer {model_info.get('layer')}, not --layer {args.layer}"
            )
        tokenizer_name = args.model or model_info.get("name")
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_name, use_fast=True)
        except (OSError, ValueError) as exc:
            raise EvaluationError(
                f"cannot load the tokenizer {tokenizer_name!r} to build the queries ({exc}); pass --model DIR"
            ) from exc
        vocab = ObjectVocabulary(tokenizer, restrict)
        identity = {"mode": "http", "url": args.url, "model": model_info, "datastore": ready.get("datastore")}
    else:
        ds = prepare_datastore(args)
        pipeline = open_pipeline(
            ds, model=args.model, device=args.device, threads=args.threads, cache_items=1 << 16
        )
        stack.callback(pipeline.close)
        vocab = ObjectVocabulary(pipeline.encoder.tokenizer, restrict, words=pipeline.encoder.words)
        identity = {"mode": "in-process", "datastore": str(ds), **pipeline.identity()}
        if args.multi_piece and pipeline.words is None:
            raise EvaluationError(
                f"--multi-piece needs a whole-word datastore and {ds} stores single wordpieces; build one with "
                "`bert-knn build --targets whole-word ...`"
            )
        if args.grid and pipeline.words is not None:
            raise EvaluationError(f"--grid works on token ids; {ds} is a whole-word datastore (drop --grid)")

    probe: Probe = load_probe(relations, vocab, limit=args.limit)
    queries = probe.queries
    split = "all"
    grid_info: dict[str, object] | None = None
    if args.grid:
        from bertknn.evaluation.grid import grid_search

        assert pipeline is not None
        allowed = vocab.allowed_ids()
        try:
            result = grid_search(
                pipeline,
                probe.for_split("dev"),
                retriever=settings.retriever,
                space=grid_space(args),
                allowed_ids=allowed,
                batch_size=args.batch_size,
                progress=not args.quiet,
                mlm_prior=settings.mlm_prior,
                article_sharpness=settings.article_sharpness,
            )
        except ValueError as exc:
            raise EvaluationError(f"--grid: {exc}") from exc
        print(result.format())
        settings = result.best.apply(settings)
        queries = probe.for_split("test")
        split = "test"
        grid_info = {
            "dev_split": f"sha256(fact id) mod 100 < {DEV_PERCENT}",
            "dev_queries": result.queries,
            "best": result.best.as_dict(),
            "best_dev_macro_bert_knn": {k: round(v, 2) for k, v in result.ranking[0][1].items()},
            "points": len(result.ranking),
            "sweep": [{**pt.as_dict(), **{k: round(v, 2) for k, v in p.items()}} for pt, p in result.ranking],
            "seconds": result.seconds,
        }
    rule, adaptive_fit = None, None
    if args.adaptive or args.adaptive_rule:
        assert pipeline is not None
        if pipeline.words is not None:
            raise EvaluationError("--adaptive/--adaptive-rule work on token ids; drop them for a whole-word datastore")
        rule, adaptive_fit = _adaptive_rule(args, pipeline, probe, settings, vocab, identity)
        if args.adaptive:
            queries, split = probe.for_split("test"), "test"
    if not queries:
        raise EvaluationError(
            "no query left to evaluate: every fact was filtered out (see the log's filter counts)"
        )

    if pipeline is not None:
        from bertknn.evaluation.runner import PipelineRunner

        runner: Runner = PipelineRunner(
            pipeline, allowed_ids=vocab.allowed_ids(), progress=not args.quiet, adaptive=rule
        )
    else:
        from bertknn.evaluation.runner import HttpRunner

        runner = HttpRunner(client, allowed_tokens=restrict, progress=not args.quiet)
    t_run = time.perf_counter()
    results = runner.run(queries, settings)
    run_s = time.perf_counter() - t_run
    popularity_cmp = None
    if args.adaptive_popularity:
        assert pipeline is not None and rule is not None and adaptive_fit is not None
        from bertknn.evaluation.runner import PipelineRunner as _Runner

        plain_rule, plain_fit = _without_popularity(args, pipeline, probe, settings, vocab)
        plain = _Runner(pipeline, allowed_ids=vocab.allowed_ids(), progress=not args.quiet, adaptive=plain_rule)
        plain_test = summarize(plain.run(queries, settings))
        with_test = summarize(results)
        popularity_cmp = {
            "with_popularity": {"rule": rule.model_dump(exclude={"fitted"}), "dev": _round(adaptive_fit.best.macro),
                                "test": _macro_adaptive(with_test)},
            "without_popularity": {"rule": plain_rule.model_dump(exclude={"fitted"}), "dev": _round(plain_fit.best.macro),
                                   "test": _macro_adaptive(plain_test)},
        }  # fmt: skip
        print(
            "adaptive with the subject's popularity: dev P@1 {:.1f}, test P@1 {:.1f}; without: dev P@1 {:.1f}, test "
            "P@1 {:.1f} (macro)".format(
                adaptive_fit.best.macro["p@1"], popularity_cmp["with_popularity"]["test"]["p@1"],  # type: ignore[index]
                plain_fit.best.macro["p@1"], popularity_cmp["without_popularity"]["test"]["p@1"],  # type: ignore[index]
            )
        )
    summary: Summary = summarize(results)
    multi = None
    if args.multi_piece:
        from bertknn.evaluation.words import evaluate_multi_piece

        multi = evaluate_multi_piece(runner, settings, relations, vocab, limit=args.limit)

    report_settings = {
        **identity,
        "data": str(args.data),
        **run_settings_dict(settings),
        "no_retrieval": settings.retriever == "none",
        "vocab": _vocab_note(args, vocab),
        "lowercase": vocab.lowercase,
        "single_wordpiece_objects": True,
        "limit": args.limit,
        "relations_asked": args.relations,
        "datasets_asked": args.datasets,
        "trex_source": args.trex,
        "split": split,
        "grid": grid_info,
        "adaptive": _adaptive_note(rule, adaptive_fit, args.adaptive_rule, results),
        "averages": AVERAGES_NOTE,
        "filters": {rel: st.as_dict() for rel, st in probe.stats.items()},
        "queries": len(queries),
        "queries_per_s": round(len(queries) / run_s, 2) if run_s > 0 else None,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
    title = (
        f"LAMA ({settings.retriever if settings.retriever != 'none' else 'no retrieval'}"
        f"{', common vocab' if restrict else ''}): P@1/P@5/P@10 in %"
    )
    print(format_table(summary, title=title))
    if rule is not None:
        print(
            f"adaptive ({'fitted on dev' if adaptive_fit else args.adaptive_rule}): kNN skipped for "
            f"{100 * skipped_fraction(results):.1f} % of the {len(results)} queries"
        )
    report = report_dict(summary, report_settings)
    if popularity_cmp is not None:
        report["adaptive_popularity"] = popularity_cmp
    if args.by_popularity:
        assert pipeline is not None
        report["popularity"] = _by_popularity(pipeline, queries, results)
    if multi is not None:
        print(multi.table)
        report["multi_piece"] = multi.report
        queries, results = [*queries, *multi.queries], [*results, *multi.results]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        logger.info("report written to %s", args.out)
    if args.predictions:
        write_predictions(args.predictions, queries, results)
    if args.plots:
        from bertknn.evaluation.plots import write_plots

        written = write_plots(report, args.plots, title)
        logger.info("plots written: %s", ", ".join(str(p) for p in written))
    return 0


# ---- entities (a datastore with links; bertknn.evaluation.entities) ---------------------------------------------


def _linked_pipeline(args: argparse.Namespace, stack: ExitStack) -> AnswerPipeline:
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


def _write_report(path: Path | None, report: dict[str, Any]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        logger.info("report written to %s", path)


def _entity_lama(
    args: argparse.Namespace, settings: RunSettings, relations: Sequence[Any], stack: ExitStack
) -> int:
    from tqdm import tqdm

    from bertknn.evaluation.entities import entity_lama

    for flag, on in (("--url", args.url), ("--grid", args.grid), ("--adaptive", args.adaptive or args.adaptive_rule),
                     ("--multi-piece", args.multi_piece), ("--no-retrieval", args.no_retrieval)):  # fmt: skip
        if on:
            raise EvaluationError(f"--answer entity runs in process over the retrieved articles; drop {flag}")
    t0 = time.perf_counter()
    pipeline = _linked_pipeline(args, stack)
    relations = [r for r in relations if r.template is not None]
    with tqdm(desc="entity queries", unit="q", disable=args.quiet) as bar:
        table = entity_lama(pipeline, relations, settings, limit=args.limit, batch_size=args.batch_size,
                            progress=bar.update)  # fmt: skip
    print(table.format("LAMA, entity answers (gold: the object's article): P@1/P@10 in %, macro over relations"))
    report = {
        "settings": {"mode": "in-process", "datastore": str(args.datastore), **pipeline.identity(),
                     **run_settings_dict(settings), "limit": args.limit, "answer": "entity",
                     "averages": AVERAGES_NOTE, "wall_s": round(time.perf_counter() - t0, 2)},
        **table.report(),
    }  # fmt: skip
    _write_report(args.out, report)
    return 0


def _by_popularity(
    pipeline: AnswerPipeline, queries: Sequence[LamaQuery], results: Sequence[QueryResult]
) -> dict[str, object]:
    from bertknn.evaluation.entities import popularity_buckets, popularity_of

    if not pipeline.datastore.linked:
        raise EvaluationError("--by-popularity needs a datastore with links (its entity table holds popularity)")
    popularity = [popularity_of(pipeline, q.subject) if q.subject else 0 for q in queries]
    columns = {"MLM": "mlm", "kNN": "knn", "BERT-kNN": "bert_knn"}
    if any(r.knn_skipped is not None for r in results):
        columns["adaptive"] = "bert_knn_adaptive"
    ranks = {name: [r.rank(col) for r in results] for name, col in columns.items()}
    out = popularity_buckets(ranks, popularity)
    print("P@1 (micro) by the subject's popularity (inbound links in the datastore), quartile buckets:")
    for b in out["buckets"]:  # type: ignore[attr-defined]
        lo, hi = b["popularity"]
        cells = "  ".join(f"{name} {b[name]:5.1f}" for name in ranks)
        print(f"  popularity {lo:g}..{hi:g}  n={b['n']:5d}  {cells}")
    return out


def _follow(args: argparse.Namespace) -> int:
    with ExitStack() as stack:
        from tqdm import tqdm

        from bertknn.evaluation.entities import COMPOSED, two_hop, two_hop_questions
        from bertknn.evaluation.lama import discover_relations

        t0 = time.perf_counter()
        if args.limit is not None and args.limit < 1:
            raise EvaluationError("--limit must be >= 1")
        relations = {r.id: r for r in discover_relations(args.data, trex="evidence") if r.template is not None}
        pairs: list[tuple[str, str]] = []
        for text in args.pairs or [f"{a}:{b}" for a, b in COMPOSED]:
            r1, sep, r2 = text.partition(":")
            if not sep or (r1, r2) not in COMPOSED:
                known = ", ".join(f"{a}:{b}" for a, b in COMPOSED)
                raise EvaluationError(f"--pairs {text!r}: give r1:r2 pairs with a composed template: {known}")
            pairs.append((r1, r2))
        questions = two_hop_questions(relations, pairs, args.limit)
        if not questions:
            raise EvaluationError(f"no two-hop question could be composed from {args.data} for {pairs}")
        pipeline = _linked_pipeline(args, stack)
        settings = RunSettings(retriever=args.retriever, num_articles=args.num_articles, k=args.k,
                               temperature=args.temperature, lambda_=args.lambda_)  # fmt: skip
        with tqdm(total=len(questions), desc="two-hop questions", unit="q", disable=args.quiet) as bar:
            table = two_hop(pipeline, relations, questions, settings, beam=args.beam, progress=bar.update)
        print(table.format("Two hops (X r1 Y, Y r2 Z), entity answers: P@1/P@10 in %, macro over relation pairs"))
        report = {
            "settings": {"datastore": str(args.datastore), **pipeline.identity(), **run_settings_dict(settings),
                         "beam": args.beam, "limit": args.limit, "pairs": [f"{a}:{b}" for a, b in pairs],
                         "composed": {f"{a}:{b}": COMPOSED[(a, b)] for a, b in pairs},
                         "questions": len(questions), "wall_s": round(time.perf_counter() - t0, 2)},
            **table.report(),
        }  # fmt: skip
        _write_report(args.out, report)
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    import httpx

    from bertknn.core.errors import (
        AdaptiveRuleError,
        BuildError,
        DatastoreError,
        ModelLoadError,
        QueryError,
        RetrieverUnavailable,
    )
    from bertknn.service.client import ServiceError

    expected = (
        LamaError,
        EvaluationError,
        BuildError,
        DatastoreError,
        ModelLoadError,
        QueryError,
        RetrieverUnavailable,
        ServiceError,
        AdaptiveRuleError,
    )
    try:
        if args.command == "lama":
            return _lama(args)
        if args.command == "follow":
            return _follow(args)
    except expected as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except httpx.HTTPError as exc:
        print(f"error: cannot reach the service at {getattr(args, 'url', None)}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
