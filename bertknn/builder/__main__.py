"""``bert-knn build | add | validate | merge | upgrade | ivfpq | train-codec | recode | calibrate`` (also
``python -m datastore_builder ...``)."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import shlex
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings

from bertknn.builder.settings import AddSettings, BuildSettings, RecodeSettings
from bertknn.core import logs
from bertknn.core.commands import SUMMARIES
from bertknn.core.settings_cli import (
    add_command,
    add_settings_flags,
    adopt_legacy_env,
    env_variables,
    error_message,
    error_source,
    settings_overrides,
    unknown_variables,
)

logger = logging.getLogger("datastore_builder")


def _parser(prog: str = "python -m datastore_builder") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    b = add_command(sub, "build", SUMMARIES["build"])
    add_settings_flags(b, BuildSettings)

    t = add_command(sub, "train-codec", SUMMARIES["train-codec"], "trained on a corpus's first contexts; each "
                    "slice's build then gets --codec-from DIR")  # fmt: skip
    add_settings_flags(t, BuildSettings)

    r = add_command(sub, "recode", SUMMARIES["recode"])
    add_settings_flags(r, RecodeSettings)

    c = add_command(sub, "calibrate", SUMMARIES["calibrate"], "for datastores built before the measurement existed")
    c.add_argument("datastore", type=Path)

    v = add_command(sub, "validate", SUMMARIES["validate"])
    v.add_argument("datastore", type=Path)
    v.add_argument("--quick", action="store_true", help="sizes and shapes only, no checksums")

    m = add_command(sub, "merge", SUMMARIES["merge"], "the slices of a --num-shards build")
    m.add_argument("slices", nargs="+", type=Path)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--ivfpq", action="store_true")
    m.add_argument("--no-sparse-indexes", dest="sparse_indexes", action="store_false")

    u = add_command(sub, "upgrade", SUMMARIES["upgrade"], "in place")
    u.add_argument("datastore", type=Path)

    i = add_command(sub, "ivfpq", SUMMARIES["ivfpq"])
    i.add_argument("datastore", type=Path)

    a = add_command(sub, "add", SUMMARIES["add"], "its articles go to new shards, and the datastore's version goes "
                    "up")  # fmt: skip
    add_settings_flags(a, AddSettings)
    return p


S = TypeVar("S", bound=BaseSettings)


def _settings_or_errors(cls: type[S], args: argparse.Namespace) -> S | None:
    """Settings from the flags given (the rest from BERTKNN_* variables and defaults); errors printed per flag."""
    namespace = str(cls.model_config.get("env_prefix", ""))
    for line in unknown_variables(env_variables(cls), namespace):
        logger.warning(line)
    given = settings_overrides(args, cls)
    try:
        return cls(**given)
    except ValidationError as exc:
        for err in exc.errors():
            print(f"error: {error_source(err['loc'], cls, given)}: {error_message(err)}", file=sys.stderr)
        return None


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


# ---- the commands: each prints its result (JSON, or one line) and returns the exit status ------------------------


def _build(settings: BuildSettings) -> int:
    from bertknn.builder.build import build

    manifest = build(settings)
    print(
        json.dumps(
            {"datastore": str(settings.out), "id": manifest.datastore_id, **manifest.counts.model_dump()}
        )
    )
    return 0


def _train_codec(settings: BuildSettings) -> int:
    from bertknn.builder.build import train_codec_only

    info = train_codec_only(settings)
    print(json.dumps({"codec_dir": str(settings.out), **info.model_dump()}))
    return 0


def _recode(settings: RecodeSettings) -> int:
    from bertknn.builder.recode import recode_datastore

    print(json.dumps(recode_datastore(settings.datastore, settings.out, settings.codec_spec())))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from bertknn.core.calibration import PAPER_TEMPERATURE, recalibrate
    from bertknn.core.format import read_manifest, validate_datastore

    manifest = read_manifest(args.datastore)
    problems = validate_datastore(args.datastore, hashes=False, manifest=manifest, deep=False)
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 1
    before = recalibrate(args.datastore, manifest)
    print(json.dumps({"datastore": str(args.datastore), "before": before and before.model_dump(),
                      "distance_scale": manifest.distance_scale and manifest.distance_scale.model_dump()}))  # fmt: skip
    if manifest.distance_scale is None:
        print(f"warning: {args.datastore}: nothing to measure a distance scale from (no article holds two contexts, "
              f"or no stored word recurs among a context's neighbours); temperature auto uses the paper's "
              f"l = {PAPER_TEMPERATURE:g} until articles are added (bert-knn add) and calibrate runs again",
              file=sys.stderr)  # fmt: skip
    return 0


def _add(settings: AddSettings) -> int:
    from bertknn.builder.update import add_articles

    result = add_articles(settings)
    print(json.dumps({"datastore": str(settings.datastore), **result.summary()}))
    return 0


def _validate(args: argparse.Namespace) -> int:
    from bertknn.core.format import validate_datastore

    problems = validate_datastore(args.datastore, hashes=not args.quick)
    if problems:
        print(f"INVALID: {problems[0]}", file=sys.stderr)
        for p in problems[1:]:
            print(f"  also: {p}", file=sys.stderr)
        return 1
    print(f"OK: {args.datastore}")
    for line in datastore_warnings(args.datastore):
        print(f"warning: {line}")
    return 0


def datastore_warnings(root: Path) -> list[str]:
    """What the build recorded going wrong (`Manifest.warnings`), and the word-answer share measured now."""
    from bertknn.core.format import read_manifest
    from bertknn.core.format.health import target_warning, word_target_share

    manifest = read_manifest(root)
    live = target_warning(word_target_share(root, manifest))
    return [*manifest.warnings, *([live] if live and live not in manifest.warnings else [])]


def _merge(args: argparse.Namespace) -> int:
    from bertknn.builder.merge import merge_slices

    manifest = merge_slices(args.slices, args.out, ivfpq=args.ivfpq, sparse_indexes=args.sparse_indexes)
    print(
        json.dumps({"datastore": str(args.out), "id": manifest.datastore_id, **manifest.counts.model_dump()})
    )
    return 0


def _upgrade(args: argparse.Namespace) -> int:
    from bertknn.builder.upgrade import upgrade_datastore

    print(json.dumps(upgrade_datastore(args.datastore)))
    return 0


def _ivfpq(args: argparse.Namespace) -> int:
    from bertknn.builder.ivfpq import add_ivfpq

    add_ivfpq(args.datastore)
    print(f"OK: IVF-PQ index added to {args.datastore}")
    return 0


def _with_settings(cls: type[S], run: Callable[[S], int]) -> Callable[[argparse.Namespace], int]:
    """A command that runs on its settings model, read from the flags (exit 2 after the flags' errors)."""

    def command(args: argparse.Namespace) -> int:
        settings = _settings_or_errors(cls, args)
        return 2 if settings is None else run(settings)

    return command


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "build": _with_settings(BuildSettings, _build), "train-codec": _with_settings(BuildSettings, _train_codec),
    "recode": _with_settings(RecodeSettings, _recode), "calibrate": _calibrate,
    "add": _with_settings(AddSettings, _add), "validate": _validate, "merge": _merge, "upgrade": _upgrade,
    "ivfpq": _ivfpq,
}  # fmt: skip


