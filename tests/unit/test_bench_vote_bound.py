"""bench.vote_bound: each candidate's features, the default answer it starts from, and the search for the best
vote (checked against cases whose best vote is known)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bench.realtext import Fact
from bench.vote_bound import (
    ALL_FEATURES,
    FEATURES,
    Candidates,
    Question,
    Searched,
    best_vote,
    candidates,
    fit_likelihood,
    macro_p1,
    votes,
)
from bertknn.service.interpolate import DEFAULT_MLM_PRIOR, knn_sparse, weigh_vote

VOCAB = ["[PAD]", "[MASK]", "paris", "france", "1879", "ulm", "einstein", "born", "."]
NON_WORDS = np.array([True, True, False, False, False, False, False, False, True])
STOP = frozenset({"was", "in", "the"})


def _fact(gold: int, relation: str = "P19") -> Fact:
    obj = VOCAB[gold] if gold < len(VOCAB) else f"word{gold}"
    return Fact(relation, "Albert Einstein", obj, "albert einstein was born in [MASK] .", gold, "dev")


def _question(p_mlm: np.ndarray | None = None) -> Question:
    # rows: ulm twice (sentence 0 and 1), 1879 once, einstein once, paris once (a second article)
    vectors = np.array([[0.0, 0.0], [0.5, 0.0], [1.0, 0.0], [2.0, 0.0], [3.0, 0.0]], np.float32)
    labels = np.array([5, 5, 4, 6, 2], np.int32)
    texts = ["einstein was born in ulm .", "ulm lies on the danube .", "he was born in 1879 .", "einstein .", "paris ."]
    first = np.array([True, False, False, False, True])  # each row's sentence is its article's first, or not
    rows = Searched(vectors, labels, first, texts, np.array([0, 0, 0, 0, 1]))
    if p_mlm is None:
        p_mlm = np.full(len(VOCAB), 0.05)
        p_mlm[2] = 0.6  # p_MLM prefers paris
    return Question(_fact(5), np.array([0.1, 0.0], np.float32), p_mlm / p_mlm.sum(), rows, [2.0, 1.0],
                    {"albert", "einstein"}, {"born"})  # fmt: skip


def test_the_votes_are_the_services_own() -> None:
    q = _question()
    vote, d, t = votes(q, k=128, temperature_of=lambda dn: 1.0)
    assert d.tolist() == pytest.approx([0.01, 0.16, 0.81, 3.61, 8.41])
    ids, probs = knn_sparse(d, q.rows.labels, 1.0)
    assert vote["paper"] == pytest.approx(dict(zip(ids.tolist(), probs.tolist(), strict=True)))
    ids2, probs2 = knn_sparse(d, q.rows.labels, 2.0)
    assert vote["paper_2t"] == pytest.approx(dict(zip(ids2.tolist(), probs2.tolist(), strict=True)))
    # the default vote: lower-ranked articles' rows count less (paris's article scores half the top), then p_MLM
    assert vote["default"][2] < vote["paper"][2]
    assert sum(vote["default"].values()) == pytest.approx(1.0, abs=1e-6)
    offsets = np.array([0.0, 0.0, 0.0, 0.0, -5.0])
    ids3, probs3 = knn_sparse(d, q.rows.labels, 1.0, offsets)
    weighted = weigh_vote(probs3, q.p_mlm[ids3], DEFAULT_MLM_PRIOR)
    assert vote["default"] == pytest.approx(dict(zip(ids3.tolist(), weighted.tolist(), strict=True)))


def test_every_voted_word_is_a_candidate_and_the_default_answer_comes_first() -> None:
    q = _question()
    c = candidates(q, k=128, lam=0.3, top=2, temperature_of=lambda dn: 1.0, vocab=VOCAB, non_words=NON_WORDS,
                   stopwords=STOP)  # fmt: skip
    assert set(c.words.tolist()) == {2, 3, 4, 5, 6}  # the four voted words, and p_MLM's top two (paris, france)
    assert not NON_WORDS[c.words].any()
    assert c.features.shape == (5, len(ALL_FEATURES))
    # the default answer: argmax of 0.7 p_MLM + 0.3 weighted vote over the words; p_MLM's 0.6 on paris wins here
    assert c.words[c.default] == 2
    q_knn = _question(np.full(len(VOCAB), 0.1))  # a flat p_MLM: the neighbours decide, ulm
    c2 = candidates(q_knn, k=128, lam=0.3, top=2, temperature_of=lambda dn: 1.0, vocab=VOCAB, non_words=NON_WORDS,
                    stopwords=STOP)  # fmt: skip
    assert c2.words[c2.default] == 5


def test_a_candidates_features_describe_its_contexts() -> None:
    q = _question()
    c = candidates(q, k=128, lam=0.3, top=2, temperature_of=lambda dn: 1.0, vocab=VOCAB, non_words=NON_WORDS,
                   stopwords=STOP)  # fmt: skip
    feats = {VOCAB[w]: dict(zip(ALL_FEATURES, row, strict=True)) for w, row in zip(c.words, c.features, strict=True)}
    ulm, year, einstein, france = feats["ulm"], feats["1879"], feats["einstein"], feats["france"]
    assert ulm["log_contexts"] == pytest.approx(np.log(3)) and year["log_contexts"] == pytest.approx(np.log(2))
    assert ulm["nearest"] == 0.0 and year["nearest"] == pytest.approx(-0.8)  # (0.81 - 0.01) / temperature 1
    assert ulm["shared_words"] == 1.0  # "born", in its nearest context's sentence
    assert ulm["first_sentence"] == 1.0 and year["first_sentence"] == 0.0
    assert year["number"] == 1.0 and ulm["number"] == 0.0
    assert einstein["subject_word"] == 1.0 and ulm["subject_word"] == 0.0
    assert ulm["cosine"] == pytest.approx(1.0)
    # a word no context carries (p_MLM's second choice): no vote, the farthest distance, no context
    assert france["log_contexts"] == 0.0 and france["nearest"] == -10.0 and france["cosine"] == 0.0
    assert france["log_p_knn"] == pytest.approx(np.log(1e-6))


def _synthetic(n: int, seed: int = 0) -> list[Candidates]:
    """Facts of two relations, 4 candidates each; the gold is the one whose feature "cosine" is highest, while
    the default vote (candidate 0) is right for a third of them."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        x = rng.normal(size=(4, len(ALL_FEATURES)))
        gold = 0 if i % 3 == 0 else int(rng.integers(1, 4))
        x[:, ALL_FEATURES.index("cosine")] = rng.uniform(0, 1, size=4)
        x[gold, ALL_FEATURES.index("cosine")] = 2.0
        x[:, FEATURES.index("log_p_knn_weighted")] = [1.0, 0.0, 0.0, 0.0]
        out.append(Candidates(_fact(10 + gold, "P1" if i % 2 else "P2"), np.arange(10, 14), x, 0))
    return out


