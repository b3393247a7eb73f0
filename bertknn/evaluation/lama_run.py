"""``bert-knn eval lama`` with word answers: the LAMA probe asked of a running service or of a pipeline in process,
with the paper's grid search and the adaptive rule's fit on the dev split; reported as a table, JSON, predictions
and plots."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from bertknn.core.errors import DatastoreError, EvaluationError
from bertknn.core.format import read_manifest
from bertknn.evaluation.base import Runner, RunSettings
from bertknn.evaluation.common import (
    AVERAGES_NOTE,
    open_pipeline,
    prepare_datastore,
    resolve_layer,
    run_settings_dict,
    write_predictions,
    write_report,
)
from bertknn.evaluation.entity_runs import entity_lama
from bertknn.evaluation.lama import (
    DEV_PERCENT,
    LamaQuery,
    ObjectVocabulary,
    Probe,
    Relation,
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

if TYPE_CHECKING:
    from bertknn.evaluation.adaptive import AdaptiveFit
    from bertknn.evaluation.grid import GridSpace
    from bertknn.service.client import BertKnnClient
    from bertknn.service.interpolate import AdaptiveRule
    from bertknn.service.pipeline import AnswerPipeline

logger = logging.getLogger("evaluation")

POPULARITY_WEIGHTS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass
class LamaTarget:
    """What a LAMA run asks: a running service over HTTP, or a pipeline in process."""

    vocab: ObjectVocabulary
    identity: dict[str, object]
    pipeline: AnswerPipeline | None = None
    client: BertKnnClient | None = None

    def runner(self, restrict: frozenset[str] | None, *, progress: bool, rule: AdaptiveRule | None) -> Runner:
        if self.pipeline is not None:
            from bertknn.evaluation.runner import PipelineRunner

            return PipelineRunner(self.pipeline, allowed_ids=self.vocab.allowed_ids(), progress=progress, adaptive=rule)
        from bertknn.evaluation.runner import HttpRunner

        assert self.client is not None
        return HttpRunner(self.client, allowed_tokens=restrict, progress=progress)


@dataclass
class LamaPlan:
    """What a LAMA run evaluates: its setting (the grid's best on dev, with --grid), the queries (the test split
    after a fit on dev) and the adaptive rule, when there is one."""

    settings: RunSettings
    queries: list[LamaQuery]
    split: str = "all"
    grid: dict[str, object] | None = None
    rule: AdaptiveRule | None = None
    adaptive_fit: AdaptiveFit | None = None


# flags that contradict each other, or need another: (when, what to fix)
_CONFLICTS: tuple[tuple[Callable[[argparse.Namespace], object], str], ...] = (
    (lambda a: a.limit is not None and a.limit < 1, "--limit must be >= 1"),
    (lambda a: a.url and a.grid, "--grid runs in process (it recomputes p_kNN from the neighbours); drop --url"),
    (lambda a: a.url and (a.adaptive or a.adaptive_rule),
     "--adaptive/--adaptive-rule run in process (from both distributions); drop --url"),
    (lambda a: a.adaptive and a.adaptive_rule,
     "--adaptive fits a rule and --adaptive-rule reads one; pass only one of them"),
    (lambda a: a.adaptive_out and not a.adaptive, "--adaptive-out writes the rule that --adaptive fits; add --adaptive"),
    (lambda a: a.adaptive_popularity and not a.adaptive,
     "--adaptive-popularity changes what --adaptive fits; add --adaptive"),
    (lambda a: a.url and (a.corpus or a.datastore),
     "--url evaluates the service's own datastore; drop --datastore/--corpus"),
    (lambda a: a.multi_piece and (a.url or a.vocab or a.grid),
     "--multi-piece runs in process over the full vocabulary (it scores gold words by sequential fill); drop --url, "
     "--vocab and --grid"),
)  # fmt: skip


def check_flags(args: argparse.Namespace) -> None:
    """`EvaluationError` naming the first pair of flags that cannot go together."""
    for when, fix in _CONFLICTS:
        if when(args):
            raise EvaluationError(fix)


def run_settings(args: argparse.Namespace) -> RunSettings:
    return RunSettings(
        retriever="none" if args.no_retrieval else args.retriever,
        num_articles=args.num_articles,
        k=args.k,
        temperature=args.temperature,
        lambda_=args.lambda_,
        mlm_prior=args.mlm_prior,
        article_sharpness=args.article_sharpness,
        batch_size=args.batch_size,
    )


def http_target(args: argparse.Namespace, stack: ExitStack, restrict: frozenset[str] | None) -> LamaTarget:
    """The running service at --url, ready, and its model's tokenizer (to build the queries as it reads them)."""
    from transformers import AutoTokenizer

    from bertknn.service.client import BertKnnClient

    if args.by_popularity:
        raise EvaluationError("--by-popularity reads the datastore's entity table in process; drop --url")
    client = stack.enter_context(BertKnnClient(args.url, timeout=120.0))
    ready = client.ready()
    if ready.get("status") != "ready":
        raise EvaluationError(f"the service at {args.url} is not ready: {ready.get('detail') or ready}")
    model_info = ready.get("model") or {}
    if args.layer is not None and model_info.get("layer") != resolve_layer(args.layer, int(model_info["num_layers"])):
        raise EvaluationError(f"the service's datastore is at layer {model_info.get('layer')}, not --layer {args.layer}")
    tokenizer_name = args.model or model_info.get("name")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_name, use_fast=True)
    except (OSError, ValueError) as exc:
        raise EvaluationError(
            f"cannot load the tokenizer {tokenizer_name!r} to build the queries ({exc}); pass --model DIR"
        ) from exc
    identity: dict[str, object] = {"mode": "http", "url": args.url, "model": model_info, "datastore": ready.get("datastore")}
    return LamaTarget(ObjectVocabulary(tokenizer, restrict), identity, client=client)