def main(argv: list[str] | None = None, prog: str = "python -m datastore_builder") -> int:
    logs.configure()
    for old, new in (("BERTKNN_BUILD_", "BERTKNN_BUILD__"), ("BERTKNN_ADD_", "BERTKNN_ADD__")):
        if legacy := adopt_legacy_env(old, new):
            logger.warning(
                "environment: %s read as %s* (the one scheme); rename them", ", ".join(legacy), new
            )
    args = _parser(prog).parse_args(argv)
    from bertknn.core.errors import BertKnnError, BuildInterrupted, ModelLoadError

    if args.command == "build":  # SIGTERM stops a build as Ctrl-C does: the finished work is kept
        signal.signal(signal.SIGTERM, _interrupt)

    try:
        return _COMMANDS[args.command](args)
    except BuildInterrupted as exc:
        if args.command != "build":
            print(f"stopped ({exc})", file=sys.stderr)
            return 130
        command = shlex.join([*prog.split(), *(sys.argv[1:] if argv is None else argv)])
        print(f"{exc}. Resume it with the same command: {command}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("stopped before any work began; nothing to keep", file=sys.stderr)
        return 130
    except BertKnnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ModelLoadError) else 1  # 2: the --model given does not load; fix the flag
    except OSError as exc:
        where = exc.filename or getattr(args, "out", None) or getattr(args, "datastore", None) or ""
        print(f"error: {where}: {_os_error_message(exc)}", file=sys.stderr)
        return 1


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