def test_macro_p1_averages_relations_and_reads_the_default_without_weights() -> None:
    cands = _synthetic(60)
    default = macro_p1(cands)
    assert default == pytest.approx(100 * np.mean([c.fact.gold == 10 for c in cands]), abs=5)  # a third, per relation
    w = np.zeros(len(FEATURES))
    w[FEATURES.index("log_p_knn_weighted")] = 1.0
    assert macro_p1(cands, w) == default  # the weighted vote alone picks candidate 0
    w_cos = np.zeros(len(FEATURES))
    w_cos[FEATURES.index("cosine")] = 1.0
    assert macro_p1(cands, w_cos) == 100.0


def _told_by(kinds: list[str], relation: str = "P1") -> list[Candidates]:
    """Two candidates per fact, the second the gold, told apart by one feature each: ``"+cosine"``, the gold has
    the higher cosine; ``"-cosine"``, the lower; ``"+number"``, the higher benchmark-only "number". Every other
    feature ties, and a tie goes to the first candidate (wrong). So the best macro P@1 of any linear vote is known:
    a vote's sign on cosine serves "+cosine" or "-cosine" facts, never both; only a vote that reads "number" gets
    the "+number" facts."""
    out = []
    for kind in kinds:
        x = np.zeros((2, len(ALL_FEATURES)))
        x[1 if kind[0] == "+" else 0, ALL_FEATURES.index(kind[1:])] = 1.0
        out.append(Candidates(_fact(11, relation), np.array([10, 11]), x, 0))
    return out


