"""A batch of mixed lengths run as a few groups of similar width: on a CPU, where every padded position costs as
much as a real one, a batch padded to its longest input spends a large share of its forward on padding.

Each group is a run of the inputs sorted by length, padded to its own longest. The grouping minimises the padded
positions plus a fixed price per group, in positions: what one more forward call costs (its operators' dispatch,
and its weights read from memory again), priced by the model's size and backend (`call_positions`), so that a
small model takes fewer, larger groups than a large one.
The outputs are each input's as if it ran alone, up to the float rounding of other shapes: padding is masked out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")

# One forward call's fixed cost, two parts. The first, as the floating-point operations a CPU core could have done
# instead: ONNX Runtime's dispatch of its fused kernels, which weighs on small models; or the eager forward's
# larger cost per call (PyTorch's Python loop, its kernels' set-up), so that it splits a batch only where the saving
# is large. Fitted to forwards timed on one thread (docs/decisions/cpu-width-groups.md).
CALL_FLOPS = {"onnx": 6e7, "eager": 2.7e9}
# And every weight read from memory once per call: a model's weights and its dense work per position both grow with
# its hidden size squared, so this part is about the same number of positions for every size of an encoder.
CALL_WEIGHT_POSITIONS = 16.0


def call_positions(config: Any, backend: str) -> float:
    """The price of one more forward call, in padded positions of this model (its dense work per position from
    its configuration: the attention projections and the feed-forward of every layer; `CALL_FLOPS`,
    `CALL_WEIGHT_POSITIONS`)."""
    hidden = int(config.hidden_size)
    inner = int(getattr(config, "intermediate_size", 4 * hidden) or 4 * hidden)
    per_position = 2 * int(config.num_hidden_layers) * (4 * hidden * hidden + 2 * hidden * inner)
    return CALL_FLOPS.get(backend, CALL_FLOPS["eager"]) / max(1, per_position) + CALL_WEIGHT_POSITIONS


def width_groups(lengths: Sequence[int] | np.ndarray, per_call: float) -> list[np.ndarray]:
    """Indices of the inputs (lengths ``lengths``) in groups that minimise the padded positions plus ``per_call``
    per group; each group a run of the inputs in order of length (ties by index), the groups shortest first.

    Exact (dynamic programming over the distinct lengths): one group when every input has the same length or
    splitting saves less than a call costs."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    widths, counts = np.unique(lengths, return_counts=True)
    if len(widths) <= 1:
        return [order]
    w = widths.tolist()
    before = [0, *np.cumsum(counts).tolist()]  # inputs shorter than widths[j]: before[j]
    best, cut = [0.0] + [float("inf")] * len(w), [0] * (len(w) + 1)
    for j in range(1, len(w) + 1):  # best[j]: the widths[:j] inputs grouped; the last group widths[i:j]
        for i in range(j):
            cost = best[i] + (before[j] - before[i]) * w[j - 1] + per_call
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], len(w)
    while j:
        bounds.append((before[cut[j]], before[j]))
        j = cut[j]
    return [order[a:b] for a, b in reversed(bounds)]


Forward = Callable[[Sequence[T]], tuple[np.ndarray, torch.Tensor | None]]


def in_groups(run: Forward[T], items: Sequence[T], groups: list[np.ndarray]) -> tuple[np.ndarray, torch.Tensor | None]:
    """``run`` (a forward: [MASK] embeddings [n, hidden], log p_MLM [n, vocab] or None) on each group of
    ``items``, the rows put back in the items' order."""
    if len(groups) == 1:  # one padded batch: its rows in the items' own order
        return run(items)
    emb: np.ndarray | None = None
    log_p: torch.Tensor | None = None
    for g in groups:
        part_emb, part_lp = run([items[i] for i in g])
        if emb is None:
            emb = np.empty((len(items), part_emb.shape[1]), part_emb.dtype)
            log_p = None if part_lp is None else part_lp.new_empty((len(items), part_lp.shape[1]))
        emb[g] = part_emb
        if log_p is not None and part_lp is not None:
            log_p[torch.from_numpy(g)] = part_lp
    assert emb is not None
    return emb, log_p
