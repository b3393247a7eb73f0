"""The wiki a corpus comes from: its language's rules, its namespaces and its title case rule.

A MediaWiki dump names them itself (``<mediawiki xml:lang>``, ``<siteinfo>``'s ``<case>`` and ``<namespaces>``);
a JSON lines corpus gets the language it is given (``--language``, else English) and that language's canonical
namespaces. The same `Site` goes with every article (`corpus.Article.site`), so that the worker that turns wikitext
into text applies the dump's own namespace names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property

from bertknn.core.languages import LanguageRules, rules_for
from bertknn.core.text import dotted_i_as_i
from bertknn.core.titles import normalize_title

# MediaWiki's canonical (English) namespace names, understood by every wiki whatever its language
CANONICAL_NAMESPACES: dict[int, tuple[str, ...]] = {
    -2: ("Media",), -1: ("Special",), 1: ("Talk",), 2: ("User",), 3: ("User talk",), 4: ("Project",),
    5: ("Project talk",), 6: ("File", "Image"), 7: ("File talk", "Image talk"), 8: ("MediaWiki",),
    9: ("MediaWiki talk",), 10: ("Template",), 11: ("Template talk",), 12: ("Help",), 13: ("Help talk",),
    14: ("Category",), 15: ("Category talk",), 100: ("Portal",), 101: ("Portal talk",), 118: ("Draft",),
    119: ("Draft talk",), 828: ("Module",), 829: ("Module talk",),
}  # fmt: skip
# namespaces whose links render no text in an article: files (their captions too), categories, media
HIDDEN_NAMESPACES = frozenset({-2, 6, 14})
# interwiki prefixes of the sister projects (a link to them names no article of this wiki)
INTERWIKI = frozenset({
    "wikipedia", "wp", "wikt", "wiktionary", "s", "wikisource", "commons", "meta", "mw", "w", "q", "wikiquote", "n",
    "wikinews", "b", "wikibooks", "v", "wikiversity", "voy", "wikivoyage", "d", "wikidata", "species", "mos",
    "wikispecies", "c", "m", "phab", "foundation", "wmf",
})  # fmt: skip
_SPACES = re.compile(r"[\s_]+")


def _key(name: str) -> str:
    return _SPACES.sub(" ", name).strip().casefold()


@dataclass(frozen=True, eq=False)
class Site:
    """A wiki's language rules, title case rule and namespace names (``namespaces``: key -> localised name)."""

    rules: LanguageRules
    case: str = "first-letter"  # or "case-sensitive" (Wiktionary): titles keep their first letter's case
    namespaces: dict[int, str] = field(default_factory=dict)

    @property
    def language(self) -> str:
        return self.rules.code

    def title(self, raw: str) -> str:
        """A title as this wiki stores it (`normalize_title` with the dump's case rule and the language's)."""
        return normalize_title(raw, self.case, dotted_i=self.rules.dotted_i)

    def _names(self, keys: frozenset[int] | None) -> frozenset[str]:
        out: set[str] = set()
        every = set(CANONICAL_NAMESPACES) | set(self.namespaces) | set(self.rules.namespace_aliases)
        for key in every:
            if key == 0 or (keys is not None and key not in keys):
                continue
            names = [*CANONICAL_NAMESPACES.get(key, ()), *self.rules.namespace_aliases.get(key, ())]
            if key in self.namespaces:
                names.append(self.namespaces[key])
            out.update(_key(n) for n in names if n)
        return frozenset(out)

    @cached_property
    def hidden_prefixes(self) -> frozenset[str]:
        """Folded names of the namespaces whose links render nothing (files, categories, media)."""
        return self._names(HIDDEN_NAMESPACES)

    @cached_property
    def other_prefixes(self) -> frozenset[str]:
        """Folded names of every namespace but the main one, and the sister projects' prefixes."""
        return self._names(None) | INTERWIKI

    def prefix(self, title: str) -> str:
        """The folded text before a title's first colon (``"Datei:X.jpg"`` -> ``"datei"``), or ''."""
        head, colon, _ = title.partition(":")
        return _key(head) if colon else ""

    def is_hidden_link(self, title: str) -> bool:
        """A file, category or media link (not one written ``[[:File:...]]``, which shows as a link)."""
        title = title.strip()
        return not title.startswith(":") and self.prefix(title) in self.hidden_prefixes

    def is_other_namespace(self, title: str) -> bool:
        return self.prefix(title.strip().lstrip(":")) in self.other_prefixes

    # ---- page kinds (English's rules hold on every wiki, as its templates and magic words do) ----------------

    @cached_property
    def _redirect_words(self) -> tuple[str, ...]:
        return tuple({"#redirect", *(dotted_i_as_i(w).casefold() for w in self.rules.redirect)})

    @cached_property
    def _disambiguation(self) -> re.Pattern[str]:
        names = ENGLISH_RULES.disambiguation_templates | self.rules.disambiguation_templates
        alternatives = "|".join(re.escape(n).replace(r"\ ", r"[\s_]+") for n in sorted(names, key=len, reverse=True))
        return re.compile(rf"__DISAMBIG__|\{{\{{\s*(?:template:\s*)?(?:{alternatives})\s*[|}}]", re.IGNORECASE)

    def is_redirect(self, wikitext: str) -> bool:
        """A page whose text starts with a redirect magic word (``#REDIRECT``, ``#WEITERLEITUNG``, ``#転送``)."""
        return dotted_i_as_i(wikitext.lstrip()[:40]).casefold().startswith(self._redirect_words)

    def is_disambiguation(self, title: str, wikitext: str) -> bool:
        suffixes = (*ENGLISH_RULES.disambiguation_suffix, *self.rules.disambiguation_suffix)
        return title.endswith(suffixes) or bool(self._disambiguation.search(wikitext))

    def is_list(self, title: str) -> bool:
        english = ENGLISH_RULES.list_title
        own = self.rules.list_title
        return bool((english is not None and english.match(title)) or (own is not None and own.search(title)))


ENGLISH_RULES = rules_for("en")
ENGLISH = Site(ENGLISH_RULES)


def site_for(language: str | None) -> Site:
    """The site of a corpus that names no namespaces itself (JSON lines): its language's canonical ones."""
    return ENGLISH if language in (None, "en") else Site(rules_for(language))
