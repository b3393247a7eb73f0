"""Sentences of an article's text in its language: pysbd's rules where pysbd knows the language, else the Unicode
rule (`UnicodeSentences`)."""

from __future__ import annotations

import re

import pysbd
import pysbd.languages

from bertknn.core.languages import LanguageRules, rules_for

# sentence terminals that end a sentence wherever they stand: the full-width forms of CJK text, and the marks
# that end nothing else (Khmer's khan, Burmese's section mark, Ethiopic's full stop)
_FULL_STOPS = "。！？｡។။።"
# terminals that end a sentence before a space and a sentence start (Latin, Cyrillic, Greek, Arabic, Indic...)
_STOPS = ".!?…‼‽⁇⁈⁉؟।॥։"
_CLOSERS = "\"'”’»」』）)]】〕〉》›"
_BOUNDARY = re.compile(
    rf"(?P<full>[{_FULL_STOPS}]+[{re.escape(_CLOSERS)}]*)"
    rf"|(?P<stop>[{re.escape(_STOPS)}]+[{re.escape(_CLOSERS)}]*)(?=\s+(?P<next>\S))"
)
_LAST_WORD = re.compile(r"(\w+)\W*$")


class UnicodeSentences:
    """Sentence ends for languages pysbd does not know: a full-width stop (``。``) ends a sentence wherever it
    stands; ``.``, ``!``, ``?`` end one before a space and a word that does not start in lower case, unless the
    word before the stop is a single letter (an initial), a number or one of the language's abbreviations."""

    def __init__(self, abbreviations: frozenset[str] = frozenset()):
        self.abbreviations = frozenset(a.casefold() for a in abbreviations)

    def _ends_here(self, text: str, m: re.Match[str]) -> bool:
        if m.group("full"):
            return True
        nxt = m.group("next")
        if nxt.islower():
            return False
        if m.group("stop").startswith(".") and len(m.group("stop").rstrip(_CLOSERS)) == 1:
            last = _LAST_WORD.search(text, 0, m.start())
            word = last.group(1) if last and last.end() == m.start() else ""
            if len(word) == 1 or word.isdigit() or word.casefold() in self.abbreviations:
                return False
        return True

    def segment(self, text: str) -> list[str]:
        out, start = [], 0
        for m in _BOUNDARY.finditer(text):
            if self._ends_here(text, m):
                out.append(text[start : m.end()])
                start = m.end()
        out.append(text[start:])
        return [s for s in out if s.strip()]


class SentenceSplitter:
    """Each paragraph of an article split into sentences by its language's rules (pysbd's where it has them:
    abbreviations, decimals, initials; else `UnicodeSentences`)."""

    def __init__(self, language: str | LanguageRules = "en"):
        rules = rules_for(language) if isinstance(language, str) else language
        known = rules.sentences in pysbd.languages.LANGUAGE_CODES
        self._seg = (
            pysbd.Segmenter(language=rules.sentences, clean=False) if known else UnicodeSentences(rules.abbreviations)
        )
        self.rule = f"pysbd:{rules.sentences}" if known else "unicode"

    def split(self, text: str) -> list[str]:
        out = []
        for para in text.split("\n"):
            if not para.strip():
                continue
            for s in self._seg.segment(para):
                s = s.strip()
                if s:
                    out.append(s)
        return out
