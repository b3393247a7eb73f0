"""What is language-specific between a dump and an answer: each language's rules as data (``languages.json``),
and the script facts both sides use (which characters belong to scripts that do not space their words).

A datastore has one language (its manifest's ``language``): read from a dump's ``<mediawiki xml:lang>``, given
with ``--language`` for JSON lines, ``en`` by default. Languages the data does not name get the ``default`` rules
(the Unicode sentence rule, no stopwords beyond the corpus's own, the namespaces the dump lists). See
docs/languages.md.
"""

from __future__ import annotations

import json
import re
import threading
import unicodedata
from dataclasses import dataclass
from functools import cache
from importlib import resources

_LANGUAGE_CODE = re.compile(r"^[a-z]{2,3}(-[a-z0-9]+)*$")

# Scripts written without spaces between words (Unicode blocks): Han, Hiragana, Katakana (and their extensions),
# Thai, Lao, Khmer, Myanmar, Tibetan. Hangul is spaced.
_UNSPACED_RANGES = (
    (0x0E00, 0x0EFF),  # Thai, Lao
    (0x0F00, 0x0FFF),  # Tibetan
    (0x1000, 0x109F),  # Myanmar
    (0x1780, 0x17FF),  # Khmer
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0x31F0, 0x31FF),  # Katakana phonetic extensions
    (0xFF66, 0xFF9F),  # half-width Katakana
    (0x20000, 0x3134F),  # CJK extensions B-G
)


# the same, as the inside of a regular-expression character class (TF-IDF's terms use it too)
UNSPACED_CLASS = "".join(f"{chr(a)}-{chr(b)}" for a, b in _UNSPACED_RANGES) + "々〆ー"
_UNSPACED_RE = re.compile(f"[{UNSPACED_CLASS}]")


def is_unspaced_char(ch: str) -> bool:
    """Whether a character belongs to a script that does not separate words by spaces (Japanese, Chinese, Thai)."""
    return not ch.isascii() and _UNSPACED_RE.match(ch) is not None


def has_unspaced(text: str) -> bool:
    """Whether a text holds any character of an unspaced script (`is_unspaced_char`); ASCII text at C speed."""
    return not text.isascii() and _UNSPACED_RE.search(text) is not None


def unspaced_share(text: str) -> float:
    """The share of a text's letters that are in unspaced scripts (0 for a text without letters)."""
    letters = [ch for ch in text if unicodedata.category(ch)[0] == "L"]
    return sum(map(is_unspaced_char, letters)) / len(letters) if letters else 0.0


def script(ch: str) -> str:
    """A letter's script, coarsely, from its Unicode name: ``LATIN``, ``CYRILLIC``, ``CJK`` (Han, kana), ``HANGUL``..."""
    if is_unspaced_char(ch) and not ("\u0e00" <= ch <= "\u0eff" or "\u0f00" <= ch <= "\u17ff"):
        return "CJK"
    name = unicodedata.name(ch, "")
    return name.split(" ", 1)[0] if name else ""


def scripts(text: str) -> dict[str, int]:
    """The letters of a text counted by `script`."""
    out: dict[str, int] = {}
    for ch in text:
        if unicodedata.category(ch)[0] == "L":
            s = script(ch)
            out[s] = out.get(s, 0) + 1
    return out


@dataclass(frozen=True)
class LanguageRules:
    """One language's rules (``languages.json``: the entry for the code, over the ``default`` entry)."""

    code: str
    sentences: str | None  # pysbd's language, crfcut (Thai: PyThaiNLP), or None: the Unicode sentence rule
    unspaced: bool
    fold_accents: bool
    bm25: str | None  # Anserini's analyzer language, or None: whitespace tokens, lower-cased
    redirect: tuple[str, ...]  # the language's redirect magic words (``#REDIRECT`` is understood everywhere)
    disambiguation_templates: frozenset[str]  # lower-case template names
    disambiguation_suffix: tuple[str, ...]
    list_title: re.Pattern[str] | None
    back_matter: tuple[str, ...]  # lower-case section headings that are not article text
    namespace_aliases: dict[int, tuple[str, ...]]  # namespace key -> names a dump's siteinfo does not list
    abbreviations: frozenset[str]  # words a "." after which does not end a sentence (the Unicode rule)
    scripts: tuple[str, ...]  # the scripts (`script`) its text is written in; () when not known
    stopwords: frozenset[str]  # added to the language's Stopwords ISO list
    dotted_i: bool  # I/ı and İ/i are the case pairs (Turkish, Azerbaijani): title case i -> İ, TF-IDF I -> ı
    link_trail: re.Pattern[str] | None  # letters after a link's ]] that its text takes ([[bus]]es); None: none
    known: bool  # the data names this language (else: the default rules)

    def back_matter_pattern(self) -> str:
        """The headings of sections that are not article text, as a pattern (any of them, "and"-combined)."""
        names = "|".join(re.escape(n) for n in sorted(set(self.back_matter), key=len, reverse=True))
        return rf"^\s*(({names})(\s*(and|&|и|і|та|và|と|・)\s*)?)+\s*$" if names else r"^(?!)"


@cache
def _data() -> dict:
    text = resources.files("bertknn.core").joinpath("languages.json").read_text(encoding="utf-8")
    return dict(json.loads(text))


def known_languages() -> tuple[str, ...]:
    return tuple(k for k in _data() if not k.startswith("_") and k != "default")


