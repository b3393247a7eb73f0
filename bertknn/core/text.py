"""Text rules both sides share: the ``[MASK]`` marker in any case or spacing, the retrieval text, punctuation,
Unicode's word characters."""

from __future__ import annotations

import re
import unicodedata

import regex

# A question's blank: ``[MASK]`` (BERT's spelling) or ``<mask>`` (RoBERTa's), in any case or spacing, whatever the
# model: a caller need not know which family a datastore was built with
MASK_RE = re.compile(r"\[\s*mask\s*\]|<\s*mask\s*>", re.IGNORECASE)
_SPACES = re.compile(r"\s+")


# A word character (a `regex` pattern, `unicode_words`): Unicode's (TR #18: letters, combining marks, digits,
# connector punctuation, the zero-width joiners), and the other numbers (², ½) that Python's re counts too
WORD = r"[\w\p{No}]"
NOT_WORD = r"[^\w\p{No}]"


def unicode_words(pattern: str) -> regex.Pattern[str]:
    """``pattern`` compiled so that ``\\w`` is a word character as Unicode defines it (TR #18, the `regex`
    module's): letters, combining marks, digits, connector punctuation and the zero-width joiners (`WORD` adds
    the other numbers, ``km²``). Python's `re` leaves the marks out, and so cuts a Hindi, Bengali or Tamil word at
    each vowel sign and virama (``जन्म`` as ``जन``, ``्``, ``म``) and a Persian one at its non-joiner. The fragment
    and sentence rules and non-English TF-IDF terms use this; English TF-IDF keeps the pattern its indexes record."""
    return regex.compile(pattern)


def dotted_i_as_i(text: str) -> str:
    """İ as i, before a case fold: ``casefold`` makes it i and a combining dot above, which no word written in
    lower case has (``#YÖNLENDİRME`` folds as ``#yönlendirme``, ``İzmir`` as ``izmir``)."""
    return text.replace("İ", "i")


def retrieval_text(text: str) -> str:
    """Query text for the sparse retrievers: the cloze question without ``[MASK]``, whitespace collapsed."""
    return _SPACES.sub(" ", MASK_RE.sub(" ", text)).strip()


def is_punctuation(word: str) -> bool:
    """True when a word has no letter or digit (``"."``, ``"--"``, ``"%"``)."""
    return not any(unicodedata.category(ch)[0] in "LN" for ch in word)


def is_word_break(piece: str) -> bool:
    """True when a token's text is punctuation that ends a word, as BERT's pre-tokenizer splits it: ASCII
    characters other than letters and digits, and Unicode punctuation (``.``, ``,``, ``«``). Symbols such as ``°``
    stay inside a word (``1°c``), as they do for BERT."""
    return bool(piece) and all(
        (ch.isascii() and not ch.isalnum()) or unicodedata.category(ch).startswith("P") for ch in piece
    )


def fold_text(text: str) -> str:
    """Case- and accent-insensitive form of a text, as both TF-IDF sides see it."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(ch for ch in decomposed if not unicodedata.combining(ch)).casefold()
