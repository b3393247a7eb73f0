"""CLI: ``python -m datastore_builder build | add | validate | merge | ivfpq``."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from bertknn.builder.settings import BuildSettings

logger = logging.getLogger("datastore_builder")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m datastore_builder", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="build (or resume) a datastore from corpus files")
    b.add_argument("--corpus", action="append", type=Path, help="JSONL or MediaWiki XML(.bz2) file; repeatable")
    b.add_argument("--model", help="masked LM name or directory (default bert-base-uncased)")
    b.add_argument("--out", type=Path, help="output directory")
    b.add_argument("--layer", type=int, help="hidden_states index; -2 = second-to-last (default)")
    b.add_argument("--device", choices=["auto", "cpu", "cuda"])
    b.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    b.add_argument("--batch-size", type=int)
    b.add_argument("--max-seq-len", type=int)
    b.add_argument("--shard-index", type=int, help="this worker's slice (0-based)")
    b.add_argument("--num-shards", type=int, help="number of slices the build is split into")
    b.add_argument("--limit-articles", type=int)
    b.add_argument("--articles-per-shard", type=int)
    b.add_argument("--stopwords", type=Path, help="stopword file, one word per line")
    b.add_argument("--min-sentence-chars", type=int)
    b.add_argument("--no-sparse-indexes", dest="sparse_indexes", action="store_const", const=False)
    b.add_argument("--ivfpq", action="store_const", const=True, help="also build the whole-datastore IVF-PQ index")
    b.add_argument("--threads", type=int, help="torch CPU threads (0 = CPU quota)")
    b.add_argument("--workers", type=int, help="tokenising worker processes (0 = inline)")
    b.add_argument("--backend", choices=["eager", "auto", "onnx", "torchscript"],
                   help="forward backend (default eager, the reference; onnx is about 2x faster on a CPU)")
    b.add_argument(
        "--targets",
        choices=["single-piece", "whole-word"],
        help="single-piece: words of one wordpiece, labels are token ids (default, the paper's rule); whole-word: "
        "words of up to 8 wordpieces, each masked by ONE [MASK], labels index the shard's words.json",
    )

    v = sub.add_parser("validate", help="check a datastore and name the first problem")
    v.add_argument("datastore", type=Path)
    v.add_argument("--quick", action="store_true", help="sizes and shapes only, no checksums")

    m = sub.add_parser("merge", help="join the slices of a --num-shards build into one datastore")
    m.add_argument("slices", nargs="+", type=Path)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--ivfpq", action="store_true")
    m.add_argument("--no-sparse-indexes", dest="sparse_indexes", action="store_false")

    i = sub.add_parser("ivfpq", help="build the whole-datastore IVF-PQ index (no-retrieval ablation)")
    i.add_argument("datastore", type=Path)

    a = sub.add_parser(
        "add",
        help="embed new or changed articles into new shards of a datastore and bump its version (live update)",
    )
    a.add_argument("--datastore", type=Path, required=True, help="the datastore directory to update")
    a.add_argument("--corpus", action="append", type=Path, help="JSONL or MediaWiki XML(.bz2) file; repeatable")
    a.add_argument("--model", help="default: the model the manifest names (other weights are refused)")
    a.add_argument("--device", choices=["auto", "cpu", "cuda"])
    a.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"])
    a.add_argument("--batch-size", type=int)
    a.add_argument("--articles-per-shard", type=int, help="default: the manifest's")
    a.add_argument("--stopwords", type=Path, help="the build's stopword file, if it was not the bundled list")
    a.add_argument("--min-sentence-chars", type=int, help="default: the build's")
    a.add_argument("--threads", type=int, help="torch CPU threads (0 = CPU quota)")
    a.add_argument("--workers", type=int, help="tokenising worker processes (default 0 = inline)")
    return p


def _settings_or_errors(cls: type, args: argparse.Namespace) -> object | None:
    """Settings from the flags given (the rest from BERTKNN_* variables and defaults); errors printed per flag."""
    overrides = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
    try:
        return cls(**overrides)
    except ValidationError as exc:
        for err in exc.errors():
            loc = "--" + "-".join(str(x) for x in err["loc"]).replace("_", "-") if err["loc"] else "settings"
            print(f"error: {loc}: {err['msg']}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    from bertknn.core.errors import BuildError, CorpusError, DatastoreError, ModelLoadError

    try:
        if args.command == "build":
            overrides = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
            try:
                settings = BuildSettings(**overrides)
            except ValidationError as exc:
                for err in exc.errors():
                    loc = "--" + "-".join(str(x) for x in err["loc"]).replace("_", "-") if err["loc"] else "settings"
                    print(f"error: {loc}: {err['msg']}", file=sys.stderr)
                return 2
            from bertknn.builder.build import build

            manifest = build(settings)
            print(json.dumps({"datastore": str(settings.out), "id": manifest.datastore_id, **manifest.counts.model_dump()}))
            return 0
        if args.command == "add":
            from bertknn.builder.settings import AddSettings
            from bertknn.builder.update import add_articles

            add_settings = _settings_or_errors(AddSettings, args)
            if add_settings is None:
                return 2
            result = add_articles(add_settings)  # type: ignore[arg-type]
            print(json.dumps({"datastore": str(args.datastore), **result.summary()}))
            return 0
        if args.command == "validate":
            from bertknn.core.format import validate_datastore

            problems = validate_datastore(args.datastore, hashes=not args.quick)
            if problems:
                print(f"INVALID: {problems[0]}", file=sys.stderr)
                for p in problems[1:]:
                    print(f"  also: {p}", file=sys.stderr)
                return 1
            print(f"OK: {args.datastore}")
            return 0
        if args.command == "merge":
            from bertknn.builder.merge import merge_slices

            manifest = merge_slices(args.slices, args.out, ivfpq=args.ivfpq, sparse_indexes=args.sparse_indexes)
            print(json.dumps({"datastore": str(args.out), "id": manifest.datastore_id, **manifest.counts.model_dump()}))
            return 0
        if args.command == "ivfpq":
            from bertknn.builder.ivfpq import add_ivfpq

            add_ivfpq(args.datastore)
            print(f"OK: IVF-PQ index added to {args.datastore}")
            return 0
    except (BuildError, CorpusError, ModelLoadError, DatastoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        where = exc.filename or getattr(args, "out", None) or getattr(args, "datastore", None) or ""
        print(f"error: {where}: {_os_error_message(exc)}", file=sys.stderr)
        return 1
    return 2


_OUT_OF_SPACE = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def _os_error_message(exc: OSError) -> str:
    """One line; running out of space says so and what to do (finished shards are kept, so a re-run resumes)."""
    reason = exc.strerror or str(exc)
    if exc.errno not in _OUT_OF_SPACE:
        return reason
    if exc.errno == errno.EFBIG:
        what = f"the file outgrew the file-size limit ({reason}: ulimit -f, or the filesystem's largest file)"
    else:
        what = f"the disk is full ({reason})"
    return (
        f"out of space: {what}; free some space or choose another --out, then run the same command again "
        "(finished shards are kept)"
    )


if __name__ == "__main__":
    sys.exit(main())