def check_language(code: str) -> str:
    """A language code as the rules and the manifest keep it (``pt-BR`` -> ``pt-br``); ValueError says what to fix."""
    norm = code.strip().lower().replace("_", "-")
    if not _LANGUAGE_CODE.match(norm):
        raise ValueError(f"language {code!r}: give a Wikipedia language code such as en, de, ja, uk or vi")
    return norm


# Country codes and three-letter codes given for a language whose Wikipedia code is another (none of them is a
# Wikipedia's own code)
CODE_MIXUPS = {"jp": "ja", "jpn": "ja", "cn": "zh", "zho": "zh", "chi": "zh", "ua": "uk", "ukr": "uk", "vn": "vi",
               "vie": "vi", "gr": "el", "dk": "da", "cz": "cs", "iw": "he", "eng": "en", "ger": "de", "deu": "de",
               "fra": "fr", "fre": "fr", "spa": "es", "rus": "ru"}  # fmt: skip


def corpus_language_code(code: str) -> str:
    """`check_language` for the language a user names for a corpus; ValueError for a known mix-up (``jp``: a
    country's code, Wikipedia's for Japanese is ``ja``), which no Wikipedia uses and would build with no rules."""
    norm = check_language(code)
    if norm in CODE_MIXUPS:
        raise ValueError(f"{code!r} is not a Wikipedia language code; the code of the language it stands for is "
                         f"{CODE_MIXUPS[norm]!r}")  # fmt: skip
    return norm


def unknown_language(code: str, sentence_rule: str, stopwords: frozenset[str]) -> str | None:
    """A build's warning for a language that nothing here knows (no rules of its own, no stopword list, only the
    Unicode sentence rule, ``sentence_rule`` "unicode"): what that means for the datastore. None for a language
    with any of them."""
    code = check_language(code)
    if sentence_rule != "unicode" or stopwords or code in _data() or code.split("-", 1)[0] in _data():
        return None
    return (f"language {code!r} has no rules here: no stopword list (every word becomes a target) and the Unicode "
            "sentence rule; check --language (the Wikipedia code of the corpus's language)")


@cache
def rules_for(code: str) -> LanguageRules:
    """The rules of a language (``ja``, ``pt-br``: the entry for the code, else for its base ``pt``, else default)."""
    code = check_language(code)
    data = _data()
    entry = data.get(code) or data.get(code.split("-", 1)[0])
    merged = {**data["default"], **(entry or {})}
    pattern = merged["list_title"]
    return LanguageRules(
        code=code,
        sentences=merged["sentences"],
        unspaced=bool(merged["unspaced"]),
        fold_accents=bool(merged["fold_accents"]),
        bm25=merged["bm25"],
        redirect=tuple(merged["redirect"]),
        disambiguation_templates=frozenset(t.lower() for t in merged["disambiguation_templates"]),
        disambiguation_suffix=tuple(merged["disambiguation_suffix"]),
        list_title=re.compile(pattern) if pattern else None,
        back_matter=tuple(s.lower() for s in merged["back_matter"]),
        namespace_aliases={int(k): tuple(v) for k, v in merged["namespace_aliases"].items()},
        abbreviations=frozenset(merged["abbreviations"]),
        scripts=tuple(merged["scripts"]),
        stopwords=frozenset(merged["stopwords"]),
        dotted_i=bool(merged["dotted_i"]),
        link_trail=re.compile(f"[{merged['link_trail']}]+") if merged["link_trail"] else None,
        known=entry is not None,
    )


_BREAKERS = threading.local()


def word_breaker() -> str:
    """How unspaced text is cut into words: ``icu`` (ICU's dictionary word break iterator, from the
    ``pyicu-wheels`` package) where installed, else ``tokens`` (each of the tokenizer's tokens is a word)."""
    try:
        import icu  # noqa: F401
    except ImportError:
        return "tokens"
    return "icu"


def word_boundaries(text: str) -> frozenset[int] | None:
    """The character offsets where ICU's word break iterator (root locale: dictionaries for Chinese, Japanese,
    Thai, Lao, Khmer, Burmese) puts a word boundary; None where ICU is not installed."""
    breaker = getattr(_BREAKERS, "it", None)
    if breaker is None:
        try:
            import icu
        except ImportError:
            return None
        breaker = _BREAKERS.it = icu.BreakIterator.createWordInstance(icu.Locale.getRoot())
    breaker.setText(text)
    if not any(ord(ch) > 0xFFFF for ch in text):
        return frozenset(breaker)
    # ICU counts UTF-16 code units: map them back to Python's code points (characters outside the BMP)
    units = [0]
    for ch in text:
        units.append(units[-1] + (2 if ord(ch) > 0xFFFF else 1))
    at = {u: i for i, u in enumerate(units)}
    return frozenset(at[u] for u in breaker if u in at)


def script_warning(text: str, language: str) -> str | None:
    """A warning for a question written mostly in a script that the datastore's language is not written in (a
    Japanese question to an English datastore), or None. Languages whose scripts the data does not name: None."""
    expected = rules_for(language).scripts
    if not expected or (expected == ("LATIN",) and text.isascii()):
        return None
    counts = scripts(text)
    if not counts:
        return None
    main = max(counts, key=lambda k: counts[k])
    if main in expected or counts[main] < 2:
        return None
    return (
        f"the question is written in {_shown(main)} script, but this datastore's language is {language!r} "
        f"({', '.join(map(_shown, expected))}); its answers come from text in another language"
    )


def _shown(script_name: str) -> str:
    return "CJK" if script_name == "CJK" else script_name.title()