def in_process_target(args: argparse.Namespace, stack: ExitStack, restrict: frozenset[str] | None) -> LamaTarget:
    """The pipeline over --datastore (built from --corpus when asked), checked against the flags that need one."""
    ds = prepare_datastore(args)
    pipeline = open_pipeline(ds, model=args.model, device=args.device, threads=args.threads, cache_items=1 << 16)
    stack.callback(pipeline.close)
    if args.multi_piece and pipeline.words is None:
        raise EvaluationError(
            f"--multi-piece needs a whole-word datastore and {ds} stores single wordpieces; build one with "
            "`bert-knn build --targets whole-word ...`"
        )
    if args.grid and pipeline.words is not None:
        raise EvaluationError(f"--grid works on token ids; {ds} is a whole-word datastore (drop --grid)")
    if (args.adaptive or args.adaptive_rule) and pipeline.words is not None:
        raise EvaluationError("--adaptive/--adaptive-rule work on token ids; drop them for a whole-word datastore")
    vocab = ObjectVocabulary(pipeline.encoder.tokenizer, restrict, words=pipeline.encoder.words)
    identity: dict[str, object] = {"mode": "in-process", "datastore": str(ds), **pipeline.identity()}
    return LamaTarget(vocab, identity, pipeline=pipeline)


def grid_plan(args: argparse.Namespace, target: LamaTarget, probe: Probe, plan: LamaPlan) -> LamaPlan:
    """--grid: the paper's grid searched on the dev split; the best setting evaluated on the test split."""
    from bertknn.evaluation.grid import grid_search

    assert target.pipeline is not None
    s = plan.settings
    try:
        result = grid_search(
            target.pipeline, probe.for_split("dev"), retriever=s.retriever, space=grid_space(args),
            allowed_ids=target.vocab.allowed_ids(), batch_size=args.batch_size, progress=not args.quiet,
            mlm_prior=s.mlm_prior, article_sharpness=s.article_sharpness,
        )  # fmt: skip
    except ValueError as exc:
        raise EvaluationError(f"--grid: {exc}") from exc
    print(result.format())
    grid = {
        "dev_split": f"sha256(fact id) mod 100 < {DEV_PERCENT}",
        "dev_queries": result.queries,
        "best": result.best.as_dict(),
        "best_dev_macro_bert_knn": {k: round(v, 2) for k, v in result.ranking[0][1].items()},
        "points": len(result.ranking),
        "sweep": [{**pt.as_dict(), **{k: round(v, 2) for k, v in p.items()}} for pt, p in result.ranking],
        "seconds": result.seconds,
    }
    return replace(plan, settings=result.best.apply(s), queries=probe.for_split("test"), split="test", grid=grid)


