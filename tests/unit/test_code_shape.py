"""The package's shape rules that a reader relies on: no class over 200 lines, no function over 60 (one screen).

A rule broken here names the place, so that the class is split along its jobs, or the function along its steps,
instead of the limit being raised."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "bertknn"
MAX_CLASS_LINES = 200
MAX_FUNCTION_LINES = 60


def oversized(source: str, where: str) -> list[str]:
    """Each class longer than `MAX_CLASS_LINES` and function (method, nested function) longer than
    `MAX_FUNCTION_LINES` in ``source``, with its line count, decorators and docstring included."""
    out = []
    for node in ast.walk(ast.parse(source)):
        limit = {ast.ClassDef: MAX_CLASS_LINES, ast.FunctionDef: MAX_FUNCTION_LINES,
                 ast.AsyncFunctionDef: MAX_FUNCTION_LINES}.get(type(node))  # fmt: skip
        if limit is None:
            continue
        assert isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        lines = (node.end_lineno or node.lineno) - first + 1
        if lines > limit:
            out.append(f"{where}:{first} {node.name}: {lines} lines (at most {limit})")
    return out


def test_no_class_or_function_in_the_package_is_over_its_limit() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100  # the whole package, not an empty glob
    found = [o for f in files for o in oversized(f.read_text(encoding="utf-8"), str(f.relative_to(PACKAGE.parent)))]
    assert not found, "split these along their jobs:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("body_lines", "kind", "flagged"),
    [(MAX_FUNCTION_LINES - 2, "def", False), (MAX_FUNCTION_LINES - 1, "def", True),
     (MAX_CLASS_LINES - 2, "class", False), (MAX_CLASS_LINES - 1, "class", True)],
)  # fmt: skip
def test_the_check_counts_a_definition_s_lines_from_its_decorator_to_its_end(
    body_lines: int, kind: str, flagged: bool
) -> None:
    # a decorator line, the header, then body_lines: body_lines + 2 lines in all
    body = "\n".join(f"    x{i} = {i}" for i in range(body_lines))
    source = f"@decorated\n{kind} thing{'()' if kind == 'def' else ''}:\n{body}\n"
    found = oversized(source, "f.py")
    assert bool(found) is flagged, found
    if flagged:
        limit = MAX_FUNCTION_LINES if kind == "def" else MAX_CLASS_LINES
        assert found == [f"f.py:1 thing: {body_lines + 2} lines (at most {limit})"]
