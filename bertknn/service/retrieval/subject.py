"""Subject lookup: a query's subject -> the datastore article about it (the paper's rule for KB queries)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from bertknn.core.format import Datastore
from bertknn.core.languages import rules_for
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

    Every step is a lookup in the datastore's article table (indexed by title and by folded title): nothing is
    loaded at start-up, and ``resolve`` costs a few B-tree searches whatever the datastore's size.
    """

    def __init__(self, datastore: Datastore):
        self.articles = datastore.articles
        self.redirects = datastore.redirects
        self.dotted_i = rules_for(datastore.manifest.language).dotted_i  # a Turkish subject "istanbul": İstanbul
        logger.info("subject lookup: %d articles, %d redirects", len(self.articles), len(self.redirects))

    def normalize(self, subject: str) -> str:
        """A subject as this datastore's wiki writes titles (`normalize_title`, with its language's rule)."""
        return normalize_title(subject, dotted_i=self.dotted_i)

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

    def _folded_redirects(self, key: str) -> list[tuple[str, int]]:
        """Redirect titles that fold to ``key`` and lead to an article, with that article's rows."""
        out = []
        for source in self.redirects.folded(key):
            target = self._follow(source)
            if target is not None:
                out.append((source, self.articles[target].rows))
        return out

    def resolve_with_rule(self, subject: str) -> Resolution | None:
        """The subject's article and the rule that found it, or None."""
        norm = self.normalize(subject)
        if not norm:
            return None
        if norm in self.articles:
            return Resolution(norm, "exact")
        target = self._follow(norm)
        if target is not None:
            return Resolution(target, "redirect")
        key = fold_title(norm)
        picked = pick_among_folded(norm, [(e.title, e.rows) for e in self.articles.folded(key)])
        if picked is not None:
            return Resolution(picked, "folded")
        source = pick_among_folded(norm, self._folded_redirects(key))
        if source is not None:
            target = self._follow(source)
            if target is not None:
                return Resolution(target, "folded_redirect")
        return None

    def resolve(self, subject: str) -> str | None:
        """The title of the subject's article, or None when the datastore has none."""
        found = self.resolve_with_rule(subject)
        return found.title if found else None
