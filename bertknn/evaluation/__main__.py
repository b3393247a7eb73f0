"""CLI: ``bert-knn eval lama|follow --data DIR --datastore DIR [options]`` (see ``--help``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bertknn.core import logs
from bertknn.core.commands import SUMMARIES
from bertknn.core.errors import EvaluationError, LamaError
from bertknn.core.settings_cli import add_command
from bertknn.evaluation.entity_runs import follow
from bertknn.evaluation.lama_run import run_lama
from bertknn.service.interpolate import DEFAULT_ARTICLE_SHARPNESS, DEFAULT_MLM_PRIOR
from bertknn.service.results import DEFAULT_BEAM

logger = logging.getLogger("evaluation")


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


def _at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``low`` (a count of neighbours, articles, facts)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r}: give a whole number") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"{value}: must be at least {low}")
        return n

    return parse


def _number(low: float, high: float | None = None) -> Callable[[str], float]:
    """An argparse type: a number in [low, high] (``high`` None: no upper bound)."""

    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r}: give a number") from None
        if not (x >= low and (high is None or x <= high)):  # (NaN fails both)
            span = f"at least {low:g}" if high is None else f"between {low:g} and {high:g}"
            raise argparse.ArgumentTypeError(f"{value}: must be {span}")
        return x

    return parse


COUNT, THREADS, LAMBDA, WEIGHT = _at_least(1), _at_least(0), _number(0.0, 1.0), _number(0.0)


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def build_parser(prog: str = "python -m evaluation") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=f"{SUMMARIES['eval']}; also two-hop relation "
                                "following (follow) and stored sentences asked back (self-probe)")  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    la = add_command(sub, "lama", "P@1/5/10 of MLM, kNN and BERT-kNN on the LAMA probe")
    for flags in (_asked_flags, _method_flags, _grid_flags, _adaptive_flags, _report_flags):
        flags(la)
    _follow_parser(sub)
    _self_probe_parser(sub)
    return p


def _self_probe_parser(sub: Any) -> None:
    """``self-probe``: stored sentences asked back; needs no labelled facts, so any language."""
    sp = add_command(
        sub, "self-probe", "ask stored sentences back with a word masked (no labels needed: any language)"
    )
    sp.add_argument("--datastore", type=Path, required=True)
    sp.add_argument("--model", help="masked LM name or directory (default: the manifest's)")
    sp.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    sp.add_argument("--threads", type=THREADS, default=0, help="torch CPU threads (0 = the CPU quota)")
    sp.add_argument("--n", type=COUNT, default=200, help="sentences to ask back")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--retriever", choices=["bm25", "tfidf", "none"], default="bm25",
                    help="asks each question without its subject too: its article among the top --num-articles")  # fmt: skip
    sp.add_argument("--num-articles", type=COUNT, default=3)
    sp.add_argument("--out", type=Path, help="write the JSON report here")


def _asked_flags(la: argparse.ArgumentParser) -> None:
    """What is asked, and of what: the probe's facts, the datastore or service, the model."""
    la.add_argument("--data", type=Path, default=Path("../shared/data/lama"), help="LAMA probe directory")
    la.add_argument("--datastore", type=Path, help="datastore directory (in-process runs)")
    la.add_argument(
        "--model", help="masked LM name or directory (default: the one the datastore's manifest names)"
    )
    la.add_argument("--url", help="evaluate a running service at this URL instead of in process")
    la.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    la.add_argument("--threads", type=THREADS, default=0, help="torch CPU threads (0 = the CPU quota)")
    la.add_argument(
        "--vocab", type=Path, help="restrict ranking (and facts) to this vocabulary, e.g. LAMA's common vocab"
    )
    la.add_argument(
        "--limit", type=COUNT, help="at most N facts per relation (the first N kept, in file order)"
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


def _method_flags(la: argparse.ArgumentParser) -> None:
    """The method's setting: retrieval, k, temperature, lambda, the vote, the layer."""
    la.add_argument("--retriever", choices=["bm25", "tfidf"], default="bm25", help="article ranker")
    la.add_argument("--no-retrieval", action="store_true", help="kNN over the whole datastore (IVF-PQ index)")
    la.add_argument("--num-articles", type=COUNT, default=3, help="N articles searched")
    la.add_argument("--k", type=COUNT, default=128, help="neighbours")
    la.add_argument(
        "--temperature", type=_temperature_arg, default=None, help="l in softmax(-d/l), or auto (default): the "
        "datastore's own, measured when it was built",
    )
    la.add_argument("--lambda", dest="lambda_", type=LAMBDA, default=0.3, help="kNN weight")
    la.add_argument(
        "--mlm-prior", type=WEIGHT, default=DEFAULT_MLM_PRIOR,
        help="the neighbours' vote weighted by p_MLM to this power (0: the paper's plain vote; word answers, not entities)",
    )  # fmt: skip
    la.add_argument(
        "--article-sharpness", type=WEIGHT, default=DEFAULT_ARTICLE_SHARPNESS,
        help="lower-ranked articles' neighbours count exp(-this * (1 - score / top score)) as much (0: the same)",
    )  # fmt: skip
    la.add_argument("--layer", type=int, help="hidden_states index the datastore must be built at (ablation)")
    la.add_argument(
        "--corpus",
        type=Path,
        action="append",
        help="with --layer: build the --datastore from this corpus at that layer when it does not exist yet",
    )


def _grid_flags(la: argparse.ArgumentParser) -> None:
    """--grid and its axes."""
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


def _adaptive_flags(la: argparse.ArgumentParser) -> None:
    """The adaptive rule: fitted on dev, read from a file, with popularity."""
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
    la.add_argument(
        "--adaptive-popularity",
        action="store_true",
        help="with --adaptive: the rule may also weigh the subject's log popularity (a datastore with links); the "
        "fit without it is reported beside it, on dev and on test (report['adaptive_popularity'])",
    )


def _report_flags(la: argparse.ArgumentParser) -> None:
    """What is reported, and where."""
    la.add_argument("--batch-size", type=COUNT, default=32)
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
        "--by-popularity",
        action="store_true",
        help="also P@1 per quartile of the subjects' popularity (inbound links; a datastore with links)",
    )


