"""Pure functions: neighbour distances -> p_kNN, mixing with p_MLM (fixed or adaptive lambda), top-k."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from bertknn.core.errors import AdaptiveRuleError
from bertknn.core.topk import top_entries


def article_offsets(
    article: np.ndarray | None, scores: Sequence[float | None], sharpness: float
) -> np.ndarray | None:
    """Per neighbour, what its article's retrieval rank adds to its logit: ``-sharpness * (1 - score / top)``.

    ``article``: each neighbour's article (an index into ``scores``, the searched articles' retrieval scores). An
    article that scores as high as the top one loses nothing; one that scores half as much counts
    ``exp(-sharpness / 2)`` as much. None (every article counts the same, as in the paper) for ``sharpness`` 0, a
    single article, or scores that are missing or not positive (the subject's own article, no retrieval).
    """
    if sharpness < 0:
        raise ValueError("article_sharpness must be >= 0")
    if sharpness == 0 or article is None or len(scores) < 2 or any(s is None for s in scores):
        return None
    s = np.asarray(scores, dtype=np.float64)
    top = s.max()
    if not top > 0 or not np.isfinite(s).all():
        return None
    return (-sharpness * (1.0 - s / top))[article]


def knn_sparse(
    distances: np.ndarray, labels: np.ndarray, temperature: float, offsets: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """The non-zero part of p_kNN: (ids ascending, float32 probabilities), the values of `knn_distribution`.

    p_kNN(w) = sum over neighbours labelled w of softmax(-d / l + offset), the offsets (`article_offsets`)
    being 0 unless given. The softmax is taken in log space (log-sum-exp
    over all neighbours), so every weight is exp of a number <= 0: huge distances underflow to 0 instead of
    overflowing. Every neighbour counts (a sum per word, not the nearest one per word). Words whose weight
    underflowed to 0 are left out.
    """
    if temperature <= 0:
        raise ValueError("temperature must be > 0")
    if len(distances) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    logits = -np.asarray(distances, dtype=np.float64) / temperature
    if offsets is not None:
        logits = logits + offsets
    top = logits.max()
    log_z = top + np.log(np.exp(logits - top).sum())
    ids, inverse = np.unique(np.asarray(labels, dtype=np.int64), return_inverse=True)
    acc = np.zeros(len(ids), dtype=np.float64)
    np.add.at(acc, inverse, np.exp(logits - log_z))  # in neighbour order, as a dense np.add.at would add them
    keep = acc > 0
    return ids[keep], acc[keep].astype(np.float32)


DEFAULT_ARTICLE_SHARPNESS = 10.0  # how much less a lower-ranked article's neighbours count (`article_offsets`)
DEFAULT_MLM_PRIOR = 0.15  # the exponent of p_MLM in the weighted vote (`weigh_vote`); 0 is the paper's vote


def weigh_vote(probs: np.ndarray, p_mlm_at: np.ndarray, mlm_prior: float) -> np.ndarray:
    """The neighbours' vote weighted by how well each word fits the question: ``probs * p_MLM ** mlm_prior``,
    rescaled to the vote's own total mass (so the weighted vote is still a distribution over the same words).

    ``probs``: p_kNN at some words (the non-zero part, or a dense array); ``p_mlm_at``: p_MLM at the same words.
    ``mlm_prior`` 0 is the paper's vote (``probs`` unchanged). Where the products would underflow, the weighting
    runs in log space, so a tiny p_MLM cannot take every word's vote at once; a word with p_MLM 0 keeps no vote.
    Why and how it was measured: docs/decisions/mlm-weighted-vote.md.
    """
    if mlm_prior < 0:
        raise ValueError("mlm_prior must be >= 0")
    probs = np.asarray(probs)
    if mlm_prior == 0 or len(probs) == 0:
        return probs
    p = np.asarray(p_mlm_at, dtype=np.float64)
    total = float(np.sum(probs, dtype=np.float64))
    w = probs * np.power(p, mlm_prior)  # the common case, in linear space: nothing underflows
    mass = float(w.sum())
    if mass > 1e-250 and np.isfinite(mass):
        return (w * (total / mass)).astype(np.float32)
    voted = (probs > 0) & (p > 0)
    if not voted.any():
        return probs
    logw = np.full(len(probs), -np.inf)
    logw[voted] = np.log(probs[voted].astype(np.float64)) + mlm_prior * np.log(p[voted])
    w = np.exp(logw - logw[voted].max())
    return (w * (total / w.sum())).astype(np.float32)


def knn_distribution(
    distances: np.ndarray, labels: np.ndarray, vocab_size: int, temperature: float, offsets: np.ndarray | None = None
) -> np.ndarray:
    """p_kNN over the whole vocabulary (see `knn_sparse`); zeros when there are no neighbours."""
    ids, probs = knn_sparse(distances, labels, temperature, offsets)
    p = np.zeros(vocab_size, dtype=np.float32)
    p[ids] = probs
    return p


def interpolate(p_knn: np.ndarray, p_mlm: np.ndarray, lam: float) -> np.ndarray:
    """p = lam * p_kNN + (1 - lam) * p_MLM over the whole vocabulary."""
    if not 0.0 <= lam <= 1.0:
        raise ValueError("lambda must be in [0, 1]")
    return (lam * p_knn.astype(np.float64) + (1.0 - lam) * p_mlm.astype(np.float64)).astype(np.float32)


def top_k(p: np.ndarray, k: int, *, nonzero: bool = False) -> list[tuple[int, float]]:
    """The k most probable ids, most probable first (ties by lower id: `bertknn.core.topk`); ``nonzero`` drops zero
    entries."""
    values, ids = top_entries(p, k)
    return [(i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if not nonzero or v > 0]


def top_k_among(ids: np.ndarray, values: np.ndarray, k: int, rest: float | None) -> list[tuple[int, float]] | None:
    """`top_k` of a distribution known to equal ``values`` at ``ids`` (ascending) and ``rest`` everywhere else.

    None when the answer could involve the other ids (fewer than k listed, or the k-th listed value is not
    above ``rest``): the caller then ranks the whole vocabulary. ``rest=None``: no other id counts (zero).
    """
    if k <= 0:
        return []
    top, order = top_entries(values, k)  # ids ascending: an index order is an id order, so ties go to lower ids
    if rest is not None and (len(order) < k or not top[-1] > rest):
        return None
    return list(zip(ids[order].tolist(), top.tolist(), strict=True))


class ValuesAt(Protocol):
    """A distribution read at arrays of ids: a dense array, or `bertknn.service.codec.PMlmAt`."""

    def __getitem__(self, ids: np.ndarray, /) -> np.ndarray: ...

    def __len__(self) -> int: ...


def interpolated_top_k(
    p_mlm: ValuesAt,
    mlm_ids: np.ndarray,
    knn_ids: np.ndarray,
    knn_probs: np.ndarray,
    lam: float,
    k: int,
    *,
    mlm_rest: float | None,
    mlm_p: np.ndarray | None = None,
) -> tuple[list[tuple[int, float]], list[tuple[int, float]]] | None:
    """Top k of p = lam p_kNN + (1 - lam) p_MLM and of p_MLM, without touching the whole vocabulary.

    ``p_mlm``: the dense p_MLM, or anything that reads it at arrays of ids (`bertknn.service.codec.PMlmAt`).
    ``mlm_p``: ``p_mlm`` at ``mlm_ids``, where the caller has it already (else read here).

    ``mlm_ids``: the ids whose p_MLM is stored exactly (every other id has one shared remainder value,
    ``mlm_rest``; None when there is no other id). Each candidate's p is computed exactly as `interpolate`
    computes it, so the answer is the same; None when the remainder could reach the top k (the caller then uses
    the dense path).

    ``mlm_ids`` may come in any order (`QueryEncoding` keeps them in id order). Only the m = k + |kNN ids| most
    probable of them (with any ties of the m-th) can reach either top k besides the kNN ids: the ranking runs
    on those few hundred candidates instead of thousands, and falls back to all stored ids only when something
    left out could tie with the k-th answer.
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError("lambda must be in [0, 1]")
    n = len(mlm_ids)
    m = min(n, k + len(knn_ids))
    if 0 < m < n:
        pm = p_mlm[mlm_ids] if mlm_p is None else mlm_p
        mth = np.partition(pm, n - m)[n - m]  # the m-th largest stored p_MLM
        head = pm >= mth  # the m most probable, with the m-th's ties
        if not head.all():
            # every id left out has no kNN mass and p_MLM at most this (a stored one, or the remainder)
            bound = pm[~head].max() if mlm_rest is None else max(pm[~head].max(), np.float32(mlm_rest))
            got = _ranked(p_mlm, _union(mlm_ids[head], knn_ids), knn_ids, knn_probs, lam, k, np.float32(bound))
            if got is not None:
                return got
    cand = _union(mlm_ids, knn_ids)
    # an id outside the candidates is not stored: it holds the remainder value
    rest = np.float32(mlm_rest) if mlm_rest is not None and len(cand) < len(p_mlm) else None
    return _ranked(p_mlm, cand, knn_ids, knn_probs, lam, k, rest)


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Sorted distinct ids of both (np.union1d is slower)."""
    both = np.sort(np.concatenate((a, b)).astype(np.int64))
    return both[np.concatenate(([True], both[1:] != both[:-1]))] if len(both) else both


def _ranked(
    p_mlm: ValuesAt,
    cand: np.ndarray,
    knn_ids: np.ndarray,
    knn_probs: np.ndarray,
    lam: float,
    k: int,
    rest_m: np.float32 | None,
) -> tuple[list[tuple[int, float]], list[tuple[int, float]]] | None:
    """`interpolated_top_k` over the candidates ``cand`` (sorted, every kNN id among them), when no other id
    has a p_MLM above ``rest_m`` (None: no other id counts)."""
    pk = np.zeros(len(cand), dtype=np.float32)
    pk[np.searchsorted(cand, knn_ids)] = knn_probs
    pm = p_mlm[cand]
    p = (lam * pk.astype(np.float64) + (1.0 - lam) * pm.astype(np.float64)).astype(np.float32)
    rest_p = None
    if rest_m is not None:  # p of an id left out: no kNN mass, computed as above
        rest_p = np.float32((1.0 - lam) * np.float64(rest_m))
    best = top_k_among(cand, p, k, None if rest_p is None else float(rest_p))
    mlm = top_k_among(cand, pm, k, None if rest_m is None else float(rest_m))
    if best is None or mlm is None:
        return None
    return best, mlm


def rank_of(p: np.ndarray, token_id: int) -> int:
    """1-based rank of ``token_id`` under ``p`` (ties broken by lower id, as in `top_k`)."""
    v = p[token_id]
    return int(np.count_nonzero(p > v) + np.count_nonzero(p[:token_id] == v) + 1)


# ---- adaptive interpolation ----------------------------------------------------------------------------------
# As in "When Not to Trust Language Models" (Mallen et al. 2023): trust the masked LM alone when it is confident
# (no retrieval, no kNN search), otherwise weigh p_kNN by how sure each side is.

ConfidenceMeasure = Literal["top1", "margin", "entropy"]
Interpolation = Literal["fixed", "adaptive"]


def confidence(p: np.ndarray, measure: ConfidenceMeasure) -> float:
    """How sure a distribution is, in [0, 1].

    ``top1``: the largest probability; ``margin``: the largest minus the second largest; ``entropy``:
    1 - H(p) / log |V| (1 for a one-hot p, 0 for the uniform one). An all-zero p (no neighbours) has
    confidence 0 under every measure.
    """
    if measure not in ("top1", "margin", "entropy"):
        raise ValueError(f"unknown confidence measure {measure!r}; one of top1, margin, entropy")
    p = np.asarray(p)
    total = float(np.sum(p, dtype=np.float64))
    if total <= 0.0 or len(p) < 2:
        return 0.0
    if measure == "top1":  # no normalised copy: this runs on every adaptive query
        return float(np.max(p)) / total
    if measure == "margin":
        two = np.partition(p, len(p) - 2)[-2:]
        return (float(two[1]) - float(two[0])) / total
    q = p.astype(np.float64) / total
    nz = q[q > 0]
    h = float(-(nz * np.log(nz)).sum())
    return min(1.0, max(0.0, 1.0 - h / math.log(len(q))))


def rule_lambda(
    bias: np.ndarray | float,
    knn_weight: np.ndarray | float,
    mlm_weight: np.ndarray | float,
    conf_mlm: np.ndarray | float,
    conf_knn: np.ndarray | float,
    min_lambda: float = 0.0,
    max_lambda: float = 1.0,
    popularity_weight: np.ndarray | float = 0.0,
    log_popularity: np.ndarray | float = 0.0,
) -> np.ndarray:
    """clip(sigmoid(bias + knn_weight * conf_knn - mlm_weight * conf_mlm - popularity_weight * log_popularity),
    min_lambda, max_lambda), broadcast; ``log_popularity`` = log(1 + the subject's inbound links).

    One formula for the service (one query) and the evaluation's fit (many rules and queries at once).
    """
    z = np.asarray(bias, np.float64) + np.asarray(knn_weight, np.float64) * np.asarray(conf_knn, np.float64)
    z = z - np.asarray(mlm_weight, np.float64) * np.asarray(conf_mlm, np.float64)
    z = z - np.asarray(popularity_weight, np.float64) * np.asarray(log_popularity, np.float64)
    lam = 0.5 * (1.0 + np.tanh(0.5 * z))  # = sigmoid(z), without overflow for large |z|
    return np.clip(lam, min_lambda, max_lambda)


class AdaptiveRule(BaseModel):
    """Per-query lambda from the confidence of p_MLM and p_kNN, and when to skip the kNN search altogether.

    lambda = clip(sigmoid(bias + knn_weight * conf(p_kNN) - mlm_weight * conf(p_MLM)
                          - popularity_weight * log(1 + popularity)), min_lambda, max_lambda),
    with conf the chosen `confidence` measure and popularity the subject's inbound links in a datastore with links
    (Mallen et al. 2023: retrieval helps less popular subjects most; 0 without links or subject). When conf(p_MLM) >= skip_threshold the query is answered by the
    masked LM alone: lambda 0, and neither retrieval nor the kNN search runs. ``bert-knn eval lama
    --adaptive --adaptive-out rule.json`` fits the parameters on the dev split.
    """

    __settings_leaf__ = True  # one setting (a rule file or JSON), not a group of flags

    model_config = ConfigDict(extra="forbid", frozen=True)

    measure: ConfidenceMeasure = Field("top1", description="confidence of a distribution: top1, margin or entropy")
    bias: float = Field(-0.85, ge=-50, le=50, description="logit of lambda when both confidences are 0")
    knn_weight: float = Field(2.0, ge=0, le=100, description="how much a confident p_kNN raises lambda")
    mlm_weight: float = Field(2.0, ge=0, le=100, description="how much a confident p_MLM lowers lambda")
    popularity_weight: float = Field(
        0.0, ge=0, le=100, description="how much the subject's log popularity (inbound links) lowers lambda"
    )
    min_lambda: float = Field(0.0, ge=0, le=1)
    max_lambda: float = Field(1.0, ge=0, le=1)
    skip_threshold: float | None = Field(
        0.9, gt=0, le=1, description="skip retrieval and kNN when conf(p_MLM) >= this; null: never skip"
    )
    fitted: dict[str, Any] | None = Field(
        None, description="how the evaluation tool fitted this rule (provenance only; not used to answer)"
    )

    @field_validator("skip_threshold", mode="before")
    @classmethod
    def _never(cls, value: Any) -> Any:
        # environment variables cannot carry JSON null: BERTKNN_DEFAULTS__ADAPTIVE_RULE__SKIP_THRESHOLD=none
        if isinstance(value, str) and value.strip().lower() in ("", "none", "null"):
            return None
        return value

    @model_validator(mode="after")
    def _check(self) -> AdaptiveRule:
        if self.min_lambda > self.max_lambda:
            raise ValueError(f"min_lambda {self.min_lambda} must not exceed max_lambda {self.max_lambda}")
        return self

    def skips(self, conf_mlm: float) -> bool:
        """True when the masked LM is confident enough to answer alone."""
        return self.skip_threshold is not None and conf_mlm >= self.skip_threshold

    def lambda_for(self, conf_mlm: float, conf_knn: float, log_popularity: float = 0.0) -> float:
        """The rule's lambda for given confidences (the skip threshold is not applied here)."""
        lam = rule_lambda(self.bias, self.knn_weight, self.mlm_weight, conf_mlm, conf_knn,
                          self.min_lambda, self.max_lambda, self.popularity_weight, log_popularity)  # fmt: skip
        return float(lam)

    def save(self, path: Path | str) -> None:
        Path(path).write_text(self.model_dump_json(indent=1) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: Path | str) -> AdaptiveRule:
        """Read a rule written by `save` (or by hand); `AdaptiveRuleError` names the file and the problem."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise AdaptiveRuleError(f"cannot read the adaptive rule {path}: {exc.strerror or exc}") from None
        try:
            return cls.model_validate(json.loads(text))
        except json.JSONDecodeError as exc:
            raise AdaptiveRuleError(f"adaptive rule {path} is not JSON: {exc}") from None
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "(rule)"
            raise AdaptiveRuleError(f"adaptive rule {path}: {where}: {first['msg']}") from None


def knn_skipped(rule: AdaptiveRule, p_mlm: np.ndarray) -> bool:
    """Whether the rule answers this query from p_MLM alone (decided before any retrieval or kNN work)."""
    return rule.skip_threshold is not None and rule.skips(confidence(p_mlm, rule.measure))


def adaptive_lambda(rule: AdaptiveRule, p_mlm: np.ndarray, p_knn: np.ndarray, popularity: int | None = None) -> float:
    """The rule's lambda for one query: 0 when the MLM is confident enough (skip) or p_kNN is empty.
    ``popularity``: the subject's inbound links (None: unknown, counted as 0)."""
    conf_mlm = confidence(p_mlm, rule.measure)
    if rule.skips(conf_mlm) or not np.any(p_knn):
        return 0.0
    return rule.lambda_for(conf_mlm, confidence(p_knn, rule.measure), math.log1p(popularity or 0))
