"""Article title normalisation: the one place where builder and service agree on what a title is."""

from __future__ import annotations

import re
import unicodedata

_SPACES = re.compile(r"[\s_]+")


def normalize_title(title: str) -> str:
    """Canonical article key, as Wikipedia stores titles.

    Unicode NFC, underscores and runs of whitespace become one space, trimmed, and the first letter is
    upper-cased (Wikipedia's ``$wgCapitalLinks``): ``"albert_einstein"`` -> ``"Albert einstein"``.
    """
    t = _SPACES.sub(" ", unicodedata.normalize("NFC", title)).strip()
    if not t:
        return t
    return t[0].upper() + t[1:]


def fold_title(title: str) -> str:
    """Lookup key that ignores case and accents: ``"Émile Zola"`` and ``"emile zola"`` fold alike.

    NFKD decomposition, combining marks dropped, ``casefold``, whitespace collapsed. Several titles may
    share one folded key; :func:`pick_among_folded` decides between them.
    """
    decomposed = unicodedata.normalize("NFKD", normalize_title(title))
    stripped = "".join(ch for ch in decomposed if not unicodedata.combining(ch))
    return _SPACES.sub(" ", stripped.casefold()).strip()


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