@pytest.mark.parametrize(("plus", "minus"), [(40, 20), (20, 40)])
def test_the_solver_finds_the_known_best_vote_and_no_better(plus: int, minus: int) -> None:
    cands = _told_by(["+cosine"] * plus + ["-cosine"] * minus)
    assert macro_p1(cands) == 0.0  # the default (first) candidate is never the gold
    best = best_vote(cands, len(FEATURES))
    assert best.p1 == pytest.approx(round(100 * max(plus, minus) / (plus + minus), 1))  # 66.7: the known optimum
    assert best.optimal and best.upper_bound == best.p1  # proven: no vote scores more
    assert np.sign(best.weights[FEATURES.index("cosine")]) == (1 if plus > minus else -1)  # the larger kind's side


def test_the_solver_weighs_facts_by_their_relation_s_size() -> None:
    # P1: 30 "+cosine" facts; P2: 10 "-cosine" facts. Per fact, P2's count three times as much, but a relation is
    # a relation: either side wins one of two relations, 50.0 macro
    best = best_vote(_told_by(["+cosine"] * 30) + _told_by(["-cosine"] * 10, relation="P2"), len(FEATURES))
    assert best.p1 == 50.0 and best.upper_bound == 50.0


def test_ties_count_where_the_gold_comes_first() -> None:
    tied = [Candidates(_fact(10), np.array([10, 11]), np.zeros((2, len(ALL_FEATURES))), 0)]
    assert best_vote(tied, len(FEATURES)).p1 == 100.0  # gold first: argmax's tie goes to it
    second = [Candidates(_fact(11), np.array([10, 11]), np.zeros((2, len(ALL_FEATURES))), 0)]
    assert best_vote(second, len(FEATURES)).p1 == 0.0 and best_vote(second, len(FEATURES)).upper_bound == 0.0


def test_the_best_over_all_features_reads_the_benchmark_only_ones() -> None:
    from bench.vote_bound import score_setting

    held = score_setting({"heldout": _told_by(["+cosine"] * 30 + ["+number"] * 10)}, time_limit=30)
    x = held["heldout"]
    assert (x["default"], x["gold_among_candidates"]) == (0.0, 100.0)
    assert x["best_general"] == 75.0 and x["upper_bound_general"] == 75.0  # "number" is no general feature
    assert x["best_all"] == 100.0
    assert held["fitted_on_dev"] is None and x["fitted_on_dev"] is None  # no dev split, no fitted vote


def test_the_likelihood_fit_puts_its_weight_on_the_telling_feature() -> None:
    cands = _synthetic(80)
    w = fit_likelihood(cands, len(FEATURES), reg=0.001)
    assert w[FEATURES.index("cosine")] == max(w)
    assert macro_p1(cands, w) == 100.0


def test_a_vote_fitted_on_dev_is_scored_on_test() -> None:
    from bench.vote_bound import score_setting

    both = score_setting({"dev": _synthetic(40), "test": _synthetic(40, seed=3)}, time_limit=30)
    assert set(both["fitted_on_dev"]) == set(FEATURES) and both["test"]["fitted_on_dev"] == 100.0
    flipped = _told_by(["-cosine"] * 20)  # a test split where the dev split's telling feature points the other way
    other = score_setting({"dev": _synthetic(40), "test": flipped}, time_limit=30)
    assert other["test"]["fitted_on_dev"] == 0.0 and other["test"]["best_general"] == 100.0