def adaptive_plan(args: argparse.Namespace, target: LamaTarget, probe: Probe, plan: LamaPlan) -> LamaPlan:
    """--adaptive (fitted on dev, evaluated on test) or --adaptive-rule (read, evaluated on the queries)."""
    assert target.pipeline is not None
    rule, fit = _adaptive_rule(args, target.pipeline, probe, plan.settings, target.vocab, target.identity)
    plan = replace(plan, rule=rule, adaptive_fit=fit)
    return replace(plan, queries=probe.for_split("test"), split="test") if args.adaptive else plan


def plan_run(args: argparse.Namespace, target: LamaTarget, probe: Probe, settings: RunSettings) -> LamaPlan:
    plan = LamaPlan(settings, probe.queries)
    if args.grid:
        plan = grid_plan(args, target, probe, plan)
    if args.adaptive or args.adaptive_rule:
        plan = adaptive_plan(args, target, probe, plan)
    if not plan.queries:
        raise EvaluationError("no query left to evaluate: every fact was filtered out (see the log's filter counts)")
    return plan


def popularity_comparison(
    args: argparse.Namespace, target: LamaTarget, probe: Probe, plan: LamaPlan, results: list[QueryResult]
) -> dict[str, object]:
    """--adaptive-popularity: the rule fitted with the subject's popularity against one fitted without it, both on
    dev and evaluated on the same test queries."""
    from bertknn.evaluation.runner import PipelineRunner

    pipeline, rule, fit = target.pipeline, plan.rule, plan.adaptive_fit
    assert pipeline is not None and rule is not None and fit is not None
    plain_rule, plain_fit = _without_popularity(args, pipeline, probe, plan.settings, target.vocab)
    plain = PipelineRunner(pipeline, allowed_ids=target.vocab.allowed_ids(), progress=not args.quiet,
                           adaptive=plain_rule)  # fmt: skip
    plain_test = _macro_adaptive(summarize(plain.run(plan.queries, plan.settings)))
    with_test = _macro_adaptive(summarize(results))
    print(
        f"adaptive with the subject's popularity: dev P@1 {fit.best.macro['p@1']:.1f}, test P@1 {with_test['p@1']:.1f}; "
        f"without: dev P@1 {plain_fit.best.macro['p@1']:.1f}, test P@1 {plain_test['p@1']:.1f} (macro)"
    )
    return {
        "with_popularity": {"rule": rule.model_dump(exclude={"fitted"}), "dev": _round(fit.best.macro),
                            "test": with_test},
        "without_popularity": {"rule": plain_rule.model_dump(exclude={"fitted"}), "dev": _round(plain_fit.best.macro),
                               "test": plain_test},
    }  # fmt: skip


def report_settings(
    args: argparse.Namespace, target: LamaTarget, probe: Probe, plan: LamaPlan, results: list[QueryResult],
    run_s: float, wall_s: float,
) -> dict[str, object]:  # fmt: skip
    """The report's ``settings``: what was asked, of what, and how the numbers are averaged."""
    return {
        **target.identity,
        "data": str(args.data),
        **run_settings_dict(plan.settings),
        "no_retrieval": plan.settings.retriever == "none",
        "vocab": _vocab_note(args, target.vocab),
        "lowercase": target.vocab.lowercase,
        "single_wordpiece_objects": True,
        "limit": args.limit,
        "relations_asked": args.relations,
        "datasets_asked": args.datasets,
        "trex_source": args.trex,
        "split": plan.split,
        "grid": plan.grid,
        "adaptive": _adaptive_note(plan.rule, plan.adaptive_fit, args.adaptive_rule, results),
        "averages": AVERAGES_NOTE,
        "filters": {rel: st.as_dict() for rel, st in probe.stats.items()},
        "queries": len(plan.queries),
        "queries_per_s": round(len(plan.queries) / run_s, 2) if run_s > 0 else None,
        "wall_s": round(wall_s, 2),
    }


