"""``temperature: auto``: each datastore's own distance scale, measured by the builder and read by the service.

The kNN distribution is ``softmax(-d / l)`` over squared L2 distances ``d``. The paper's ``l = 6`` suits
bert-base-uncased; other models (and codecs, which change distances) put their contexts at other distances, so a
fixed ``l`` makes p_kNN one-hot for some and flat for others. The statistic (``STATISTIC``):

    Draw a seeded sample of stored contexts (uniform over rows, articles with at least two contexts). For each,
    search its own article's contexts, itself left out, as the restricted kNN does (the same index, through the
    codec when there is one; a coded context's query is its decoded vector), keeping the ``k`` nearest. The
    temperature is relative to each query's own neighbours: ``l = a * median(d)`` over the distances the query got.
    ``a`` is the factor that maximises the mean log-probability that ``softmax(-d / l)`` over those neighbours gives
    the context's own word, over the sampled contexts whose word is among them (leave-one-out likelihood), found on a
    log-spaced grid.

It needs no labels beyond the datastore's own and no constant tuned on any model: it asks at which distance scale,
relative to how far a context's own-article neighbours lie, they predict its word. The service applies ``a`` to
each query's neighbour distances when a request and the settings leave the temperature at ``auto``. A datastore
measured with the earlier statistic (``FIXED_STATISTIC``: one ``l`` for every query, fitted the same way) keeps it;
one without a measurement gets the paper's 6. docs/decisions/codecs-and-temperature.md says why the relative form.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bertknn.core.format.codec import rows_index
from bertknn.core.format.contract import DistanceScale, Manifest
from bertknn.core.format.reader import Datastore
from bertknn.core.runtime import faiss_threads

STATISTIC = "own-article-loo-relative-temperature-v2"  # value: the factor a of l = a * median(d)
FIXED_STATISTIC = "own-article-loo-temperature-v1"  # value: l itself (datastores measured before v2)
PAPER_TEMPERATURE = 6.0
SAMPLE = 2000
NEIGHBOURS = 128


def neighbour_scale(distances: np.ndarray) -> float:
    """The distance scale of one query's neighbours, which ``l`` is relative to: the median of their squared L2
    distances (0 without neighbours). `np.median`'s value, from one partition: every query pays for it, and
    np.median's own checks cost several times the partition on a few hundred distances."""
    n = len(distances)
    if not n:
        return 0.0
    mid = n // 2
    if n % 2:
        return float(np.partition(distances, mid)[mid])
    part = np.partition(distances, (mid - 1, mid))
    return float((part[mid - 1] + part[mid]) / 2)


@dataclass(frozen=True)
class AutoTemperature:
    """What ``temperature: auto`` stands for with one datastore: ``factor * neighbour_scale(d)`` for each query
    (``factor`` None: the fixed ``typical`` for every query). ``typical`` also stands in for a query without
    neighbours (its temperature changes nothing) or with all of them at distance 0."""

    factor: float | None
    typical: float

    def of(self, distances: np.ndarray) -> float:
        """The ``l`` for a query whose neighbours lie at ``distances`` (squared L2)."""
        if self.factor is None:
            return self.typical
        scale = neighbour_scale(distances)
        return self.factor * scale if scale > 0 else self.typical


def temperature_for(scale: DistanceScale | None) -> AutoTemperature:
    """The temperature ``auto`` stands for: the datastore's measured one, else the paper's."""
    if scale is not None and scale.value > 0:
        if scale.statistic == STATISTIC and scale.typical is not None and scale.typical > 0:
            return AutoTemperature(float(scale.value), float(scale.typical))
        if scale.statistic == FIXED_STATISTIC:
            return AutoTemperature(None, float(scale.value))
    return AutoTemperature(None, PAPER_TEMPERATURE)


