"""What the model's process spends on a shard's contexts besides the forward: receiving them from a worker
process (unpickling) and cutting them into padded batches, as objects (one `MaskedInput` each) against packed
arrays (`PackedInputs`)::

    python -m bench.handover            # real contexts: vital leads with bert-base-uncased's tokenizer

The contexts are prepared once by the builder's own `ShardPreparer` (real sentences, real target selection) and
repeated to ``--rows`` (distinct objects). A worker process (spawned, as the builder's are) holds both forms and
returns one on request; the receiving is timed as this process's CPU time around the future's result (what it
spends unpickling, not the worker's side). Both forms on the same rows, best of ``--runs``. No forward runs: on a
GPU the model's process has about rows / (contexts/s) seconds for all of this per shard.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from itertools import islice
from multiprocessing import get_context

import numpy as np

from bench.common import SHARED, machine, write_result
from bertknn.builder.corpus import Article
from bertknn.builder.embed import token_batches
from bertknn.builder.prepare import ShardPreparer
from bertknn.builder.targets import load_stopwords
from bertknn.core.inputs import MaskedInput, PackedInputs

VITAL = SHARED / "data" / "wiki" / "vital_articles.jsonl"
TOKENIZER = SHARED / "data" / "tokenizer" / "bert-base-uncased"


def _pad(items: list[MaskedInput]) -> np.ndarray:
    """The encoder's padding of a list of objects (`MaskedLMEncoder._arrays`)."""
    width = max(len(x.input_ids) for x in items)
    ids = np.zeros((len(items), width), dtype=np.int64)
    for i, x in enumerate(items):
        ids[i, : len(x.input_ids)] = x.input_ids
    return ids


def _best(fn: Callable[[], object], runs: int, clock: Callable[[], float] = time.perf_counter) -> float:
    times = []
    for _ in range(runs):
        t = clock()
        fn()
        times.append(clock() - t)
    return min(times)


_HELD: dict[str, object] = {}


def _hold(packed: PackedInputs) -> None:
    """Worker initializer: both forms of the same contexts, the objects distinct as a worker makes them."""
    _HELD["packed"] = packed
    _HELD["objects"] = [MaskedInput(tuple(x.input_ids), x.mask_pos) for x in packed]


def _send(kind: str) -> object:
    return _HELD[kind]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.handover", description=__doc__.splitlines()[0])
    p.add_argument("--articles", type=int, default=200, help="vital leads prepared")
    p.add_argument("--rows", type=int, default=100_000, help="contexts per shard (the builder's default part)")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in islice(VITAL.open(encoding="utf-8"), args.articles)]
    prep = ShardPreparer(str(TOKENIZER), 128, load_stopwords(), 10)
    shard = prep.prepare(0, [Article(str(i), r["title"], r["text"], "vital.jsonl") for i, r in enumerate(rows)])
    real = list(shard.inputs)
    objects = [MaskedInput(tuple(list(x.input_ids)), x.mask_pos) for x in (real * (args.rows // len(real) + 1))[: args.rows]]
    packed = PackedInputs.of(objects)
    order = np.argsort(packed.lengths, kind="stable")
    cuts = token_batches(packed.lengths[order].tolist(), args.batch_size, None)

    def batches_objects() -> None:
        for a, b in cuts:
            _pad([objects[i] for i in order[a:b].tolist()])

    def batches_packed() -> None:
        for a, b in cuts:
            packed.take(order[a:b]).padded(0)

    with ProcessPoolExecutor(1, mp_context=get_context("spawn"), initializer=_hold, initargs=(packed,)) as pool:
        pool.submit(_send, "packed").result()  # the worker is up

        def receive(kind: str) -> float:
            return _best(lambda: pool.submit(_send, kind).result(), args.runs, time.process_time)

        received = {"objects": receive("objects"), "packed": receive("packed")}
    timings = {
        "unpickle_objects_s": received["objects"],
        "unpickle_packed_s": received["packed"],
        "batches_objects_s": _best(batches_objects, args.runs),
        "batches_packed_s": _best(batches_packed, args.runs),
    }
    total_objects = timings["unpickle_objects_s"] + timings["batches_objects_s"]
    total_packed = timings["unpickle_packed_s"] + timings["batches_packed_s"]
    result = {
        "machine": machine(), "rows": args.rows, "distinct_contexts": len(real), "batch_size": args.batch_size,
        **{k: round(v, 4) for k, v in timings.items()},
        "objects_over_packed": round(total_objects / total_packed, 2),
    }  # fmt: skip
    path = write_result("handover", result)
    print(f"{args.rows:,} contexts: objects {total_objects:.3f} s (unpickle {timings['unpickle_objects_s']:.3f}, "
          f"batches {timings['batches_objects_s']:.3f}), packed {total_packed:.3f} s (unpickle "
          f"{timings['unpickle_packed_s']:.3f}, batches {timings['batches_packed_s']:.3f}): "
          f"{result['objects_over_packed']}x; wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
