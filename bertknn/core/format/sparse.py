"""The sparse indexes' part of the format: their file names and the text -> n-gram hashing both sides share.

The formats themselves are documented in ``bertknn.builder.sparse_index``, which writes them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.feature_extraction.text import HashingVectorizer
from sklearn.utils import murmurhash3_32

from bertknn.core.errors import SparseIndexError
from bertknn.core.text import fold_text, is_punctuation

SPARSE_FORMAT_VERSION = 2  # 2: TF-IDF postings and titles as plain arrays, memory-mapped by the reader
BM25_META = "bertknn-bm25.json"
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
_TOKEN = re.compile(TOKEN_PATTERN)


@dataclass(frozen=True)
class NgramHasher:
    """DrQA's n-gram features, hashed into ``n_features`` buckets: the one definition builder and service share."""

    stopwords: frozenset[str]
    ngram: int = 2
    n_features: int = N_FEATURES

    def ngrams(self, text: str) -> list[str]:
        """Folded unigrams..``ngram``-grams of ``text``, without those made only of stopwords and punctuation."""
        tokens = _TOKEN.findall(fold_text(text))
        skip = [t in self.stopwords or is_punctuation(t) for t in tokens]
        grams = [t for t, s in zip(tokens, skip, strict=True) if not s]
        for n in range(2, self.ngram + 1):
            grams.extend(
                " ".join(tokens[i : i + n]) for i in range(len(tokens) - n + 1) if not all(skip[i : i + n])
            )
        return grams

    @cached_property
    def _vectorizer(self) -> HashingVectorizer:
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
        vectorizer: the same murmurhash3 and bucket rule, without its per-call set-up
        (docs/decisions/tfidf-query-hashing.md). A query's n-grams are a few dozen."""
        grams = self.ngrams(text)
        if not grams:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        h = np.fromiter((murmurhash3_32(g, seed=0) for g in grams), np.int64, len(grams))
        n = self.n_features
        # HashingVectorizer's rule: abs(h) % n, with abs(-2**31) (undefined in C) given its own bucket
        buckets = np.where(h == -(2**31), (2**31 - 1 - (n - 1)) % n, np.abs(h) % n)
        found, counts = np.unique(buckets, return_counts=True)
        return found.astype(np.int64), counts.astype(np.float32)

    def to_params(self) -> dict[str, object]:
        return {
            "n_features": self.n_features,
            "ngram": self.ngram,
            "stopwords": sorted(self.stopwords),
            "token_pattern": TOKEN_PATTERN,
            "fold": FOLD,
        }

    @classmethod
    def from_params(cls, params: dict, where: Path) -> NgramHasher:
        """The hasher an index was built with; refuses an index whose text processing this code does not do."""
        if params.get("token_pattern") != TOKEN_PATTERN or params.get("fold") != FOLD:
            raise SparseIndexError(
                f"{where}: built with another tokenisation ({params.get('token_pattern')!r}, {params.get('fold')!r}); "
                "rebuild the datastore's sparse indexes with this version of the builder"
            )
        return cls(frozenset(params["stopwords"]), int(params["ngram"]), int(params["n_features"]))


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
