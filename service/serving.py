"""The async side of answering: micro-batched forward passes, retrieval overlapped with them, off the loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from datastore_builder.encoder import MaskedInput
from service.batching import MicroBatcher
from service.codec import QueryEncoding
from service.metrics import Metrics
from service.pipeline import Answer, AnswerPipeline, Query, Stage
from service.settings import BatchingSettings


class AsyncAnswerer:
    """Runs an `AnswerPipeline` for the web layer.

    The model runs in one dedicated thread fed by a `MicroBatcher`; the sparse retrievers (Lucene through
    the JVM) run in another single thread; kNN and interpolation run in a small pool. The event loop only
    awaits.
    """

    def __init__(
        self,
        pipeline: AnswerPipeline,
        batching: BatchingSettings,
        metrics: Metrics,
        *,
        model_thread: ThreadPoolExecutor | None = None,
    ):
        self.pipeline = pipeline
        self.metrics = metrics
        # Every torch call must come from this one thread (the model was loaded on it too): each OS thread that
        # calls torch gets its own OpenMP team, and two spinning teams on few cores halve the forward's speed.
        self._model_thread = model_thread or ThreadPoolExecutor(1, thread_name_prefix="model")
        self._retrieval_thread = ThreadPoolExecutor(1, thread_name_prefix="retrieval")
        self._cpu_pool = ThreadPoolExecutor(2, thread_name_prefix="knn")
        self.batcher: MicroBatcher[MaskedInput, tuple[QueryEncoding, bool]] = MicroBatcher(
            self._encode_batch,
            executor=self._model_thread,
            max_batch_size=batching.max_batch_size,
            max_wait_ms=batching.max_wait_ms,
            max_queue=batching.max_queue,
            on_batch=lambda n, s: metrics.batch_size.observe(n),
        )

    def _encode_batch(self, inputs: Sequence[MaskedInput]) -> list[tuple[QueryEncoding, bool]]:
        encs, hits = self.pipeline.encode(inputs)
        return list(zip(encs, hits, strict=True))

    def start(self) -> None:
        self.batcher.start()

    async def answer(self, query: Query, inp: MaskedInput | None = None) -> Answer:
        """Answer one query; ``inp`` is its tokenised form when the caller already checked it."""
        loop = asyncio.get_running_loop()
        if inp is None:
            inp = self.pipeline.check_query(query)  # fast tokenisation; raises QueryError before queueing
        stage = Stage()
        t0 = time.perf_counter()

        async def embed() -> tuple[QueryEncoding, bool]:
            t = time.perf_counter()
            self.metrics.queue_depth.set(self.batcher.depth)
            result = await self.batcher.submit(inp)
            stage.add("embedding", time.perf_counter() - t)
            return result

        def retrieve() -> tuple[list, str]:
            t = time.perf_counter()
            out = self.pipeline.retrieve(query)
            stage.add("retrieval", time.perf_counter() - t)
            return out

        # retrieval (Lucene, its own thread) overlaps the queue wait and the forward pass
        (enc, hit), articles = await asyncio.gather(embed(), loop.run_in_executor(self._retrieval_thread, retrieve))
        answer = await loop.run_in_executor(
            self._cpu_pool,
            lambda: self.pipeline.finish(query, enc, "hit" if hit else "miss", stage, articles=articles),
        )
        # stages overlap: total is the wall time, not their sum
        answer.timings_ms["total"] = round((time.perf_counter() - t0) * 1000.0, 3)
        for name, ms in answer.timings_ms.items():
            if name != "total":
                self.metrics.stage.labels(name).observe(ms / 1000.0)
        return answer

    async def answer_many(self, queries: Sequence[Query], inputs: Sequence[MaskedInput]) -> list[Answer]:
        return list(await asyncio.gather(*(self.answer(q, x) for q, x in zip(queries, inputs, strict=True))))

    async def stop(self) -> None:
        await self.batcher.stop()
        for pool in (self._model_thread, self._retrieval_thread, self._cpu_pool):
            pool.shutdown(wait=True)
