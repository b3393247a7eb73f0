"""Wikitext to article text that reads like Wikipedia: the words templates render, no references, no back matter.

Rules (docs/building.md, "Article text"):
- Sections that are not article text are dropped whole: See also, Notes, References, Further reading, External
  links, Bibliography, Sources, Citations, Footnotes, Works cited (and their "and"-combinations).
- Templates that render words give their words: ``convert``/``cvt`` (``{{convert|70|mi|km}}`` -> "70 mi", ranges
  "2 to 4 km"), ``lang``/``lang-xx``/``transl`` (the text), ``nowrap``, ``nobr``, ``small``, ``big``, ``nobold``,
  ``noitalic``, ``ill``, ``vanchor`` (their first argument), dates (``birth date``, ``death date``, ``start date``,
  ``end date``, their ``and age`` forms, ``dts``: "14 March 1879"), ``circa`` ("c."), also within one another
  (``{{nowrap|{{convert|5|km}}}}``). Every other template is dropped (infoboxes, citations, pronunciation: IPA
  renders symbols, not words), and the templates within it with it.
- List items (lines starting ``*``, ``#`` or ``;``), references (``<ref>``, ``<references>``), tables,
  galleries, files, categories and headings are dropped; the
  brackets and separators that dropped pronunciations leave behind ("(, ; ; )") are removed.

Links (`wikitext_links`): a link shows its text, or its title without the colon that makes ``[[:Category:X]]`` a
link. Every wikilink left in the text (``[[Target]]``, ``[[Target|anchor]]``) gives a `Link`,
the anchor's character span in the returned text and the target title (``#section`` dropped, normalised by
``titles.normalize_title``; redirects are resolved later, against the whole dump's). Links inside dropped parts
(templates, references, files, back matter) go with them; links to a section of the same page are not kept.
"""

from __future__ import annotations

import contextlib
import re
import unicodedata
from dataclasses import dataclass

import mwparserfromhell
from mwparserfromhell.nodes import Template, Wikilink
from mwparserfromhell.wikicode import Wikicode

from bertknn.builder.site import ENGLISH, Site
from bertknn.core.languages import unspaced_share
from bertknn.core.text import unicode_words

# the version of these rules, recorded in a build's state: a resumed build must use the same
# 3: namespaces, back matter and sentence ends per language; file-link parameters are markup; 4: [[:X]] shows X,
# templates within kept ones render; 5: a word's characters are Unicode's (marks and joiners), sentences end after
# them, titles of Turkic wikis upper-case i to İ, a link takes its language's link trail ([[bus]]es)
TEXT_RULES = 6
_INTERLANGUAGE_LINK = re.compile(r"^[a-z]{2,3}(-[a-z]+)*:")
_HIDDEN_TAGS = frozenset({"table", "gallery", "ref", "references"})
# (a pattern string: mwparserfromhell compiles it with re.IGNORECASE itself)
BACK_MATTER = (
    r"^\s*((see also|notes?|references?|further reading|external links?|bibliography|sources|citations|footnotes|"
    r"works cited|explanatory notes|general references?)(\s*(and|&)\s*)?)+\s*$"
)
_FIRST_ARG = frozenset({"nowrap", "nobr", "small", "smaller", "big", "nobold", "noitalic", "ill", "vanchor",
                        "visible anchor", "lang-x", "transl", "sic", "nowr"})  # fmt: skip
_DATES = frozenset({"birth date", "death date", "start date", "end date", "birth date and age",
                    "death date and age", "start date and age", "end date and age", "dts", "birth-date", "death-date"})  # fmt: skip
_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
           "November", "December")  # fmt: skip
_RANGE = frozenset({"-", "–", "to", "and", "or", "x", "by", "&"})
_EMPTY_BRACKETS = re.compile(r"\s*\(\s*[,;:–-]*(\s*[,;:]\s*)*\s*\)")
_LEADING_SEPARATOR = re.compile(r"\(\s*[,;]\s*")
_SPACE_BEFORE_PUNCT = re.compile(r"\s+([,.;:!?])")
_LIST_ITEM = re.compile(r"^[*#;].*$", re.MULTILINE)  # list items (filmographies, bibliographies, links)
_SPACES = re.compile(r"[ \t\u00a0]{2,}")


def _positional(tpl: Template) -> list[str]:
    return [str(p.value).strip() for p in tpl.params if not p.showkey]


def _name(tpl: Template) -> str:
    return re.sub(r"[\s_]+", " ", str(tpl.name)).strip().lower()