def test_the_searched_rows_are_the_rows_the_services_knn_reads(tiny_datastore: Any) -> None:
    """On a datastore the real builder wrote: the same rows, labels and vectors as the restricted kNN's search,
    each row's own sentence, and the first-sentence flag of each article's first stored sentence."""
    from bench.vote_bound import searched_rows
    from bertknn.core.format import Datastore
    from bertknn.service.retrieval.knn import RestrictedKnn

    ds = Datastore(tiny_datastore)
    try:
        titles = [e.title for e in ds.table.live()][:2]
        rows = searched_rows(ds, titles)
        search = RestrictedKnn(ds).prepare(titles)
        assert rows.labels.tolist() == search.labels.tolist()
        nbrs = search.search(rows.vectors[0], len(rows.labels))
        assert nbrs.distances[0] == pytest.approx(0.0, abs=1e-3)  # the row itself, at distance 0
        assert sorted(rows.article.tolist()) == rows.article.tolist() and set(rows.article.tolist()) == {0, 1}
        refs = ds.contexts(search.rows.tolist())
        assert rows.texts == [r.sentence for r in refs]
        for a, title in enumerate(titles):
            first = ds.article_sentences(title)[0]
            mine = rows.article == a
            assert rows.first_sentence[mine].tolist() == [t == first for t, m in zip(rows.texts, mine, strict=True) if m]
            assert rows.first_sentence[mine].any()
    finally:
        ds.close()


def test_the_default_answer_it_starts_from_is_the_service_s(tiny_datastore: Any) -> None:
    """bench.vote_bound reads its default answer off its own arrays (every searched row's distance, the whole
    p_MLM); the service answers from `RestrictedKnn` and its cached float16 head of p_MLM. On the same questions
    both pick the same word with the same probability, with the subject named and without it."""
    from bench.vote_bound import split_candidates
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.results import Query

    questions = [("Zorblat", "zorblat was born in [MASK] ."), ("Frelle Dax", "frelle dax was born in [MASK] ."),
                 ("Plonk", "the bridge of [MASK] is red ."), ("Vostok", "vostok has long winters and deep [MASK] ."),
                 ("Quimby", "quimby is known for [MASK] and boats ."), ("Émile Grusk", "émile grusk plays the [MASK] .")]  # fmt: skip
    facts = [Fact("P0", subject, "x", text, 0, "dev") for subject, text in questions]
    pipeline = AnswerPipeline.open(tiny_datastore, device="cpu")
    try:
        for with_subject in (True, False):
            cands = split_candidates(pipeline, facts, ["dev"], with_subject=with_subject, top=20)["dev"]
            for fact, c in zip(facts, cands, strict=True):
                query = Query(text=fact.text, subject=fact.subject if with_subject else None, top_k=1,
                              return_contexts=False)  # fmt: skip
                served = pipeline.predict(query).predictions[0]
                assert pipeline.token(int(c.words[c.default])) == served.token, (fact.text, with_subject)
                assert c.default_p == pytest.approx(served.prob, rel=2e-3)  # the service's p_MLM head is float16
    finally:
        pipeline.close()


def test_a_vote_over_more_features_is_never_reported_below_one_over_fewer() -> None:
    from bench.vote_bound import BestVote, at_least

    cands = _told_by(["+cosine"] * 30 + ["-cosine"] * 10)
    w = np.zeros(len(FEATURES))
    w[FEATURES.index("cosine")] = 1.0
    stopped = BestVote(0.0, 100.0, False, np.zeros(len(ALL_FEATURES)))  # what a solver cut short might return
    got = at_least(stopped, cands, w, len(ALL_FEATURES))
    assert got.p1 == 75.0 and got.upper_bound == 100.0 and len(got.weights) == len(ALL_FEATURES)
    better = BestVote(100.0, 100.0, True, np.ones(len(ALL_FEATURES)))
    assert at_least(better, cands, w, len(ALL_FEATURES)) is better
