"""Subject lookup: a query's subject -> the datastore article about it (the paper's rule for KB queries)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from bertknn.core.format import Datastore
from bertknn.core.titles import fold_title, normalize_title, pick_among_folded

logger = logging.getLogger(__name__)

ResolutionRule = Literal["exact", "redirect", "folded", "folded_redirect"]
_MAX_REDIRECT_HOPS = 5


@dataclass(frozen=True)
class Resolution:
    title: str  # a title of the datastore's articles
    rule: ResolutionRule


class SubjectResolver:
    """Finds the article a subject names, trying in order:

    1. ``exact``: an article whose title is ``normalize_title(subject)``;
    2. ``redirect``: a redirect of the dump (``Datastore.redirects``) with that title, followed (up to 5 hops)
       to an article of the datastore;
    3. ``folded``: the articles whose title folds (``fold_title``: case and accents ignored) like the subject;
       when several do, ``titles.pick_among_folded`` decides (exact spelling, then same accents, then the
       article with most stored contexts, then the smallest title);
    4. ``folded_redirect``: the same over redirect titles, then followed to their article.

    The folded tables are computed once here; ``resolve`` is a few dictionary lookups.
    """

    def __init__(self, datastore: Datastore):
        self.articles = datastore.articles
        self.redirects = datastore.redirects
        self._folded: dict[str, list[tuple[str, int]]] = {}
        for title, entry in self.articles.items():
            self._folded.setdefault(fold_title(title), []).append((title, entry.rows))
        self._folded_redirects: dict[str, list[tuple[str, int]]] = {}
        for source in self.redirects:
            target = self._follow(source)
            if target is not None:
                rows = self.articles[target].rows
                self._folded_redirects.setdefault(fold_title(source), []).append((source, rows))
        logger.info(
            "subject lookup: %d articles (%d folded keys), %d redirects", len(self.articles), len(self._folded),
            len(self.redirects),
        )  # fmt: skip

    def _follow(self, title: str) -> str | None:
        """The article a redirect title leads to, or None (dangling, a loop, or not in this datastore)."""
        for _ in range(_MAX_REDIRECT_HOPS):
            nxt = self.redirects.get(title)
            if nxt is None:
                return None
            if nxt in self.articles:
                return nxt
            title = nxt
        return None

    def resolve_with_rule(self, subject: str) -> Resolution | None:
        """The subject's article and the rule that found it, or None."""
        norm = normalize_title(subject)
        if not norm:
            return None
        if norm in self.articles:
            return Resolution(norm, "exact")
        target = self._follow(norm)
        if target is not None:
            return Resolution(target, "redirect")
        key = fold_title(norm)
        picked = pick_among_folded(norm, self._folded.get(key, []))
        if picked is not None:
            return Resolution(picked, "folded")
        source = pick_among_folded(norm, self._folded_redirects.get(key, []))
        if source is not None:
            target = self._follow(source)
            if target is not None:
                return Resolution(target, "folded_redirect")
        return None

    def resolve(self, subject: str) -> str | None:
        """The title of the subject's article, or None when the datastore has none."""
        found = self.resolve_with_rule(subject)
        return found.title if found else None