def render_template(tpl: Template) -> str | None:
    """The words a template renders, or None when it renders none worth keeping (it is then dropped)."""
    name, args = _name(tpl), _positional(tpl)
    if name in ("convert", "cvt") and len(args) >= 2:
        if len(args) >= 4 and args[1].lower() in _RANGE:
            return f"{args[0]} {args[1]} {args[2]} {args[3]}"
        return f"{args[0]} {args[1]}"
    if name == "lang" and len(args) >= 2:
        return args[1]
    if name.startswith("lang-") and args:
        return args[0]
    if name in _FIRST_ARG and args:
        return args[0]
    if name in _DATES:
        nums = [a for a in args if a.isdigit()]
        if len(nums) >= 3 and 1 <= int(nums[1]) <= 12:
            return f"{int(nums[2])} {_MONTHS[int(nums[1]) - 1]} {nums[0]}"
        if len(nums) >= 2 and 1 <= int(nums[1]) <= 12:
            return f"{_MONTHS[int(nums[1]) - 1]} {nums[0]}"
        return nums[0] if nums else None
    if name in ("circa", "c."):
        return f"c. {args[0]}" if args else "c."
    return None


def _hidden_link(link: Wikilink, site: Site) -> bool:
    """Files, categories and interlanguage links render as no text; strip_code would keep their titles."""
    title = str(link.title).strip()
    return site.is_hidden_link(title) or bool(link.text is None and _INTERLANGUAGE_LINK.match(title))


@dataclass(frozen=True)
class Link:
    """An entity link: the anchor's characters ``text[start:end]`` refer to the article ``target``."""

    start: int
    end: int
    target: str


# Private-use characters mark each link's anchor through strip_code and the line rules, then come out again:
# OPEN + link number + NUMBER_END + anchor + CLOSE. They never occur in article text (dropped if they do).
_OPEN, _NUMBER_END, _CLOSE = "\ue000", "\ue001", "\ue002"
_MARKS = re.compile("[\ue000-\ue002]")
_MARKED = re.compile("\ue000(\\d+)\ue001([^\ue000-\ue002]*)\ue002")


def link_target(title: str, site: Site = ENGLISH) -> str:
    """The normalised article a wikilink's title points at; '' for a link that names no article: a section of the
    same page (``#History``), another namespace or wiki (``:Category:X``, ``wikt:word``, the site's own localised
    namespace names: ``Kategorie:X``), another language."""
    title = title.strip().lstrip(":")
    page = title.split("#", 1)[0].strip()
    if site.is_other_namespace(page) or _INTERLANGUAGE_LINK.match(page):
        return ""
    return site.title(page)


def _render_templates(code: Wikicode) -> None:
    """Each template replaced by the words it renders (`render_template`), or removed. Outer templates first, so
    that a dropped one (an infobox) takes its inner ones with it unrendered; the words of a kept one are rendered
    in turn where they hold templates themselves (``{{nowrap|{{convert|5|km}}}}``)."""
    for tpl in code.filter_templates(recursive=True):
        words = render_template(tpl)
        with contextlib.suppress(ValueError):  # already gone with an enclosing template
            if words is None:
                code.remove(tpl)
            elif "{{" in words:
                inner = mwparserfromhell.parse(words)
                _render_templates(inner)
                code.replace(tpl, inner)
            else:
                code.replace(tpl, words)


def wikitext_to_text(wikitext: str, site: Site = ENGLISH) -> str:
    """Article text of a page's wikitext (the module docstring lists the rules)."""
    return wikitext_links(wikitext, site)[0]


