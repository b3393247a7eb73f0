"""A batch's vote, interpolation and top-k two ways, on any device::

    python -m bench.vote_batch [--device cpu|cuda] [--threads 1]

What ``model.vote_device: model`` runs (`DeviceVote.vote`: the whole batch in a few tensor operations on the
device, only the answers' ids and probabilities back) against what the host runs for each question after its
kNN (`TokenAnswerer.answer`, one question after another), in alternating calls, with bert-base-uncased's
vocabulary size, the service's 2,048 stored p_MLM entries and k = 128 neighbours over 3 articles: p50 ms per
batch of each, their ratio, and whether every question's answers agree (the same ids; probabilities within
1e-6). Contexts are not asked for: reading them is the same work on both sides. Writes
``bench/results/vote-batch-DEVICE.json``; on CUDA, ``python -m bench.gpu``'s ``device_vote`` stage runs it.
"""

from __future__ import annotations

import time

from bench.common import device_sync, device_timing_args, machine, write_result

VOCAB = 30522  # bert-base-uncased's


def _questions(rng, n: int, vocab: int, k: int):  # type: ignore[no-untyped-def]
    """``n`` random questions: encodings as the service keeps them, neighbours with repeated words over 3
    articles, and the query settings the service's defaults give."""
    import numpy as np

    from bertknn.service.codec import QueryEncoding
    from bertknn.service.results import ArticleHit, Query
    from bertknn.service.retrieval.knn import Neighbours

    arts = [ArticleHit("a", 14.0, "bm25"), ArticleHit("b", 11.0, "bm25"), ArticleHit("c", 6.0, "bm25")]
    out = []
    for _ in range(n):
        logits = rng.normal(size=vocab) * 3.0
        log_probs = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
        enc = QueryEncoding.from_log_probs(np.zeros(768, np.float32), log_probs, 2048)
        words = rng.integers(0, vocab, k // 4)
        nbrs = Neighbours(np.sort(rng.uniform(20, 90, k)).astype(np.float32), np.arange(k, dtype=np.int64),
                          rng.choice(words, k).astype(np.int32), rng.integers(0, 3, k).astype(np.int16))  # fmt: skip
        out.append((Query("q [MASK] .", temperature=6.0, return_contexts=False), enc, nbrs, arts))
    return out


def time_device_vote(batches: tuple[int, ...] = (1, 32), vocab: int = VOCAB, k: int = 128, calls: int = 20, *,
                     device: str = "cuda", seed: int = 0) -> dict[str, object]:  # fmt: skip
    """Per batch size: p50 ms of the batch vote on ``device`` and of the host's, one question after another;
    their ratio; whether every question's answers are the same."""
    import numpy as np
    import torch

    from bertknn.service.answer import ContextReader, TokenAnswerer, knn_offsets
    from bertknn.service.device_vote import DeviceVote, VoteInput

    rng = np.random.default_rng(seed)
    sync = device_sync(device)
    non_words = rng.random(vocab) < 0.1
    host = TokenAnswerer([str(i) for i in range(vocab)], ContextReader(None), non_words=non_words)  # type: ignore[arg-type]
    vote = DeviceVote(torch.device(device), non_words)
    out: dict[str, object] = {"vocab": vocab, "k": k, "stored_p_mlm": 2048, "device": device}
    for b in batches:
        qs = _questions(rng, b, vocab, k)
        items = [VoteInput.of(q, e, n, knn_offsets(q, n.article, a)) for q, e, n, a in qs]
        times: dict[str, list[float]] = {"device": [], "host": []}
        for _ in range(calls):
            sync()
            t = time.perf_counter()
            got = vote.vote(items)
            times["device"].append(1000 * (time.perf_counter() - t))
            t = time.perf_counter()
            want = [host.answer(q, e, a, n, with_distributions=False) for q, e, n, a in qs]
            times["host"].append(1000 * (time.perf_counter() - t))
        same = all([t for t, _ in g.best] == [p.token_id for p in w.predictions]
                   and np.allclose([v for _, v in g.best], [p.prob for p in w.predictions], rtol=1e-6, atol=0)
                   for g, w in zip(got, want, strict=True))  # fmt: skip
        p50 = {side: float(np.median(t)) for side, t in times.items()}
        out[f"batch_{b}"] = {"device_ms_p50": round(p50["device"], 3), "host_ms_p50": round(p50["host"], 3),
                             "device_over_host": round(p50["device"] / p50["host"], 3), "same_answers": same}  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    args = device_timing_args("python -m bench.vote_batch", __doc__, argv)
    result = {"machine": machine(), "threads": args.threads, **time_device_vote(calls=args.calls, device=args.device)}
    path = write_result(f"vote-batch-{args.device}", result)
    for key, r in result.items():
        if key.startswith("batch_"):
            print(f"{key}: on the device {r['device_ms_p50']} ms ({r['device_over_host']}x the host's), host "
                  f"{r['host_ms_p50']} ms; same answers: {r['same_answers']}")  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