def _follow_parser(sub: Any) -> None:
    """``follow``: two-hop questions."""
    fo = add_command(sub, "follow", "two-hop questions: relation following (/follow) against one composed template")
    fo.add_argument("--data", type=Path, default=Path("../shared/data/lama"), help="LAMA probe directory")
    fo.add_argument("--datastore", type=Path, required=True, help="a datastore with links")
    fo.add_argument("--model", help="masked LM name or directory (default: the manifest's)")
    fo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    fo.add_argument("--threads", type=THREADS, default=0, help="torch CPU threads (0 = the CPU quota)")
    fo.add_argument(
        "--pairs", type=_csv, help="r1:r2 relation pairs (default: every pair with a composed template and facts)"
    )
    fo.add_argument("--limit", type=COUNT, default=50, help="questions per pair (the first N, in file order)")
    fo.add_argument("--beam", type=COUNT, default=DEFAULT_BEAM, help="entities of hop 1 that hop 2 starts from")
    fo.add_argument("--retriever", choices=["bm25", "tfidf"], default="bm25", help="for entities without an article")
    fo.add_argument("--num-articles", type=COUNT, default=3)
    fo.add_argument("--k", type=COUNT, default=128, help="neighbours")
    fo.add_argument("--temperature", type=_temperature_arg, default=None, help="a number, or auto (default)")
    fo.add_argument("--lambda", dest="lambda_", type=LAMBDA, default=0.3, help="kNN weight")
    fo.add_argument("--out", type=Path, help="write the JSON report here")
    fo.add_argument("--quiet", action="store_true", help="no progress bars")


def main(argv: Sequence[str] | None = None, prog: str = "python -m evaluation") -> int:
    logs.configure()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser(prog).parse_args(argv)
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
        with ExitStack() as stack:
            if args.command == "lama":
                return run_lama(args, stack)
            if args.command == "follow":
                return follow(args, stack)
            if args.command == "self-probe":
                from bertknn.evaluation.selfprobe import run_self_probe

                return run_self_probe(args, stack)
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
