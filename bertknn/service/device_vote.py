"""A batch's vote, interpolation and final top-k on the model's device (``model.vote_device: model``): what
`TokenAnswerer.answer` computes on the host for one question, here for a whole batch in a few tensor operations;
only the answers' ids and probabilities come back.

Every step is the host's, in the same precision: p_MLM from the compact encoding (`QueryEncoding`: the stored
entries normalised, one shared value elsewhere), p_kNN as the softmax of -d/l (plus the article offsets) summed
per label in log-sum-exp form (`knn_sparse`), the vote weighted by p_MLM ** mlm_prior (`weigh_vote`, with its
log-space fallback), p = lam p_kNN + (1 - lam) p_MLM (`interpolate`), and each ranking with ties to the lower id
(`bertknn.core.topk`). So a question voted here gets the answer a cached one gets on the host
(tests/unit/test_device_vote.py). Runs on the model thread (`AsyncAnswerer`), where every torch call of the
service comes from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bertknn.service.codec import QueryEncoding
from bertknn.service.results import Query
from bertknn.service.retrieval.knn import Neighbours

_SPARE = 32  # candidates beyond k taken before ties are ranked by id (more ties than this: a full sort)


@dataclass(frozen=True)
class VoteInput:
    """One question's part of a batch vote: its encoding and neighbours, and the settings that shape its answer."""

    encoding: QueryEncoding
    neighbours: Neighbours
    offsets: np.ndarray | None  # per neighbour, its article's logit offset (`knn_offsets`); None: all 0
    temperature: float
    lam: float  # the kNN weight (0 without neighbours: `lambda_for`)
    mlm_prior: float
    top_k: int
    any_token: bool

    @classmethod
    def of(cls, query: Query, enc: QueryEncoding, nbrs: Neighbours, offsets: np.ndarray | None) -> VoteInput:
        """A question's input as the host votes it with fixed interpolation: ``query``'s temperature resolved
        (`AnswerAssembler.resolve_temperature`), its kNN weight 0 without neighbours (`lambda_for`)."""
        assert query.temperature is not None, "resolve the temperature first"
        lam = query.lambda_ if len(nbrs) else 0.0
        return cls(enc, nbrs, offsets, query.temperature, lam, query.mlm_prior, query.top_k, query.any_token)


@dataclass(frozen=True)
class Voted:
    """A question's answers from the device: (id, probability) most probable first, as `TokenAnswerer` ranks
    them; p_MLM and the weighted p_kNN at each answer of ``best``."""

    best: list[tuple[int, float]]
    mlm: list[tuple[int, float]]
    knn: list[tuple[int, float]]
    best_p_mlm: list[float]
    best_p_knn: list[float]
    lam: float


