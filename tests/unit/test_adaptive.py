"""The adaptive interpolation rule and its fit, against hand computations."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from pydantic import ValidationError

from bertknn.core.errors import AdaptiveRuleError
from bertknn.evaluation.adaptive import AdaptiveSpace, fit_rule, hits_for_lambdas, score_query
from bertknn.evaluation.base import gold_rank
from bertknn.service.interpolate import AdaptiveRule, adaptive_lambda, confidence, interpolate, knn_skipped
from bertknn.service.settings import ServiceSettings


def test_confidence_measures_by_hand():
    p = np.array([0.5, 0.3, 0.2, 0.0])
    assert confidence(p, "top1") == pytest.approx(0.5)
    assert confidence(p, "margin") == pytest.approx(0.2)
    h = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    assert confidence(p, "entropy") == pytest.approx(1 - h / math.log(4))
    one_hot, uniform = np.array([0.0, 1.0, 0.0]), np.full(3, 1 / 3)
    assert [confidence(one_hot, m) for m in ("top1", "margin", "entropy")] == pytest.approx([1, 1, 1])
    assert confidence(uniform, "margin") == pytest.approx(0) and confidence(uniform, "entropy") == pytest.approx(0)
    for m in ("top1", "margin", "entropy"):
        assert confidence(np.zeros(5), m) == 0.0  # an empty p_kNN is not confident
    with pytest.raises(ValueError, match="unknown confidence measure"):
        confidence(p, "gini")  # type: ignore[arg-type]


def test_lambda_is_the_clipped_sigmoid_of_the_confidences():
    rule = AdaptiveRule(bias=-1.0, knn_weight=2.0, mlm_weight=3.0, skip_threshold=None)
    # z = -1 + 2 * 0.8 - 3 * 0.1 = 0.3
    assert rule.lambda_for(0.1, 0.8) == pytest.approx(1 / (1 + math.exp(-0.3)))
    assert rule.lambda_for(0.0, 0.0) == pytest.approx(1 / (1 + math.exp(1.0)))
    # a confident MLM lowers lambda, a confident kNN raises it
    assert rule.lambda_for(0.9, 0.5) < rule.lambda_for(0.1, 0.5) < rule.lambda_for(0.1, 0.9)
    clipped = AdaptiveRule(bias=-1.0, knn_weight=2.0, mlm_weight=3.0, min_lambda=0.2, max_lambda=0.6)
    assert clipped.lambda_for(1.0, 0.0) == 0.2 and clipped.lambda_for(0.0, 1.0) == 0.6
    huge = AdaptiveRule(bias=50, knn_weight=100, mlm_weight=0)
    assert huge.lambda_for(0.0, 1.0) == 1.0  # no overflow


def test_adaptive_lambda_from_distributions_and_the_skip_threshold():
    rule = AdaptiveRule(measure="top1", bias=0.0, knn_weight=1.0, mlm_weight=1.0, skip_threshold=0.7)
    p_knn = np.array([0.0, 0.9, 0.1, 0.0])
    unsure = np.array([0.4, 0.3, 0.2, 0.1])
    assert not knn_skipped(rule, unsure)
    assert adaptive_lambda(rule, unsure, p_knn) == pytest.approx(1 / (1 + math.exp(-(0.9 - 0.4))))
    sure = np.array([0.7, 0.1, 0.1, 0.1])  # top-1 exactly at the threshold: skipped
    assert knn_skipped(rule, sure) and adaptive_lambda(rule, sure, p_knn) == 0.0
    assert adaptive_lambda(rule, unsure, np.zeros(4)) == 0.0  # no neighbours: lambda 0, as in fixed mode
    never = rule.model_copy(update={"skip_threshold": None})
    assert not knn_skipped(never, np.array([1.0, 0.0, 0.0, 0.0]))


def test_rule_json_round_trip(tmp_path):
    rule = AdaptiveRule(measure="entropy", bias=0.25, knn_weight=4, mlm_weight=1, skip_threshold=0.95,
                        fitted={"dev_queries": 12})  # fmt: skip
    path = tmp_path / "rule.json"
    rule.save(path)
    assert json.loads(path.read_text())["measure"] == "entropy"
    assert AdaptiveRule.load(path) == rule
    no_skip = AdaptiveRule(skip_threshold=None)
    no_skip.save(path)
    assert AdaptiveRule.load(path).skip_threshold is None


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"min_lambda": 0.8, "max_lambda": 0.2}, "must not exceed max_lambda"),
        ({"knn_weight": -1}, "knn_weight"),
        ({"skip_threshold": 0}, "skip_threshold"),
        ({"skip_threshold": 1.5}, "skip_threshold"),
        ({"measure": "gini"}, "measure"),
        ({"bias": float("nan")}, "bias"),
        ({"max_lambda": 2}, "max_lambda"),
        ({"lambda": 0.3}, "lambda"),  # unknown field: a typo is not silently ignored
    ],
)
def test_bad_parameters_are_rejected(tmp_path, body, needle):
    with pytest.raises(ValidationError, match=needle):
        AdaptiveRule.model_validate(body)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(body))
    with pytest.raises(AdaptiveRuleError, match=needle):
        AdaptiveRule.load(path)


def test_unreadable_rule_files_say_what_is_wrong(tmp_path):
    with pytest.raises(AdaptiveRuleError, match="cannot read the adaptive rule"):
        AdaptiveRule.load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(AdaptiveRuleError, match="is not JSON"):
        AdaptiveRule.load(tmp_path / "x.json")


def test_settings_take_a_rule_file_an_object_or_single_fields(tmp_path, monkeypatch):
    assert ServiceSettings().defaults.interpolation == "fixed"  # the paper's behaviour unless asked
    path = tmp_path / "rule.json"
    AdaptiveRule(measure="margin", skip_threshold=0.6).save(path)
    monkeypatch.setenv("BERTKNN_DEFAULTS__ADAPTIVE_RULE", str(path))
    assert ServiceSettings().defaults.adaptive_rule.measure == "margin"
    monkeypatch.setenv("BERTKNN_DEFAULTS__ADAPTIVE_RULE", '{"bias": 1.5}')
    assert ServiceSettings().defaults.adaptive_rule.bias == 1.5
    monkeypatch.delenv("BERTKNN_DEFAULTS__ADAPTIVE_RULE")
    monkeypatch.setenv("BERTKNN_DEFAULTS__ADAPTIVE_RULE__SKIP_THRESHOLD", "none")
    monkeypatch.setenv("BERTKNN_DEFAULTS__INTERPOLATION", "adaptive")
    s = ServiceSettings()
    assert s.defaults.adaptive_rule.skip_threshold is None and s.defaults.interpolation == "adaptive"
    monkeypatch.setenv("BERTKNN_DEFAULTS__ADAPTIVE_RULE__SKIP_THRESHOLD", "2")
    with pytest.raises(ValidationError, match="skip_threshold"):
        ServiceSettings()
    monkeypatch.delenv("BERTKNN_DEFAULTS__ADAPTIVE_RULE__SKIP_THRESHOLD")
    monkeypatch.setenv("BERTKNN_DEFAULTS__ADAPTIVE_RULE", str(tmp_path / "missing.json"))
    with pytest.raises(ValidationError, match="cannot read the adaptive rule"):
        ServiceSettings()


# ---- the fit ------------------------------------------------------------------------------------------------


def _random_query(rng: np.random.Generator, vocab: int, relation: str = "P1"):
    p_mlm = rng.dirichlet(np.full(vocab, 0.3)).astype(np.float32)
    p_knn = np.zeros(vocab, np.float32)
    support = rng.choice(vocab, 5, replace=False)
    p_knn[support] = rng.dirichlet(np.ones(5))
    gold = int(rng.integers(vocab))
    return relation, p_mlm, p_knn, gold


def test_candidate_ranks_equal_full_vocabulary_ranks():
    rng = np.random.default_rng(0)
    lambdas = np.array([0.0, 0.1, 0.3, 0.5, 0.77, 1.0])
    for _ in range(50):
        rel, p_mlm, p_knn, gold = _random_query(rng, 300)
        q = score_query(rel, p_mlm, p_knn, gold, ("top1",))
        got = hits_for_lambdas(q, lambdas)
        for i, lam in enumerate(lambdas):
            rank = gold_rank(interpolate(p_knn, p_mlm, float(lam)), gold)
            assert list(got[i]) == [rank is not None and rank <= k for k in (1, 5, 10)]
    # with a restricted vocabulary, ranks are taken inside it
    allowed = np.arange(0, 300, 3)
    rel, p_mlm, p_knn, _ = _random_query(rng, 300)
    gold = 42
    q = score_query(rel, p_mlm, p_knn, gold, ("top1",), allowed)
    rank = gold_rank(interpolate(p_knn, p_mlm, 0.4), gold, allowed)
    assert list(hits_for_lambdas(q, np.array([0.4]))[0]) == [rank is not None and rank <= k for k in (1, 5, 10)]


def _query(relation: str, mlm_top: int, knn_top: int, gold: int, *, mlm_conf: float, knn_conf: float = 1.0):
    p_mlm = np.full(20, (1 - mlm_conf) / 19, np.float32)
    p_mlm[mlm_top] = mlm_conf
    p_knn = np.zeros(20, np.float32)
    p_knn[knn_top] = knn_conf
    p_knn[(knn_top + 1) % 20] = 1 - knn_conf
    return score_query(relation, p_mlm, p_knn, gold, ("top1",))


def test_fit_prefers_the_mlm_where_it_is_confident_and_knn_elsewhere():
    # A confident MLM (top-1 0.9) is right and kNN wrong: the gold wins for lambda < 0.47. An unsure MLM (0.5) is
    # wrong and kNN right: the gold wins for lambda > 0.49. No fixed lambda gets both; skipping kNN for the
    # confident MLM does, and skips exactly that half.
    dev = [_query("P1", 3, 4, 3, mlm_conf=0.9), _query("P1", 5, 6, 6, mlm_conf=0.5, knn_conf=0.5)] * 3
    space = AdaptiveSpace(measures=("top1",), base_lambdas=(0.3, 0.7), knn_weights=(0.0,), mlm_weights=(0.0,),
                          skip_thresholds=(None, 0.6))  # fmt: skip
    fit = fit_rule(dev, space, fixed_lambda=0.3)
    assert fit.fixed["p@1"] == 50.0
    assert fit_rule(dev, space, fixed_lambda=0.7).fixed["p@1"] == 50.0
    assert fit.best.macro["p@1"] == 100.0
    assert fit.best.rule.skip_threshold == 0.6 and fit.best.skipped == 0.5
    assert fit.best.rule.lambda_for(0.2, 1.0) == pytest.approx(0.7, abs=1e-4)  # enough kNN weight to win
    assert fit.rules == 2 * 2 and fit.queries == 6 and fit.relations == 1


def test_fit_ties_go_to_the_rule_that_skips_more():
    # the MLM is right on every query: any rule that keeps p_MLM's top-1 scores 100; skipping everything is cheapest
    dev = [_query("P1", 2, 2, 2, mlm_conf=c) for c in (0.6, 0.8, 0.95)]
    space = AdaptiveSpace(measures=("top1",), base_lambdas=(0.3,), knn_weights=(0.0,), mlm_weights=(0.0,),
                          skip_thresholds=(None, 0.9, 0.5))  # fmt: skip
    fit = fit_rule(dev, space, fixed_lambda=0.3)
    assert fit.best.macro["p@1"] == 100.0 and fit.best.rule.skip_threshold == 0.5 and fit.best.skipped == 1.0
    assert [s.rule.skip_threshold for s in fit.ranking] == [0.5, 0.9, None]
    # without a threshold that helps, equal rules resolve to the fixed interpolation (weights 0, lambda 0.3)
    space = AdaptiveSpace(measures=("top1",), base_lambdas=(0.2, 0.3), knn_weights=(1.0, 0.0),
                          mlm_weights=(1.0, 0.0), skip_thresholds=(None,))  # fmt: skip
    best = fit_rule(dev, space, fixed_lambda=0.3).best.rule
    assert (best.knn_weight, best.mlm_weight) == (0.0, 0.0) and best.lambda_for(0.5, 0.5) == pytest.approx(0.3, abs=1e-4)
    with pytest.raises(ValueError, match="measures"):
        fit_rule(dev, AdaptiveSpace(measures=("top1", "entropy")), fixed_lambda=0.3)


def test_fit_macro_weighs_relations_equally():
    # relation A (3 queries) wants kNN, relation B (1 query) wants the MLM; macro P@1 of each rule is the mean
    a = [_query("A", 1, 2, 2, mlm_conf=0.3, knn_conf=0.9)] * 3
    b = [_query("B", 5, 6, 5, mlm_conf=0.3, knn_conf=0.9)]
    space = AdaptiveSpace(measures=("top1",), base_lambdas=(0.1, 0.9), knn_weights=(0.0,), mlm_weights=(0.0,),
                          skip_thresholds=(None,))  # fmt: skip
    fit = fit_rule([*a, *b], space, fixed_lambda=0.1)
    assert fit.fixed["p@1"] == 50.0  # B right, A wrong
    assert fit.best.macro["p@1"] == 50.0 and fit.best.rule.lambda_for(0.3, 0.9) == pytest.approx(0.1, abs=1e-4)
    with pytest.raises(ValueError, match="no queries"):
        fit_rule([], space, fixed_lambda=0.3)


def test_space_rejects_bad_axes():
    with pytest.raises(ValueError):
        AdaptiveSpace(base_lambdas=(0.0,))
    with pytest.raises(ValueError):
        AdaptiveSpace(skip_thresholds=(1.5,))
    with pytest.raises(ValueError):
        AdaptiveSpace(knn_weights=())
    assert 0.33 in AdaptiveSpace().with_base_lambda(0.33).base_lambdas


def test_popularity_lowers_lambda_and_the_fit_uses_it_only_where_it_separates():
    rule = AdaptiveRule(bias=0.0, knn_weight=0.0, mlm_weight=0.0, popularity_weight=1.0, skip_threshold=None)
    assert rule.lambda_for(0.5, 0.5) == pytest.approx(0.5)  # no links (popularity 0): log(1 + 0) = 0
    assert rule.lambda_for(0.5, 0.5, math.log1p(9)) == pytest.approx(1 / (1 + 10))  # sigmoid(-log 10)
    p_mlm, p_knn = np.array([0.6, 0.4]), np.array([0.2, 0.8])
    assert adaptive_lambda(rule, p_mlm, p_knn, 9) == pytest.approx(1 / 11)
    assert adaptive_lambda(rule, p_mlm, p_knn, None) == pytest.approx(0.5)
    # the same confidences everywhere; popular subjects: the MLM is right, kNN wrong; rare ones: the reverse
    popular = [replace(_query("P1", 3, 4, 3, mlm_conf=0.6, knn_conf=0.9), log_pop=math.log1p(500))] * 2
    rare = [_query("P1", 5, 6, 6, mlm_conf=0.6, knn_conf=0.9)] * 2
    space = AdaptiveSpace(measures=("top1",), base_lambdas=(0.7,), knn_weights=(0.0,), mlm_weights=(0.0,),
                          skip_thresholds=(None,))  # fmt: skip
    without = fit_rule([*popular, *rare], space, fixed_lambda=0.7)
    assert without.best.macro["p@1"] == 50.0 and without.best.rule.popularity_weight == 0.0
    fit = fit_rule([*popular, *rare], replace(space, popularity_weights=(0.0, 0.5)), fixed_lambda=0.7)
    assert fit.best.macro["p@1"] == 100.0 and fit.best.rule.popularity_weight == 0.5
    # and where popularity separates nothing, the fit keeps it out (weaker dependence wins ties)
    flat = fit_rule(rare, replace(space, popularity_weights=(0.0, 0.5)), fixed_lambda=0.7)
    assert flat.best.rule.popularity_weight == 0.0
    with pytest.raises(ValueError, match="weights must be >= 0"):
        AdaptiveSpace(popularity_weights=(-1.0,))


def test_confidence_reads_the_distribution_not_its_scale_or_order():
    """A vote that does not sum to one (a weighted p_kNN) has the confidence of its normalised form; the two largest
    entries are found wherever they stand; two words are enough for every measure."""
    rng = np.random.default_rng(3)
    for n in (2, 3, 7, 40):
        p = rng.random(n)
        q = p / p.sum()
        top2 = np.sort(q)[-2:]
        want = {"top1": q.max(), "margin": top2[1] - top2[0],
                "entropy": 1 + float((q * np.log(q)).sum()) / math.log(n)}  # fmt: skip
        for measure, value in want.items():
            assert confidence(3.0 * p, measure) == pytest.approx(value, abs=1e-12), (n, measure)
            assert confidence(p[::-1].copy(), measure) == pytest.approx(value, abs=1e-12), (n, measure)
    assert confidence(np.array([0.25, 0.75]), "margin") == pytest.approx(0.5)


def test_the_skip_threshold_is_inclusive_and_a_constant_lambda_is_a_rule():
    rule = AdaptiveRule(measure="top1", skip_threshold=0.75)
    assert knn_skipped(rule, np.array([0.75, 0.125, 0.125]))  # exactly at the threshold (binary fractions)
    assert not knn_skipped(rule, np.array([0.625, 0.25, 0.125]))
    constant = AdaptiveRule(min_lambda=0.3, max_lambda=0.3, skip_threshold=None)  # min = max: lambda fixed
    assert constant.lambda_for(0.9, 0.1) == constant.lambda_for(0.0, 1.0) == pytest.approx(0.3)
    with pytest.raises(ValidationError):
        constant.bias = 1.0  # type: ignore[misc]  # a rule, once read, does not change under a running service
