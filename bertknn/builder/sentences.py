"""Sentences of an article's text in its language: pysbd's rules where pysbd knows the language, PyThaiNLP's CRF
segmenter for Thai (`ThaiSentences`), else the Unicode rule (`UnicodeSentences`)."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pysbd
import pysbd.languages

from bertknn.core.errors import BuildError
from bertknn.core.languages import LanguageRules, rules_for
from bertknn.core.text import NOT_WORD, WORD, unicode_words

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
_LAST_WORD = unicode_words(rf"({WORD}+){NOT_WORD}*$")  # Tamil's ஆகும் is a word, not ஆக and a lone ம


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


# an abbreviation's last dot (พ.ศ., ค.ศ.) and the number after it: the CRF segmenter ends a sentence between them
_THAI_DATED = re.compile(r"[\u0e01-\u0e4e]\.\s*$")


class ThaiSentences:
    """Thai ends a sentence with a space, which is also written between a name and a surname, around numbers and
    between clauses; no mark tells them apart. PyThaiNLP's CRF segmenter (``crfcut``, trained on TED and ORCHID)
    reads the words around each space. A piece that ends in an abbreviation's dot and a piece that starts with
    the number it dates are one sentence."""

    def __init__(self) -> None:
        # PyThaiNLP makes a data folder when imported, under $HOME unless told: a read-only home is not one
        os.environ.setdefault("PYTHAINLP_DATA", str(Path(tempfile.gettempdir()) / "pythainlp-data"))
        try:
            import pythainlp.tokenize.crfcut  # noqa: F401 - python-crfsuite is there too
            from pythainlp.tokenize import sent_tokenize
        except ImportError:
            raise BuildError(
                "Thai text is split into sentences by PyThaiNLP's CRF segmenter, which is not installed: "
                "pip install 'bert-knn[thai]' (pythainlp and python-crfsuite)"
            ) from None
        self._split: Callable[[str], list[str]] = lambda text: cast(list[str], sent_tokenize(text, engine="crfcut"))

    def segment(self, text: str) -> list[str]:
        out: list[str] = []
        for piece in self._split(text):
            if out and piece.strip()[:1].isdigit() and _THAI_DATED.search(out[-1]):
                out[-1] += piece
            elif piece.strip():
                out.append(piece)
        return out


class SentenceSplitter:
    """Each paragraph of an article split into sentences by its language's rules (pysbd's where it has them:
    abbreviations, decimals, initials; `ThaiSentences` for ``crfcut``; else `UnicodeSentences`)."""

    def __init__(self, language: str | LanguageRules = "en"):
        rules = rules_for(language) if isinstance(language, str) else language
        self._seg: pysbd.Segmenter | ThaiSentences | UnicodeSentences
        if rules.sentences in pysbd.languages.LANGUAGE_CODES:
            self._seg, self.rule = pysbd.Segmenter(language=rules.sentences, clean=False), f"pysbd:{rules.sentences}"
        elif rules.sentences == "crfcut":
            self._seg, self.rule = ThaiSentences(), "pythainlp:crfcut"
        else:
            self._seg, self.rule = UnicodeSentences(rules.abbreviations), "unicode"

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