class DeviceVote:
    """The batch vote on ``device``; ``non_words``: the ids no ranking lists unless a question asks for
    ``any_token`` (`TokenAnswerer.non_words`), kept on the device."""

    def __init__(self, device: torch.device, non_words: np.ndarray):
        self.device = device
        self.non_words = torch.as_tensor(np.asarray(non_words, dtype=bool), device=device)

    @torch.inference_mode()
    def vote(self, items: Sequence[VoteInput]) -> list[Voted]:
        """Each question's `Voted`, in order (all of one vocabulary size)."""
        if not items:
            return []
        vocab = items[0].encoding.vocab_size
        if any(it.encoding.vocab_size != vocab for it in items) or len(self.non_words) != vocab:
            raise ValueError("a batch vote needs one vocabulary: the questions' and the non-words' sizes differ")
        k = min(vocab, max(it.top_k for it in items))
        pm = self._p_mlm(items, vocab)
        acc = self._p_knn(items, vocab)
        present = acc > 0
        prior = self._column([it.mlm_prior for it in items])
        pk = _weigh(acc.float(), pm, prior)
        lam = self._column([it.lam for it in items])
        p = (lam * pk.double() + (1.0 - lam) * pm.double()).float()
        skip = self.non_words.unsqueeze(0) & ~torch.as_tensor([it.any_token for it in items], device=self.device)[:, None]
        best_p, best_id = _top(torch.where(skip, 0.0, p), k)
        mlm_p, mlm_id = _top(torch.where(skip, 0.0, pm), k)
        knn_p, knn_id = _top(torch.where(present & ~skip, pk, -1.0), k)
        out = torch.stack([
            best_id.double(), best_p.double(), pm.gather(1, best_id).double(), pk.gather(1, best_id).double(),
            mlm_id.double(), mlm_p.double(), knn_id.double(), knn_p.double(),
        ], dim=1).cpu().numpy()  # fmt: skip
        return [_voted(it, row) for it, row in zip(items, out, strict=True)]

    def _column(self, values: Sequence[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float64, device=self.device)[:, None]

    def _p_mlm(self, items: Sequence[VoteInput], vocab: int) -> torch.Tensor:
        """The dense p_MLM [B, vocab] float32 of each encoding (`QueryEncoding.p_mlm`)."""
        width = max(len(it.encoding.top_ids) for it in items)
        ids = np.full((len(items), width), vocab, dtype=np.int64)  # padding: a spare column, cut off below
        probs = np.zeros((len(items), width), dtype=np.float16)
        for i, it in enumerate(items):
            n = len(it.encoding.top_ids)
            ids[i, :n], probs[i, :n] = it.encoding.top_ids, it.encoding.top_probs
        top = torch.from_numpy(probs).to(self.device).double()
        stored = top.sum(1)  # exact: float16 values summed in float64
        others = torch.tensor([vocab - len(it.encoding.top_ids) for it in items], dtype=torch.float64,
                              device=self.device)  # fmt: skip
        fill = torch.where(others > 0, (1.0 - stored).clamp(min=0.0) / others.clamp(min=1.0), 0.0)
        total = stored + fill * others
        rest = (fill / total).float()
        dense = rest[:, None].expand(len(items), vocab + 1).clone()
        dense.scatter_(1, torch.from_numpy(ids).to(self.device), (top / total[:, None]).float())
        return dense[:, :vocab]

    def _p_knn(self, items: Sequence[VoteInput], vocab: int) -> torch.Tensor:
        """p_kNN [B, vocab] in float64 before its cast (`knn_sparse`'s sums): 0 where no neighbour votes."""
        width = max(1, max(len(it.neighbours) for it in items))
        logits = np.full((len(items), width), -np.inf)
        labels = np.full((len(items), width), vocab, dtype=np.int64)
        for i, it in enumerate(items):
            n = len(it.neighbours)
            if n:
                row = -np.asarray(it.neighbours.distances, dtype=np.float64) / it.temperature
                logits[i, :n] = row if it.offsets is None else row + it.offsets
                labels[i, :n] = it.neighbours.labels
        x = torch.from_numpy(logits).to(self.device)
        top = x.max(1, keepdim=True).values
        top = torch.where(torch.isfinite(top), top, 0.0)  # a question without neighbours: nothing votes
        log_z = top + torch.log(torch.exp(x - top).sum(1, keepdim=True))
        acc = torch.zeros(len(items), vocab + 1, dtype=torch.float64, device=self.device)
        acc.scatter_add_(1, torch.from_numpy(labels).to(self.device), torch.exp(x - log_z).nan_to_num(0.0))
        return acc[:, :vocab]


def _weigh(probs: torch.Tensor, pm: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """`weigh_vote` of each row (``probs`` float32 p_kNN, ``pm`` float32 p_MLM, ``prior`` [B, 1]): float32."""
    p64, pr64 = pm.double(), probs.double()
    total = pr64.sum(1, keepdim=True)
    w = pr64 * p64.pow(prior)
    mass = w.sum(1, keepdim=True)
    linear = (w * (total / mass)).float()
    voted = (probs > 0) & (pm > 0)
    logw = torch.where(voted, pr64.log() + prior * p64.log(), -torch.inf)
    wl = torch.exp(logw - logw.max(1, keepdim=True).values)
    in_logs = (wl * (total / wl.sum(1, keepdim=True))).float()
    in_logs = torch.where(voted.any(1, keepdim=True), in_logs, probs)
    fits = (mass > 1e-250) & torch.isfinite(mass)
    return torch.where(prior == 0, probs, torch.where(fits, linear, in_logs))


def _top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` largest values, most first, ties to the lower index (`bertknn.core.topk`)."""
    n = x.shape[1]
    kk = min(n, k + _SPARE)
    vals, idx = torch.topk(x, kk, dim=1)
    if kk < n and bool((vals[:, kk - 1] >= vals[:, k - 1]).any()):  # ties of the k-th past the candidates
        vals, idx = torch.sort(x, dim=1, descending=True, stable=True)
        return vals[:, :k], idx[:, :k]
    by_id = idx.sort(dim=1).indices
    idx, vals = idx.gather(1, by_id), vals.gather(1, by_id)
    order = torch.sort(vals, dim=1, descending=True, stable=True).indices[:, :k]
    return vals.gather(1, order), idx.gather(1, order)


def _voted(item: VoteInput, row: np.ndarray) -> Voted:
    """One question's rows of the batch's result, cut to its ``top_k`` and filtered as the host filters."""
    k = item.top_k
    ids = row[[0, 4, 6], :k].astype(np.int64).tolist()
    best_p, mlm_p, knn_p = row[1, :k].tolist(), row[5, :k].tolist(), row[7, :k].tolist()
    nonzero = not item.any_token  # (rankings that leave out the non-words list no zero)
    best = [(i, v) for i, v in zip(ids[0], best_p, strict=True) if not nonzero or v > 0]
    mlm = [(i, v) for i, v in zip(ids[1], mlm_p, strict=True) if not nonzero or v > 0]
    knn = [(i, v) for i, v in zip(ids[2], knn_p, strict=True) if v >= 0]  # -1: no neighbour's word
    n = len(best)
    return Voted(best, mlm, knn, row[2, :n].tolist(), row[3, :n].tolist(), item.lam)