def padded(distances: list[np.ndarray], matches: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Samples of different neighbour counts as one float64 [n, width] distance matrix (inf past a sample's own
    neighbours) and its bool match matrix."""
    width = max((len(d) for d in distances), default=0)
    dist = np.full((len(distances), width), np.inf)
    match = np.zeros((len(distances), width), dtype=bool)
    for i, (d, m) in enumerate(zip(distances, matches, strict=True)):
        dist[i, : len(d)] = d
        match[i, : len(d)] = m
    return dist, match


def own_word_log_probability(dist: np.ndarray, match: np.ndarray, temperature: float | np.ndarray) -> np.ndarray:
    """Per row of `padded` samples: ``log sum_{j: match} softmax(-d / l)_j``, the log-probability p_kNN gives the
    sample's own word (-inf where no neighbour carries it). ``temperature``: one l, or one per row ([n, 1]). Every
    row needs at least one neighbour."""
    logits = -dist / temperature
    top = logits.max(axis=1, keepdims=True)  # finite: every row has a neighbour
    w = np.exp(logits - top)
    with np.errstate(divide="ignore"):
        return np.log((w * match).sum(axis=1)) - np.log(w.sum(axis=1))


def fit_temperature(
    distances: list[np.ndarray], matches: list[np.ndarray], scales: list[float] | None = None, grid: int = 121
) -> float | None:
    """The ``a`` maximising the mean over samples of ``log sum_{j: match} softmax(-d / (a * scale))_j`` (samples
    without a match, or without a positive scale, are left out); a log grid of ``grid`` points from 1/100 to 100
    times the median of ``d / scale``. Without ``scales`` (all 1) that ``a`` is a fixed temperature ``l``. None when
    no sample can say (no match among any sample's neighbours, or every distance 0)."""
    if scales is None:
        scales = [1.0] * len(distances)
    keep = [
        (d.astype(np.float64) / s, m)
        for d, m, s in zip(distances, matches, scales, strict=True)
        if m.any() and len(d) > 1 and s > 0
    ]
    if not keep:
        return None
    median = float(np.median(np.concatenate([d for d, _ in keep])))
    if not median > 0:
        return None
    candidates = median * np.logspace(-2, 2, grid)
    dist, match = padded([d for d, _ in keep], [m for _, m in keep])
    best, best_ll = float(candidates[0]), -np.inf
    for lt in candidates:
        ll = float(np.mean(own_word_log_probability(dist, match, lt)))
        if ll > best_ll:
            best, best_ll = float(lt), ll
    return best


@dataclass(frozen=True)
class NeighbourSample:
    """The statistic's sample: for each sampled context (global row ``rows[i]``), the squared L2 distances of its
    nearest neighbours in its own article, itself left out, and which of them carry its word."""

    rows: list[int]
    distances: list[np.ndarray]
    matches: list[np.ndarray]


def sample_neighbours(ds: Datastore, *, sample: int = SAMPLE, k: int = NEIGHBOURS, seed: int = 0) -> NeighbourSample:
    """Draw the statistic's seeded sample from an open datastore and search each context's own article, as the
    restricted kNN does (see the module docstring). Empty when no article has two word contexts."""
    out = NeighbourSample([], [], [])
    total = ds.total_rows
    if total < 2:
        return out
    rng = np.random.default_rng(seed)
    rows = np.unique(rng.integers(0, total, size=min(total, 4 * sample)))
    rng.shuffle(rows)
    by_article: dict[str, list[int]] = {}
    taken = 0
    for g in rows.tolist():
        if taken >= sample:
            break
        pos, row = ds.locate(g)
        title = ds.table.title_at(pos, row)
        entry = ds.articles.get(title)
        if entry is None or entry.shard != pos or entry.rows < 2:
            continue  # superseded rows, or an article of one context
        if ds.linked and int(ds.shards[pos].labels[row]) < 0:
            continue  # an entity link's anchor-only row: no word, never a word query's neighbour
        by_article.setdefault(title, []).append(g)
        taken += 1
    with faiss_threads(1):  # one query at a time: a single thread is fastest
        for title, picked in by_article.items():
            payload, labels, ids = ds.article_rows([title])
            if len(ids) < 2:
                continue
            index = rows_index(payload, ds.codec)
            local = np.searchsorted(ids, picked)
            assert np.array_equal(ids[local], picked), "a sampled row is not among its article's word rows"
            pos, _ = ds.locate(picked[0])
            queries = ds.float_rows(pos, (np.asarray(picked) - ds.shard_offsets[pos]))
            d, nn = index.search(np.ascontiguousarray(queries, dtype=np.float32), min(k + 1, len(ids)))
            for qi, li in enumerate(local):
                keep = (nn[qi] >= 0) & (nn[qi] != li)
                out.rows.append(int(picked[qi]))
                out.distances.append(d[qi][keep][:k])
                out.matches.append(labels[nn[qi][keep][:k]] == labels[li])
    return out


def measure_distance_scale(
    root: Path, manifest: Manifest, *, sample: int = SAMPLE, k: int = NEIGHBOURS, seed: int = 0
) -> DistanceScale | None:
    """The statistic above over the datastore at ``root`` described by ``manifest`` (its article table written);
    None when it has no article of two contexts."""
    ds = Datastore(root, manifest)
    try:
        drawn = sample_neighbours(ds, sample=sample, k=k, seed=seed)
    finally:
        ds.close()
    if not drawn.distances:
        return None
    scales = [neighbour_scale(d) for d in drawn.distances]
    factor = fit_temperature(drawn.distances, drawn.matches, scales)
    if factor is None:
        return None
    positive = [s for s in scales if s > 0]
    typical = factor * float(np.median(positive)) if positive else PAPER_TEMPERATURE
    return DistanceScale(statistic=STATISTIC, value=factor, typical=typical, sample=len(drawn.distances), seed=seed)


def recalibrate(root: Path, manifest: Manifest) -> DistanceScale | None:
    """Measure the datastore's distance scale again and record it in its manifest (written atomically; the datastore
    id does not depend on it). Returns the scale it replaced."""
    from bertknn.core.format import write_manifest

    before = manifest.distance_scale
    manifest.distance_scale = measure_distance_scale(root, manifest)
    write_manifest(root, manifest)
    return before
