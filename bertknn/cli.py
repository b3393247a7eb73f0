"""``bert-knn``: one command for everything: build, serve, evaluate, ask.

Each subcommand is the module a ``python -m`` entry point also runs; ``bert-knn SUB --help`` lists its flags.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from bertknn.core.commands import command_list

USAGE = f"""usage: bert-knn COMMAND [FLAGS...]

commands:
{command_list()}

`bert-knn COMMAND --help` lists a command's flags; docs/configuration.md lists every setting."""

_BUILDER = ("build", "add", "validate", "merge", "upgrade", "ivfpq", "train-codec", "recode", "calibrate")


def _runner(command: str) -> Callable[[list[str]], int]:
    if command in _BUILDER:
        from bertknn.builder.__main__ import main as builder

        return lambda argv: builder([command, *argv], prog="bert-knn")
    if command == "serve":
        from bertknn.service.__main__ import main as serve

        return lambda argv: serve(argv, prog="bert-knn serve")
    if command == "eval":
        from bertknn.evaluation.__main__ import main as evaluate

        return lambda argv: evaluate(argv, prog="bert-knn eval")
    if command == "predict":
        from bertknn.service.client import main as predict

        return lambda argv: predict(["predict", *argv], prog="bert-knn")
    raise KeyError(command)


def parser(command: str) -> tuple[argparse.ArgumentParser, list[str]]:
    """The argument parser that ``bert-knn COMMAND`` parses its flags with, and what it puts before them (the
    builder's and predict's parsers take the command's name first): for checking a command line without running
    it (`scripts/check_commands.py`)."""
    if command in _BUILDER:
        from bertknn.builder.__main__ import _parser

        return _parser("bert-knn"), [command]
    if command == "serve":
        from bertknn.service.__main__ import build_parser

        return build_parser("bert-knn serve"), []
    if command == "eval":
        from bertknn.evaluation.__main__ import build_parser as eval_parser

        return eval_parser("bert-knn eval"), []
    if command == "predict":
        from bertknn.service.client import build_parser as predict_parser

        return predict_parser("bert-knn"), ["predict"]
    raise KeyError(command)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if args else 2
    try:
        run = _runner(args[0])
    except KeyError:
        print(f"bert-knn: unknown command {args[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return run(args[1:])


if __name__ == "__main__":
    sys.exit(main())