@dataclass
class _Ran:
    """A word-answer probe's run: what was asked, by which plan, and its results."""

    target: LamaTarget
    probe: Probe
    plan: LamaPlan
    runner: Runner
    results: list[QueryResult]
    run_s: float
    started: float  # time.perf_counter() at the command's start
    restricted: bool  # ranked over a restricted vocabulary


def _datastore_language(datastore: Path | None) -> str | None:
    """The language of the datastore asked (its facts' templates are read in it); None when it cannot be read
    here (the in-process target then says why)."""
    try:
        return read_manifest(datastore).language if datastore is not None else None
    except DatastoreError:
        return None


def run_lama(args: argparse.Namespace, stack: ExitStack) -> int:
    """``bert-knn eval lama``: check the flags, open what is asked, plan the queries (grid, adaptive), run them,
    then report (table, JSON, predictions, plots)."""
    t0 = time.perf_counter()
    check_flags(args)
    settings = run_settings(args)
    restrict = load_vocab_file(args.vocab) if args.vocab else None
    language = _datastore_language(args.datastore)
    relations = select_relations(
        discover_relations(args.data, trex=args.trex, language=language), args.relations, args.datasets
    )
    if args.answer == "entity":
        if args.plots:
            raise EvaluationError("--plots draws the word answers' report; drop it with --answer entity")
        return entity_lama(args, settings, relations, stack)
    target = (http_target if args.url else in_process_target)(args, stack, restrict)
    probe: Probe = load_probe(relations, target.vocab, limit=args.limit)
    plan = plan_run(args, target, probe, settings)
    runner = target.runner(restrict, progress=not args.quiet, rule=plan.rule)
    t_run = time.perf_counter()
    results = runner.run(plan.queries, plan.settings)
    ran = _Ran(target, probe, plan, runner, results, time.perf_counter() - t_run, t0, restrict is not None)
    return _report_lama(args, ran, relations)


def _report_lama(args: argparse.Namespace, ran: _Ran, relations: list[Relation]) -> int:
    """The run's table and report: the adaptive rule's skips, the popularity comparison and buckets, the
    multi-piece probe, predictions and plots as the flags ask."""
    target, probe, plan, results = ran.target, ran.probe, ran.plan, ran.results
    compared = popularity_comparison(args, target, probe, plan, results) if args.adaptive_popularity else None
    multi = None
    if args.multi_piece:
        from bertknn.evaluation.words import evaluate_multi_piece

        multi = evaluate_multi_piece(ran.runner, plan.settings, relations, target.vocab, limit=args.limit)
    summary: Summary = summarize(results)
    s = plan.settings
    title = (
        f"LAMA ({s.retriever if s.retriever != 'none' else 'no retrieval'}"
        f"{', common vocab' if ran.restricted else ''}): P@1/P@5/P@10 in %"
    )
    print(format_table(summary, title=title))
    if plan.rule is not None:
        print(
            f"adaptive ({'fitted on dev' if plan.adaptive_fit else args.adaptive_rule}): kNN skipped for "
            f"{100 * skipped_fraction(results):.1f} % of the {len(results)} queries"
        )
    report = report_dict(
        summary, report_settings(args, target, probe, plan, results, ran.run_s, time.perf_counter() - ran.started)
    )
    if compared is not None:
        report["adaptive_popularity"] = compared
    if args.by_popularity:
        assert target.pipeline is not None
        report["popularity"] = _by_popularity(target.pipeline, plan.queries, results)
    queries = plan.queries
    if multi is not None:
        print(multi.table)
        report["multi_piece"] = multi.report
        queries, results = [*queries, *multi.queries], [*results, *multi.results]
    write_report(args.out, report)
    if args.predictions:
        write_predictions(args.predictions, queries, results)
    if args.plots:
        from bertknn.evaluation.plots import write_plots

        written = write_plots(report, args.plots, title)
        logger.info("plots written: %s", ", ".join(str(p) for p in written))
    return 0

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
