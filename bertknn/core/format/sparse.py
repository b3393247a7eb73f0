"""The sparse indexes' part of the format: their file names and the text -> n-gram hashing both sides share.

The formats themselves are documented in ``bertknn.builder.sparse_index``, which writes them.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import mmh3
import numpy as np
import scipy.sparse as sp

from bertknn.core.errors import SparseIndexError
from bertknn.core.languages import UNSPACED_CLASS, is_unspaced_char
from bertknn.core.text import WORD, dotted_i_as_i, fold_text, is_punctuation, unicode_words
from bertknn.core.titles import strip_latin_accents

if TYPE_CHECKING:
    from sklearn.feature_extraction.text import HashingVectorizer

SPARSE_FORMAT_VERSION = 2  # 2: TF-IDF postings and titles as plain arrays, memory-mapped by the reader
BM25_META = "bertknn-bm25.json"
# the languages Anserini 0.25 has an analyzer for (IndexCollection -language; LuceneSearcher.set_language)
ANSERINI_LANGUAGES = frozenset({"ar", "bn", "da", "de", "es", "fa", "fi", "fr", "hi", "hu", "id", "it", "ja", "ko", "nl",
                                "no", "pl", "pt", "ru", "sv", "te", "th", "tr", "uk", "zh"})  # fmt: skip
PRETOKENIZED = "pretokenized"  # BM25 over the TF-IDF terms, whitespace-separated, for a language without one
TFIDF_PARAMS = "params.json"
TFIDF_TITLES = "titles.txt"  # UTF-8 titles, concatenated; title_offsets.npy holds their byte offsets
TFIDF_TITLE_OFFSETS = "title_offsets.npy"
TFIDF_BUCKETS = "buckets.npy"
TFIDF_IDF = "idf.npy"
TFIDF_INDPTR = "postings_indptr.npy"  # the CSR postings [n_buckets, n_docs] as its three arrays
TFIDF_INDICES = "postings_indices.npy"
TFIDF_DATA = "postings_data.npy"
TFIDF_FILES = (TFIDF_TITLES, TFIDF_TITLE_OFFSETS, TFIDF_BUCKETS, TFIDF_IDF, TFIDF_INDPTR, TFIDF_INDICES, TFIDF_DATA)
TFIDF_V1_POSTINGS = "postings.npz"  # version 1 (scipy's save_npz, loaded whole); `upgrade` converts it
N_FEATURES = 2**24
TOKEN_PATTERN = r"\w+|[^\w\s]"
FOLD = "NFKD, combining marks removed, casefold"
# every language but English: accents stay (Latin ones dropped only where the language's rules say so), and a run
# of an unspaced script (Japanese, Chinese, Thai) is cut into overlapping character bigrams, as Lucene's CJK analyzer
FOLD_KEEP = "NFKC, casefold"
FOLD_LATIN = "NFKC, accents of Latin letters removed, casefold"
# Turkish and Azerbaijani: I and ı, İ and i are the case pairs (Lucene's TurkishLowerCaseFilter)
FOLD_TURKIC = "NFKC, I as ı and İ as i, casefold"
UNSPACED_TOKENS = "character bigrams of unspaced-script runs"
# A non-English word's characters are Unicode's (`unicode_words`: its marks and joiners stay in it), and İ folds to
# i, not to i and a lone combining dot. An index built before this rule records `WORDS_RE` and is read with it.
WORDS_UNICODE = "words: Unicode's word characters (marks and joiners kept), İ folded to i"
WORDS_RE = "words: Python re's word characters"
_TOKEN = re.compile(TOKEN_PATTERN)
_UNSPACED = UNSPACED_CLASS
_I18N_PATTERN = f"[{_UNSPACED}]+|(?:(?![{_UNSPACED}]){WORD})+|[^\\w\\p{{No}}\\s]"
_I18N_PATTERN_RE = f"[{_UNSPACED}]+|(?:(?![{_UNSPACED}])\\w)+|[^\\w\\s]"  # an index's of before `WORDS_UNICODE`
_TOKEN_I18N = {WORDS_UNICODE: unicode_words(_I18N_PATTERN), WORDS_RE: re.compile(_I18N_PATTERN_RE)}


def i18n_token_pattern(words: str) -> str:
    """What an index records as its non-English tokenisation (``token_pattern``), for `WORDS_UNICODE` or the
    `WORDS_RE` of indexes built before it."""
    if words == WORDS_RE:
        return f"{_I18N_PATTERN_RE}; {UNSPACED_TOKENS}"
    return f"{_I18N_PATTERN}; {UNSPACED_TOKENS}; {words}"


def _fold(text: str, fold: str, words: str) -> str:
    if fold == FOLD_TURKIC:
        text = dotted_i_as_i(text.replace("I", "ı"))
    elif words == WORDS_UNICODE:
        text = dotted_i_as_i(text)
    return unicodedata.normalize("NFKC", strip_latin_accents(text) if fold == FOLD_LATIN else text).casefold()


def language_terms(text: str, fold: str, words: str = WORDS_UNICODE) -> list[str]:
    """A non-English text's terms: folded words, each unspaced-script run as its character bigrams (a lone
    character as itself), punctuation as its own tokens."""
    out: list[str] = []
    for tok in _TOKEN_I18N[words].findall(_fold(text, fold, words)):
        if is_unspaced_char(tok[0]):
            out.extend([tok] if len(tok) == 1 else [tok[i : i + 2] for i in range(len(tok) - 1)])
        else:
            out.append(tok)
    return out


@dataclass(frozen=True)
class NgramHasher:
    """DrQA's n-gram features, hashed into ``n_features`` buckets: the one definition builder and service share.
    ``language``: English tokenises with `TOKEN_PATTERN` and `FOLD`; any other with `language_terms`, its words
    as ``words`` says (`WORDS_UNICODE`; an index built before it, `WORDS_RE`)."""

    stopwords: frozenset[str]
    ngram: int = 2
    n_features: int = N_FEATURES
    language: str = "en"
    fold: str = FOLD
    words: str = WORDS_UNICODE

    @staticmethod
    def for_language(
        language: str, stopwords: frozenset[str], fold_accents: bool, dotted_i: bool = False
    ) -> NgramHasher:
        """A new index's hasher: ``fold_accents`` and ``dotted_i`` as the language's rules say."""
        if language == "en":
            return NgramHasher(stopwords)
        fold = FOLD_TURKIC if dotted_i else FOLD_LATIN if fold_accents else FOLD_KEEP
        return NgramHasher(stopwords, language=language, fold=fold)

    def terms(self, text: str) -> list[str]:
        """The text's tokens as TF-IDF (and a pre-tokenised BM25) sees them."""
        if self.language == "en":
            return _TOKEN.findall(fold_text(text))
        return language_terms(text, self.fold, self.words)

    def ngrams(self, text: str) -> list[str]:
        """Folded unigrams..``ngram``-grams of ``text``, without those made only of stopwords and punctuation."""
        tokens = self.terms(text)
        skip = [t in self.stopwords or is_punctuation(t) for t in tokens]
        grams = [t for t, s in zip(tokens, skip, strict=True) if not s]
        for n in range(2, self.ngram + 1):
            grams.extend(
                " ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1) if not all(skip[i : i + n])
            )
        return grams

    @cached_property
    def _vectorizer(self) -> HashingVectorizer:
        # (imported here: the builder's alone; the service hashes its queries without scikit-learn)
        from sklearn.feature_extraction.text import HashingVectorizer

        return HashingVectorizer(
            analyzer=self.ngrams,
            n_features=self.n_features,
            alternate_sign=False,
            norm=None,
            dtype=np.float32,
        )

    def counts(self, texts: Iterable[str]) -> sp.csr_array:
        """Raw n-gram counts, documents x buckets (CSR, float32, duplicates summed, indices sorted)."""
        m = sp.csr_array(self._vectorizer.transform(texts))
        m.sum_duplicates()
        return m

    def query_counts(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """`counts` of one text as (buckets ascending int64, counts float32), hashed here instead of through the
        vectorizer: the same murmurhash3 (x86, 32 bits, seed 0, signed, over the UTF-8 bytes: mmh3's, which is
        scikit-learn's ``murmurhash3_32``) and bucket rule, without its per-call set-up, and without importing
        scikit-learn in the service (docs/decisions/tfidf-query-hashing.md). A query's n-grams are a few dozen."""
        n = self.n_features
        odd = (2**31 - 1 - (n - 1)) % n  # HashingVectorizer's rule: abs(h) % n, abs(-2**31) (undefined in C) here
        # a few dozen n-grams: counted in Python, where numpy's per-call cost would be most of the work
        counts = Counter(odd if (h := mmh3.hash(g, 0, signed=True)) == -(2**31) else abs(h) % n
                         for g in self.ngrams(text))  # fmt: skip
        found = sorted(counts)
        return np.array(found, np.int64), np.array([counts[b] for b in found], np.float32)

    def to_params(self) -> dict[str, object]:
        english = self.language == "en"
        return {
            "n_features": self.n_features,
            "ngram": self.ngram,
            "stopwords": sorted(self.stopwords),
            "token_pattern": TOKEN_PATTERN if english else i18n_token_pattern(self.words),
            "fold": self.fold,
            **({} if english else {"language": self.language}),
        }

    @classmethod
    def from_params(cls, params: dict, where: Path) -> NgramHasher:
        """The hasher an index was built with; refuses an index whose text processing this code does not do."""
        language = str(params.get("language", "en"))
        # each tokenisation this code reads: (token_pattern, words) -> the folds it may have been built with
        known = {(TOKEN_PATTERN, WORDS_UNICODE): (FOLD,)} if language == "en" else {
            (i18n_token_pattern(WORDS_UNICODE), WORDS_UNICODE): (FOLD_KEEP, FOLD_LATIN, FOLD_TURKIC),
            (i18n_token_pattern(WORDS_RE), WORDS_RE): (FOLD_KEEP, FOLD_LATIN),
        }
        found = [w for (pattern, w), folds in known.items()
                 if params.get("token_pattern") == pattern and params.get("fold") in folds]  # fmt: skip
        if not found:
            raise SparseIndexError(
                f"{where}: built with another tokenisation ({params.get('token_pattern')!r}, {params.get('fold')!r}); "
                "rebuild the datastore's sparse indexes with this version of the builder"
            )
        return cls(frozenset(params["stopwords"]), int(params["ngram"]), int(params["n_features"]), language,
                   str(params["fold"]), found[0])  # fmt: skip


def write_tfidf_arrays(directory: Path, titles: list[str], postings: sp.csr_array) -> None:
    """Titles and the CSR postings as the plain files of version 2 (every one memory-mappable)."""
    from bertknn.core.format.files import save_npy

    encoded = [t.encode("utf-8") for t in titles]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    (directory / TFIDF_TITLES).write_bytes(b"".join(encoded))
    save_npy(directory / TFIDF_TITLE_OFFSETS, offsets)
    csr = sp.csr_array(postings)
    save_npy(directory / TFIDF_INDPTR, csr.indptr.astype(np.int64, copy=False))
    save_npy(directory / TFIDF_INDICES, csr.indices.astype(np.int32, copy=False))
    save_npy(directory / TFIDF_DATA, csr.data.astype(np.float32, copy=False))
