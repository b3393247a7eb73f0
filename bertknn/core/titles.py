"""Article title normalisation: the one place where builder and service agree on what a title is."""

from __future__ import annotations

import re
import unicodedata

_SPACES = re.compile(r"[\s_]+")


def normalize_title(title: str, case: str = "first-letter", *, dotted_i: bool = False) -> str:
    """Canonical article key, as Wikipedia stores titles.

    Unicode NFC, underscores and runs of whitespace become one space, trimmed, and, on a ``first-letter`` wiki
    (every Wikipedia; a dump's ``<case>``), the first letter is upper-cased (``$wgCapitalLinks``):
    ``"albert_einstein"`` -> ``"Albert einstein"``. A ``case-sensitive`` wiki (Wiktionary) keeps it. Where the
    language's ``dotted_i`` rule holds (Turkish, Azerbaijani), i upper-cases to İ (``"istanbul"`` ->
    ``"İstanbul"``), as MediaWiki's ``LanguageTr::ucfirst`` does.
    """
    t = _SPACES.sub(" ", unicodedata.normalize("NFC", title)).strip()
    if not t or case == "case-sensitive":
        return t
    return ("İ" if dotted_i and t[0] == "i" else t[0].upper()) + t[1:]


def strip_latin_accents(text: str) -> str:
    """Accents dropped from Latin letters only (``É`` -> ``E``); every other script's marks stay, because there
    they make other letters (``が`` is not ``か``, ``й`` is not ``и``). NFC result."""
    if text.isascii():
        return text
    out: list[str] = []
    for ch in unicodedata.normalize("NFKD", text):
        if unicodedata.combining(ch) and out and "LATIN" in unicodedata.name(out[-1], ""):
            continue
        out.append(ch)
    return unicodedata.normalize("NFC", "".join(out))


def fold_title(title: str) -> str:
    """Lookup key that ignores case and Latin accents: ``"Émile Zola"`` and ``"emile zola"`` fold alike, while
    ``"が"`` and ``"か"`` or ``"й"`` and ``"и"`` stay apart (`strip_latin_accents`).

    ``casefold`` and whitespace collapsed, NFC. Several titles may share one folded key; :func:`pick_among_folded`
    decides between them (an exact title always wins).
    """
    stripped = strip_latin_accents(normalize_title(title))
    return _SPACES.sub(" ", unicodedata.normalize("NFC", stripped.casefold())).strip()


def pick_among_folded(query: str, candidates: list[tuple[str, int]]) -> str | None:
    """Choose one title among those whose folded form equals the query's.

    Documented rule, in order: (1) a title equal to the normalised query (exact case and accents);
    (2) a title equal to the query ignoring case only (accents kept); (3) the article with the most stored
    contexts; (4) the lexicographically smallest title. ``candidates`` are ``(title, n_contexts)``.
    """
    if not candidates:
        return None
    norm = normalize_title(query)
    for title, _ in candidates:
        if title == norm:
            return title
    lowered = norm.casefold()
    same_case_folded = [c for c in candidates if c[0].casefold() == lowered]
    pool = same_case_folded or candidates
    return sorted(pool, key=lambda c: (-c[1], c[0]))[0][0]
