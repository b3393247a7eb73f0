"""The async side of answering: micro-batched forward passes, retrieval overlapped with them, off the loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from functools import partial

from bertknn.core.inputs import MaskedInput
from bertknn.core.libc import name_os_thread
from bertknn.service.batching import MicroBatcher
from bertknn.service.device_search import OnDeviceWork
from bertknn.service.device_vote import DeviceVote
from bertknn.service.fair import FairExecutor, client_var
from bertknn.service.finishing import Finisher, Job, Work, fills
from bertknn.service.leases import Leases
from bertknn.service.metrics import Metrics
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Answer, Query, Stage
from bertknn.service.retrieval.device_knn import DeviceKnn
from bertknn.service.settings import BatchingSettings

logger = logging.getLogger(__name__)


class AsyncAnswerer:
    """Runs an `AnswerPipeline` for the web layer.

    The model runs in one dedicated thread fed by a `MicroBatcher` (or, with ``batching.on_event_loop``, on the
    event loop's thread); the sparse retrievers (Lucene through the JVM) run in another single thread; the rest
    of each query runs where the `Finisher` says, and each answer goes straight to its waiting request. Every
    hand-off between threads costs both sides the GIL; so one per batch where it can, one per request where it
    must (docs/decisions/serving-processes.md).
    """

    def __init__(
        self,
        pipeline: AnswerPipeline,
        batching: BatchingSettings,
        metrics: Metrics,
        *,
        model_thread: ThreadPoolExecutor | None = None,
        device_knn: DeviceKnn | None = None,
        device_vote: DeviceVote | None = None,
    ):
        self.pipeline = pipeline
        self.metrics = metrics
        self.leases: Leases[AnswerPipeline] = Leases()
        # Every torch call must come from this one thread (the model was loaded on it too): each OS thread that
        # calls torch gets its own OpenMP team, and two spinning teams on few cores halve the forward's speed.
        # (With ``batching.on_event_loop`` the loop's thread makes them once start-up has loaded the model here:
        # one team at work at a time.)
        self._model_thread = model_thread or ThreadPoolExecutor(1, thread_name_prefix="model", initializer=name_os_thread)
        # retrieval and kNN take turns between clients: one client's flood waits behind itself (`fair`)
        self._retrieval_thread = FairExecutor(1, "retrieval")
        # two: a query whose fill passes wait for the model (whole words, entity names) never holds up the answers
        # of others; where batches are finished on the model thread (`Pace`), they mostly idle
        self._cpu_pool = FairExecutor(2, "knn")
        self.finisher = Finisher(self._retrieval_thread, self._cpu_pool)
        # a batch's kNN on the model's device after its forward, and its vote there after the kNN (`device_search`)
        self.on_device = None if device_knn is None else OnDeviceWork(device_knn, device_vote, metrics)
        self.batcher: MicroBatcher[Job, None] = MicroBatcher(
            self._encode_batch,
            executor=None if batching.on_event_loop else self._model_thread,
            max_batch_size=batching.max_batch_size,
            max_wait_ms=batching.max_wait_ms,
            max_queue=batching.max_queue,
            on_batch=lambda n, s: metrics.batch_size.observe(n),
            after_delivery=self._store_encodings,
            key=lambda job: job.client,
        )
        self._deferred: list[Callable[[], None]] = []  # cache writes of the last batch (model thread only)

    @property
    def device_knn(self) -> DeviceKnn | None:
        return None if self.on_device is None else self.on_device.knn

    @property
    def pipeline(self) -> AnswerPipeline:
        return self._pipeline

    @pipeline.setter
    def pipeline(self, pipeline: AnswerPipeline) -> None:
        # Whole-word and entity answers run extra forward passes (fill) from the kNN pool: on the model thread,
        # which the batcher's loop occupies, so they go through it.
        self._pipeline = pipeline
        for words in pipeline.fill_answerers():
            words.fill.run_model = lambda fn: self.batcher.call(fn).result()
            words.fill.others_waiting = lambda: self.batcher.depth > 0

    def _encode_batch(self, jobs: Sequence[Job]) -> list[None]:
        # Retrieval (Lucene, its own thread) runs during this batch's forward pass. For a query that found the
        # model idle it starts here rather than when the request came in: the Python half of a retrieval then
        # waits for the GIL while the forward runs outside it, instead of delaying the forward's start. A query
        # that had to wait started it on arrival. Each answer goes to its request's `answered` future as soon as
        # it is made, here or by the finisher pool.
        idle = len(jobs) == 1 and self.batcher.depth == 0  # (read from this thread: a hint, not a promise)
        # (with the kNN on the device, every query's rows are found next to its retrieval; read there unless the
        # device keeps them)
        knn = self.device_knn
        # (or, where `Pace` says so, the model thread retrieves while it finishes the batch)
        here = [not idle and self._retrieves_on_model_thread(job) for job in jobs]
        for job, mine in zip(jobs, here, strict=True):
            if not mine:
                job.start_retrieval(self._retrieval_thread, prepare=idle or knn is not None,
                                    read=knn is None or knn.reads_rows)  # fmt: skip
        voted_there = self.on_device is not None and self.on_device.vote is not None  # (it needs the batch's heads)
        t = time.perf_counter()
        encs, hits = self.pipeline.queries.forward(
            [j.inp for j in jobs], defer_store=self._deferred, keys=[j.key for j in jobs],
            defer_heads=not idle and not voted_there,
            missed=True,  # each was looked up in an in-process cache as it came in (`answer`)
        )
        now = time.perf_counter()
        self.finisher.pace.forward(now - t, len(jobs))
        for job in jobs:
            job.stage.add("embedding", now - job.submitted)
        if self.on_device is not None:
            self.on_device.after_forward(jobs, encs)
            # rows of a datastore not all on the device yet: a step of them once this batch's answers are out
            self._deferred.append(partial(self.on_device.keep_rows, jobs))
        # A query alone with an idle model is finished here, saving the hand-offs; a batch where `Pace` says so.
        # Whole-word and entity answers run forward passes of their own through this thread: never here.
        inline = idle or self.finisher.pace.finish_here()
        work: list[Work] = list(zip(jobs, encs, hits, strict=True))
        there = [w for w in work if not inline or fills(w[0])]
        if there:  # one hand-off for the batch
            self.finisher.submit(there)
        if len(there) < len(work):
            self.finisher.finish_all(
                [w for w in work if inline and not fills(w[0])], stores=self._deferred, retrieve_here=any(here)
            )
        return [None] * len(jobs)

    def _retrieves_on_model_thread(self, job: Job) -> bool:
        """Whether the model thread retrieves the query's articles as it finishes its batch (`Pace.retrieve_here`):
        a retrieval that is all this interpreter's work (`ArticleFinder.in_process`), and never with the kNN on
        the device, whose rows are found next to the retrieval."""
        if self.device_knn is not None or not self.finisher.pace.retrieve_here():
            return False
        return job.pipe.articles.in_process(job.query)

    def _store_encodings(self) -> None:
        """After a batch's answers went out: its new encodings into the cache (on the model thread)."""
        while self._deferred:
            self._deferred.pop()()

    def start(self) -> None:
        self.finisher.start(asyncio.get_running_loop())
        self.batcher.start()

    async def answer(
        self, query: Query, inp: MaskedInput | None = None, *, pipeline: AnswerPipeline | None = None,
        hit_here: bool = True,
    ) -> Answer:
        """Answer one query; ``inp`` is its tokenised form when the caller already checked it.

        ``pipeline``: the datastore version to answer from (a `lease`); default the current one. Every stage of
        the query uses that one, even when a reload swaps ``self.pipeline`` meanwhile. (The batched forward pass
        runs through whichever is current: all versions share one encoder and one cache.) ``hit_here``: an
        in-process cache hit may be finished on the event loop (`Finisher.hit`).
        """
        pipe = pipeline or self.pipeline
        if inp is None:
            inp = pipe.check_query(query)  # fast tokenisation; raises QueryError before queueing
        stage = Stage()
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        job = Job(inp, pipe.queries.key(inp), query, pipe, stage, t0, loop.create_future(), client=client_var.get())
        try:
            # A repeated query found in an in-process cache skips the batcher: it never waits behind a forward.
            cached = pipe.queries.local_encoding(job.key)
            if cached is not None:
                stage.add("embedding", time.perf_counter() - t0)
                answer = self.finisher.hit(job, cached, here=hit_here) or await job.answered
            else:
                self.metrics.queue_depth.set(self.batcher.depth)
                # it will wait for the model: retrieve meanwhile (see `_encode_batch`), unless the model thread will
                if self.batcher.busy and not self._retrieves_on_model_thread(job):
                    job.start_retrieval(self._retrieval_thread)
                await self.batcher.submit(job)  # its forward pass; the answer comes through `answered`
                answer = await job.answered
        finally:
            # A request that gave up is skipped by the finisher; an adaptive query may turn out not to need its
            # retrieval (p_MLM confident): one still queued behind others' is cancelled before it starts.
            job.answered.cancel()
            if job.retrieval is not None:
                job.retrieval.cancel()
        # stages overlap: total is the wall time, not their sum
        answer.timings_ms["total"] = round((time.perf_counter() - t0) * 1000.0, 3)
        self.metrics.observe_answer(answer)
        return answer

    async def answer_many(
        self, queries: Sequence[Query], inputs: Sequence[MaskedInput], *, pipeline: AnswerPipeline | None = None
    ) -> list[Answer]:
        pipe = pipeline or self.pipeline
        return list(
            # (each cache hit to the finisher: on the loop, a batch's hits would hold it for all of them)
            await asyncio.gather(*(self.answer(q, x, pipeline=pipe, hit_here=False)
                                   for q, x in zip(queries, inputs, strict=True)))  # fmt: skip
        )

    async def fill_names(
        self, pipe: AnswerPipeline, requests: Sequence[tuple[str, Sequence[str]]], deadline: float | None
    ) -> list[list[float]]:
        """Entity names of several questions scored in one fill pass (`AnswerPipeline.fill_names`): from the
        pool, its forward pass on the model thread."""
        return await asyncio.wrap_future(self._cpu_pool.submit(pipe.fill_names, requests, deadline))

    # ---- live reload: requests hold the pipeline they started on -------------------------------------------

    def lease(self) -> AbstractContextManager[AnswerPipeline]:
        """The current pipeline, held for the length of one request (`Leases`: a reload swaps ``self.pipeline``,
        and requests already holding the old one finish on it)."""
        return self.leases.hold(self.pipeline)

    async def stop(self) -> None:
        await self.batcher.stop()
        self._model_thread.shutdown(wait=True)
        for pool in (self._retrieval_thread, self._cpu_pool):
            pool.shutdown(wait=True)
