"""DrQA-style TF-IDF: the n-gram rules, the hashing, and log(1 + tf) * idf on corpora whose answer is known."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from sklearn.utils import murmurhash3_32

from bertknn.builder.sparse_index import default_hasher, drqa_idf, tfidf_tables
from bertknn.core.errors import SparseIndexError
from bertknn.core.format.sparse import N_FEATURES, NgramHasher

STOP = frozenset({"the", "of", "in", "a", "is"})


def bucket(gram: str) -> int:
    return abs(murmurhash3_32(gram, seed=0)) % N_FEATURES


def test_unigrams_and_bigrams_drop_only_all_stopword_or_punctuation_grams() -> None:
    grams = NgramHasher(STOP).ngrams("The Bridge of Plonk, in 1999.")
    # tokens: the bridge of plonk , in 1999 .  (stopwords: the of in; punctuation: , .)
    assert grams == [
        "bridge",
        "plonk",
        "1999",
        "the bridge",
        "bridge of",
        "of plonk",
        "plonk ,",
        # ", in": both skipped -> dropped
        "in 1999",
        "1999 .",
    ]


def test_all_stopword_bigrams_are_dropped_but_mixed_ones_kept() -> None:
    assert NgramHasher(STOP).ngrams("in the city of the sea") == [
        "city",
        "sea",
        "the city",
        "city of",
        "the sea",
    ]


def test_text_is_folded_case_and_accents() -> None:
    hasher = NgramHasher(frozenset(), ngram=1)
    assert hasher.ngrams("Émile ÉMILE emile E\u0301mile") == ["emile"] * 4
    assert hasher.ngrams("Straße") == ["strasse"]


def test_trigrams_when_asked() -> None:
    assert NgramHasher(STOP, ngram=3).ngrams("a b c")[-1:] == ["a b c"]


def test_counts_are_hashed_with_murmurhash3_into_2_pow_24_buckets() -> None:
    counts = NgramHasher(STOP).counts(["plonk plonk", "quimby"])
    assert counts.shape == (2, 2**24)
    row0 = dict(zip(counts[[0]].indices.tolist(), counts[[0]].data.tolist(), strict=True))
    assert row0 == {bucket("plonk"): 2.0, bucket("plonk plonk"): 1.0}
    assert counts[[1]].indices.tolist() == [bucket("quimby")]


def test_drqa_idf_formula_and_clipping() -> None:
    idf = drqa_idf(np.array([1, 2, 3, 4]), 4)
    assert idf[0] == pytest.approx(math.log(3.5 / 1.5))
    assert idf[1] == 0.0  # log(2.5 / 2.5)
    assert idf[2] == 0.0 and idf[3] == 0.0  # negative, clipped
    assert idf.dtype == np.float32


def test_tables_hold_log1p_tf_times_idf_per_bucket_and_document() -> None:
    hasher = NgramHasher(frozenset(), ngram=1)
    docs = ["apple apple banana", "banana cherry", "cherry", "durian durian durian"]
    tables = tfidf_tables(hasher.counts(docs))
    # df: apple 1, banana 2, cherry 2, durian 1 (N = 4)
    expected_buckets = sorted(bucket(w) for w in ("apple", "banana", "cherry", "durian"))
    assert tables.buckets.tolist() == expected_buckets
    assert tables.postings.shape == (4, 4)
    idf_rare = math.log(3.5 / 1.5)

    def row(word: str) -> dict[int, float]:
        i = int(np.searchsorted(tables.buckets, bucket(word)))
        r = tables.postings[[i]]
        return dict(zip(r.indices.tolist(), r.data.tolist(), strict=True))

    assert row("apple") == pytest.approx({0: math.log(3) * idf_rare})
    assert row("durian") == pytest.approx({3: math.log(4) * idf_rare})
    assert row("banana") == {} and row("cherry") == {}  # idf 0: in half of the documents
    assert tables.idf[np.searchsorted(tables.buckets, bucket("apple"))] == pytest.approx(idf_rare)


def test_query_scores_are_the_dot_product_with_the_query_weights() -> None:
    """The retriever's scoring, by hand: q = log(1 + tf_q) * idf, score(d) = q . d."""
    hasher = NgramHasher(frozenset(), ngram=1)
    docs = ["apple pie", "apple", "pie", "kiwi", "lime", "plum"]
    tables = tfidf_tables(hasher.counts(docs))
    q = hasher.counts(["apple apple pie"])
    rows = np.searchsorted(tables.buckets, q.indices)
    weights = np.log1p(q.data) * tables.idf[rows]
    scores = weights @ tables.postings[rows].toarray()
    idf = math.log((6 - 2 + 0.5) / (2 + 0.5))  # apple and pie: df 2 of 6
    assert scores[0] == pytest.approx(
        math.log(3) * idf * math.log(2) * idf + math.log(2) * idf * math.log(2) * idf
    )
    assert scores[1] == pytest.approx(math.log(3) * idf * math.log(2) * idf)
    assert scores[2] == pytest.approx(math.log(2) * idf * math.log(2) * idf)
    assert scores[3:].tolist() == [0.0, 0.0, 0.0]


def test_params_round_trip_and_the_bundled_stopwords() -> None:
    hasher = default_hasher()
    assert "the" in hasher.stopwords and hasher.n_features == 2**24 and hasher.ngram == 2
    assert NgramHasher.from_params(hasher.to_params(), Path("params.json")) == hasher


def test_params_of_another_tokenisation_are_refused() -> None:
    params = {**default_hasher().to_params(), "token_pattern": r"\S+"}
    with pytest.raises(SparseIndexError, match="rebuild"):
        NgramHasher.from_params(params, Path("params.json"))


@pytest.mark.parametrize("n_features", [N_FEATURES, 7])
def test_query_counts_equal_the_vectorizers_counts(n_features: int) -> None:
    """The service hashes a query without the vectorizer (`query_counts`): the same buckets and counts as the
    builder's `counts`, on real questions, accents, scripts, repeats, and texts with no n-gram at all."""
    import json

    lama = Path(__file__).resolve().parents[3] / "shared" / "data" / "lama" / "TREx" / "P19.jsonl"
    texts = [json.loads(line)["sub_label"] + " was born in [MASK] ." for line in lama.read_text().splitlines()[:200]]
    texts += ["", "the of in", ". , ;", "Café café CAFÉ cafe", "東京は日本の首都である。", "Київ — столиця України",
              "plonk plonk plonk quimby plonk", "Hà Nội là thủ đô của Việt Nam"]  # fmt: skip
    hasher = NgramHasher(STOP, n_features=n_features)
    for text in texts:
        want = hasher.counts([text])
        buckets, counts = hasher.query_counts(text)
        assert buckets.tolist() == want.indices.tolist(), text
        assert counts.tolist() == want.data.tolist(), text


def test_the_service_never_imports_scikit_learn() -> None:
    """Its queries are hashed with mmh3 (`NgramHasher.query_counts`): scikit-learn's import stays the builder's."""
    import subprocess
    import sys

    code = "import sys, bertknn.service.main; print(sorted(m for m in sys.modules if m.split('.')[0] == 'sklearn'))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert run.stdout.strip() == "[]"
