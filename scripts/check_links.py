"""Every relative link in the repository's Markdown leads somewhere: ``python scripts/check_links.py`` (run by CI).

A link ``[text](path)`` or ``[text](path#anchor)`` (images too) in a tracked ``*.md`` file must name a file or
folder of the repository, relative to the page; an anchor, ``#anchor`` alone included, must be a heading of the
page it points into, as GitHub makes heading anchors (lower case, punctuation dropped, spaces as hyphens, a repeated
heading numbered ``-1``, ``-2``...). Links with a scheme (``https:``, ``mailto:``) and links inside code are not
checked. Prints one line per broken link (``page:line: link: why``) and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+\1")


@dataclass(frozen=True)
class Broken:
    page: str
    line: int
    link: str
    why: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.link}: {self.why}"


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of a page outside fenced code, with inline code spans blanked."""
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text: links as their text, lower case, every character but letters, digits,
    ``_``, ``-`` and spaces dropped, spaces as hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings, a repeated one numbered as GitHub numbers it."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def check_page(page: Path, root: Path) -> list[Broken]:
    """The broken relative links of one page."""
    text = page.read_text(encoding="utf-8")
    rel = page.relative_to(root).as_posix()
    broken = []
    for number, line in prose_lines(text):
        for m in LINK.finditer(line):
            link = m.group(1)
            why = None if SCHEME.match(link) else why_broken(page, link, root)
            if why:
                broken.append(Broken(rel, number, link, why))
    return broken


def why_broken(page: Path, link: str, root: Path) -> str | None:
    """Why a relative link of ``page`` leads nowhere, or None."""
    path, _, anchor = link.partition("#")
    target = (page.parent / path).resolve() if path else page
    if path and root.resolve() not in target.parents and target != root.resolve():
        return "outside the repository"
    if not target.exists():
        return "no such file"
    if anchor and target.is_file() and target.suffix == ".md" and anchor not in anchors(target.read_text("utf-8")):
        return f"no heading with the anchor #{anchor} in {target.name}"
    return None


def tracked_pages(root: Path) -> list[Path]:
    """The Markdown files git tracks under ``root``."""
    out = subprocess.run(["git", "ls-files", "*.md"], cwd=root, check=True, capture_output=True, text=True).stdout
    return [root / name for name in out.splitlines()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("pages", nargs="*", type=Path, help="pages to check (default: every tracked *.md)")
    args = p.parse_args(argv)
    pages = [page.resolve() for page in args.pages] or tracked_pages(REPO)
    broken = [b for page in pages for b in check_page(page, REPO)]
    for b in broken:
        print(b)
    print(f"links: {len(pages)} pages, {len(broken)} broken", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
