"""Every ``bert-knn`` command line that the Markdown shows parses: ``python scripts/check_commands.py`` (run by CI).

A command line is ``bert-knn COMMAND ...`` in fenced code (a shell line, continued with a trailing backslash) or
in an inline code span of a tracked ``*.md`` file. Each is parsed, without running, by the parser ``bert-knn
COMMAND`` parses its flags with (`bertknn.cli.parser`): an unknown command or flag, a missing argument, a value
outside a flag's choices or of the wrong type fails. Upper-case placeholders (``DIR``, ``N``, ``REV``) stand for a
value of the right type; ``...`` and what follows it are the page's own elision, and shell syntax after the
command (``&``, ``;``, ``|``, a redirection, a comment) ends it. Prints one line per failing command
(``page:line: command: argparse's message``) and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)((?:(?!\1).)+)\1")
PLACEHOLDER = re.compile(r"^([A-Z][A-Z0-9_]*|\$.*)$")  # DIR, DS, N, REV, SLICE_DIR; a shell variable: $i
COMMAND = re.compile(r"(?:^|[;&|(]|\bdo\b|\bthen\b)\s*(?:\$\s+)?(?:[A-Za-z_]\w*=\S*\s+)*(bert-knn\s+[a-z].*)")
SHELL_END = {"&", "&&", ";", ";;", "|", "||", "(", ")", "<", "<<"}


@dataclass(frozen=True)
class Failing:
    page: str
    line: int
    command: str
    why: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.command}: {self.why}"


def command_lines(text: str) -> Iterator[tuple[int, str, bool]]:
    """(line number, text from ``bert-knn`` on, whether it is prose's) of each command line of a page: in fenced
    code, shell lines joined over a trailing backslash; in prose, inline code spans."""
    fenced, pending, start = False, "", 0
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced, pending = not fenced, ""
            continue
        if fenced:
            if not pending:
                start = number
            pending += line.rstrip().removesuffix("\\") + " "
            if line.rstrip().endswith("\\"):
                continue
            found, pending = pending, ""
            yield from ((start, c, False) for c in _commands(found))
        else:
            for span in CODE_SPAN.finditer(line):
                yield from ((number, c, True) for c in _commands(span.group(2)))


def _commands(text: str) -> Iterator[str]:
    """The commands a shell line starts (at its start, after ``$``, environment assignments, ``;``, ``&``, ``|``,
    ``(``, ``do`` or ``then``)."""
    for match in COMMAND.finditer(text):
        yield match.group(1).strip()


def words(command: str) -> tuple[list[str], bool] | None:
    """The command's words after ``bert-knn`` up to the shell syntax or elision that ends it, and whether an
    elision (``...``) cut it; None when they are not one shell command (unbalanced quotes)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)  # (``2;`` is a word and a ``;``)
    lexer.whitespace_split = True
    try:
        split = list(lexer)
    except ValueError:
        return None
    out: list[str] = []
    for word in split[1:]:
        if word.startswith(("...", "…")) or word.endswith("..."):
            return out, True
        if word in SHELL_END or word.startswith(">"):
            break
        out.append(word.rstrip(",`"))
    return out, False


PARTIAL = ("the following arguments are required", "expected one argument")  # what a part of a command lacks


def parse_error(argv: list[str]) -> str | None:
    """argparse's message for ``bert-knn ARGV``, or None when it parses."""
    if not argv or argv[0] in ("-h", "--help", "help"):
        return None
    try:
        p, prefix = _checking_parser(argv[0])
    except KeyError:
        return f"unknown command {argv[0]!r}"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            p.parse_args([*prefix, *argv[1:]])
    except SystemExit as exc:
        if exc.code not in (0, None):
            return stderr.getvalue().strip().splitlines()[-1] if stderr.getvalue().strip() else f"exit {exc.code}"
    return None


@functools.cache
def _checking_parser(command: str) -> tuple[argparse.ArgumentParser, list[str]]:
    """`bertknn.cli.parser`'s parser of ``command``, taking placeholders (made once per command)."""
    from bertknn.cli import parser

    p, prefix = parser(command)
    _accept_placeholders(p)
    return p, prefix


def _accept_placeholders(p: argparse.ArgumentParser) -> None:
    """Every typed or choice-bound argument of ``p`` and its subparsers also takes an upper-case placeholder."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _accept_placeholders(sub)
            continue
        if callable(action.type):
            action.type = _or_placeholder(action.type)
        if action.choices is not None:
            action.choices = _WithPlaceholders(action.choices)


def _or_placeholder(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def converted(value: str) -> Any:
        return value if PLACEHOLDER.match(value) else convert(value)

    converted.__name__ = getattr(convert, "__name__", "value")  # (argparse names the type in its message)
    return converted


class _WithPlaceholders(list[Any]):
    """A flag's choices, and any placeholder."""

    def __contains__(self, value: object) -> bool:
        return super().__contains__(value) or (isinstance(value, str) and bool(PLACEHOLDER.match(value)))


def pages(root: Path) -> list[Path]:
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=root, capture_output=True, text=True, check=True).stdout
    return [root / line for line in out.splitlines() if line]


def failing(paths: list[Path], root: Path) -> tuple[list[Failing], int]:
    """The command lines of ``paths`` that do not parse, and how many command lines were read."""
    found, checked = [], 0
    for path in paths:
        for number, command, prose in command_lines(path.read_text(encoding="utf-8")):
            checked += 1
            split = words(command)
            if split is None:
                continue
            why = parse_error(split[0])
            # prose names a command with some of its flags, and an elided one shows a part of it: what they leave
            # out is no error, a flag or value that is wrong still is
            if why is not None and not ((prose or split[1]) and any(p in why for p in PARTIAL)):
                found.append(Failing(str(path.relative_to(root)), number, command, why))
    return found, checked


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="*", type=Path, help="Markdown files (default: every tracked *.md)")
    args = ap.parse_args(argv)
    paths = [p.resolve() for p in args.paths] or pages(REPO)
    found, checked = failing(paths, REPO if not args.paths else Path("/"))
    for f in found:
        print(f)
    print(f"commands: {checked} command lines in {len(paths)} pages, {len(found)} that do not parse")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
