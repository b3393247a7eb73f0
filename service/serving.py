"""The async side of answering: micro-batched forward passes, retrieval overlapped with them, off the loop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

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
        self._leases: dict[int, int] = {}  # id(pipeline) -> requests holding it
        self._drained: dict[int, asyncio.Event] = {}
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

    @property
    def pipeline(self) -> AnswerPipeline:
        return self._pipeline

    @pipeline.setter
    def pipeline(self, pipeline: AnswerPipeline) -> None:
        # A whole-word pipeline runs extra forward passes (sequential fill) from the kNN pool: on the model thread.
        self._pipeline = pipeline
        words = getattr(pipeline, "words", None)
        if words is not None:
            words.run_model = lambda fn: self._model_thread.submit(fn).result()

    def _encode_batch(self, inputs: Sequence[MaskedInput]) -> list[tuple[QueryEncoding, bool]]:
        encs, hits = self.pipeline.encode(inputs)
        return list(zip(encs, hits, strict=True))

    def start(self) -> None:
        self.batcher.start()

    async def answer(
        self, query: Query, inp: MaskedInput | None = None, *, pipeline: AnswerPipeline | None = None
    ) -> Answer:
        """Answer one query; ``inp`` is its tokenised form when the caller already checked it.

        ``pipeline``: the datastore version to answer from (a `lease`); default the current one. Every stage of
        the query uses that one, even when a reload swaps ``self.pipeline`` meanwhile. (The batched forward pass
        runs through whichever is current: all versions share one encoder and one cache.)
        """
        loop = asyncio.get_running_loop()
        pipe = pipeline or self.pipeline
        if inp is None:
            inp = pipe.check_query(query)  # fast tokenisation; raises QueryError before queueing
        stage = Stage()
        t0 = time.perf_counter()

        async def embed() -> tuple[QueryEncoding, bool]:
            t = time.perf_counter()
            self.metrics.queue_depth.set(self.batcher.depth)
            result = await self.batcher.submit(inp)
            stage.add("embedding", time.perf_counter() - t)
            return result

        def retrieve() -> tuple[tuple[list, str], float]:
            t = time.perf_counter()
            return pipe.retrieve(query), time.perf_counter() - t

        # Retrieval (Lucene, its own thread) overlaps the queue wait and the forward pass. An adaptive query may
        # turn out not to need it (p_MLM confident): then nobody waits for it, and a retrieval still queued
        # behind others' is cancelled before it starts.
        retrieval = self._retrieval_thread.submit(retrieve)
        try:
            enc, hit = await embed()
            skip = query.interpolation == "adaptive" and await loop.run_in_executor(
                self._cpu_pool, pipe.skips_knn, query, enc
            )
            if skip:
                articles: tuple[list, str] = ([], "none")
            else:
                articles, seconds = await asyncio.wrap_future(retrieval)
                stage.add("retrieval", seconds)
            answer = await loop.run_in_executor(
                self._cpu_pool,
                lambda: pipe.finish(query, enc, "hit" if hit else "miss", stage, articles=articles),
            )
        finally:
            retrieval.cancel()  # a no-op once it has started
        if answer.knn_skipped:
            self.metrics.knn_skipped.inc()
        # stages overlap: total is the wall time, not their sum
        answer.timings_ms["total"] = round((time.perf_counter() - t0) * 1000.0, 3)
        for name, ms in answer.timings_ms.items():
            if name != "total":
                self.metrics.stage.labels(name).observe(ms / 1000.0)
        return answer

    async def answer_many(
        self, queries: Sequence[Query], inputs: Sequence[MaskedInput], *, pipeline: AnswerPipeline | None = None
    ) -> list[Answer]:
        pipe = pipeline or self.pipeline
        return list(
            await asyncio.gather(*(self.answer(q, x, pipeline=pipe) for q, x in zip(queries, inputs, strict=True)))
        )

    # ---- live reload: requests hold the pipeline they started on -------------------------------------------

    @contextmanager
    def lease(self) -> Iterator[AnswerPipeline]:
        """The current pipeline, held for the length of one request (event-loop side only).

        A reload assigns a new ``pipeline``; requests already holding the old one finish on it, and the old one
        is released only after `drained` says its last lease ended.
        """
        pipe = self.pipeline
        key = id(pipe)
        self._leases[key] = self._leases.get(key, 0) + 1
        try:
            yield pipe
        finally:
            left = self._leases[key] - 1
            if left:
                self._leases[key] = left
            else:
                del self._leases[key]
                event = self._drained.pop(key, None)
                if event is not None:
                    event.set()

    def in_flight(self, pipeline: AnswerPipeline) -> int:
        return self._leases.get(id(pipeline), 0)

    async def drained(self, pipeline: AnswerPipeline, timeout_s: float) -> bool:
        """Wait until no request holds ``pipeline``; False if some still do after ``timeout_s``."""
        if id(pipeline) not in self._leases:
            return True
        event = self._drained.setdefault(id(pipeline), asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        await self.batcher.stop()
        for pool in (self._model_thread, self._retrieval_thread, self._cpu_pool):
            pool.shutdown(wait=True)