def wikitext_links(wikitext: str, site: Site = ENGLISH) -> tuple[str, list[Link]]:
    """Article text of a page's wikitext and the entity links in it (the module docstring lists the rules; the
    site gives the namespace names and the back-matter headings of its language)."""
    code = mwparserfromhell.parse(_LIST_ITEM.sub("", _MARKS.sub("", wikitext)))
    back_matter = BACK_MATTER if site is ENGLISH else site.rules.back_matter_pattern()
    for section in code.get_sections(matches=back_matter, include_lead=False, include_headings=True):
        with contextlib.suppress(ValueError):  # (a subsection of one already removed)
            code.remove(section)
    _render_templates(code)
    hidden = [
        *(n for n in code.filter_wikilinks(recursive=True) if _hidden_link(n, site)),
        *(n for n in code.filter_tags(recursive=True) if str(n.tag).lower() in _HIDDEN_TAGS),
        *code.filter_headings(recursive=True),
    ]
    for node in hidden:
        with contextlib.suppress(ValueError):  # already gone with an enclosing node (a link in a file caption)
            code.remove(node)
    targets: list[str] = []
    for link in code.filter_wikilinks(recursive=True):
        title = str(link.title).strip()
        target = link_target(title, site)
        # what the page shows: the link's text, else its title without the colon that makes [[:Category:X]] a
        # link instead of a category (strip_code would keep the colon)
        anchor = str(link.text) if link.text is not None else title.lstrip(":")
        with contextlib.suppress(ValueError):
            if target:
                code.replace(link, f"{_OPEN}{len(targets)}{_NUMBER_END}{anchor}{_CLOSE}")
                targets.append(target)
            elif link.text is None and title.startswith(":"):
                code.replace(link, anchor)
    text = code.strip_code(normalize=True, collapse=True, keep_template_params=False)
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("|", "{", "!")):  # table rows and template residue
            continue
        line = _LEADING_SEPARATOR.sub("(", _EMPTY_BRACKETS.sub("", line))
        line = _SPACE_BEFORE_PUNCT.sub(r"\1", _SPACES.sub(" ", line))
        lines.append(line)
    return _take_links("\n".join(lines), targets, site.rules.link_trail)


def _take_links(marked: str, targets: list[str], trail: re.Pattern[str] | None = None) -> tuple[str, list[Link]]:
    """The text without the link marks, and each marked anchor's span in it (anchors left empty are dropped); the
    letters of the language's link trail right after an anchor are part of it (``[[bus]]es``: ``buses``)."""
    out: list[str] = []
    links: list[Link] = []
    pos = 0  # in marked
    length = 0  # of the output so far
    for m in _MARKED.finditer(marked):
        before = _MARKS.sub("", marked[pos : m.start()])  # (a mark whose partner was dropped)
        out.append(before)
        length += len(before)
        anchor = m.group(2)
        lead = len(anchor) - len(anchor.lstrip())
        core = anchor.strip()
        if core:
            after = trail.match(marked, m.end()) if trail is not None and core == anchor[lead:] else None
            end = length + lead + len(core) + (len(after.group()) if after else 0)
            links.append(Link(length + lead, end, targets[int(m.group(1))]))
        out.append(anchor)
        length += len(anchor)
        pos = m.end()
    out.append(_MARKS.sub("", marked[pos:]))
    return "".join(out), links


_WORD = unicode_words(r"(?:[^\W\d_]|\p{No}){2,}")  # a letter's marks are in its word (जन्म: one word)
_RESIDUE = re.compile(
    r"colspan|rowspan|align\s*=|style\s*=|\{\{|\}\}|\[\[|\]\]|<ref|</ref|^\s*[!|*#]|\w\|\w|''"
    r"|\s\|\s[^|]*\s\|\s|\|\s*[\w-]+\s*="  # navigation-box rows ("A | B | C"), template parameters ("|name=")
)
_HATNOTE = re.compile(r"^(see also|main articles?|further information|for other uses|not to be confused)\b", re.I)
MIN_WORDS = 4
MIN_UNSPACED_LETTERS = 6  # a sentence written without spaces (Japanese, Chinese, Thai): its letters, not words


def drop_reason(sentence: str, min_chars: int) -> str | None:
    """Why the build leaves a split sentence out of the datastore (``short``: under ``min_chars`` characters, else
    `sentence_problem`'s), or None when it keeps it: the one rule of the build and of `bert-knn add`'s test of
    an unchanged article."""
    return "short" if len(sentence) < min_chars else sentence_problem(sentence)


def sentence_problem(sentence: str) -> str | None:
    """Why a sentence is not kept as a context, or None: ``markup`` (table or template residue, a raw
    reference, a file link's ``thumb|right|...`` parameters, a navigation box's ``A | B | C``, italics' ``''``),
    ``fragment`` (fewer than `MIN_WORDS` words of two
    letters or more: list items, bibliography entries, captions, a lone "." or "ISBN ..."; a sentence mostly in a
    script without spaces: fewer than `MIN_UNSPACED_LETTERS` letters), ``hatnote`` ("See also ...", "Main
    article: ...")."""
    if _RESIDUE.search(sentence):
        return "markup"
    if _HATNOTE.match(sentence):
        return "hatnote"
    if not sentence.isascii() and unspaced_share(sentence) > 0.5:
        if sum(1 for ch in sentence if unicodedata.category(ch)[0] == "L") < MIN_UNSPACED_LETTERS:
            return "fragment"
    elif len(_WORD.findall(sentence)) < MIN_WORDS:
        return "fragment"
    return None
