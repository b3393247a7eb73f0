"""The async side of answering: micro-batched forward passes, retrieval overlapped with them, off the loop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from bertknn.core.inputs import MaskedInput
from bertknn.service.batching import MicroBatcher, deliver
from bertknn.service.codec import QueryEncoding
from bertknn.service.encoding import PendingEncoding
from bertknn.service.fair import FairExecutor, client_var
from bertknn.service.metrics import Metrics
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Answer, ArticleHit, Query, Stage
from bertknn.service.retrieval.knn import ArticleSearch
from bertknn.service.settings import BatchingSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Retrieved:
    """A query's articles and their rows, made ready on the retrieval thread while the forward pass runs."""

    articles: tuple[list[ArticleHit], str]  # (articles, cache state), as `AnswerPipeline.retrieve` returns them
    seconds: float  # the retrieval's
    search: ArticleSearch | None  # their rows, read and indexed for the kNN (`AnswerPipeline.prepare_search`)
    search_seconds: float

    def record(self, stage: Stage) -> None:
        stage.add("retrieval", self.seconds)
        stage.add("knn", self.search_seconds)  # reading the rows is the kNN's work, done ahead of it


@dataclass
class _Job:
    """One query on its way through the batcher to the model thread."""

    inp: MaskedInput
    key: str  # its encoding's cache key (`AnswerPipeline.encoding_key`)
    query: Query
    pipe: AnswerPipeline  # the datastore version the request holds
    stage: Stage
    submitted: float
    answered: asyncio.Future[Answer]  # on the event loop: the answer, from the model thread or the finisher
    # started on arrival when the model is busy, else by the model thread as the forward pass starts
    retrieval: Future[_Retrieved] | None = None
    client: str = "-"  # who asked (the fair queues' turns)

    def start_retrieval(self, executor: FairExecutor, *, prepare: bool = False) -> Future[_Retrieved]:
        """Retrieve the query's articles on ``executor`` (once); with ``prepare``, also read and index their rows
        for the kNN there. Only for a query that is the model's only one: it is answered right after its forward
        pass, while a queued query's rows (megabytes for long articles) would sit in memory until its turn."""
        if self.retrieval is None:
            pipe, query = self.pipe, self.query

            def retrieve() -> _Retrieved:
                t0 = time.perf_counter()
                articles = pipe.retrieve(query)
                t1 = time.perf_counter()
                search = pipe.prepare_search(query, articles[0]) if prepare else None
                return _Retrieved(articles, t1 - t0, search, time.perf_counter() - t1)

            self.retrieval = executor.submit(retrieve, client=self.client)
        return self.retrieval


_Work = tuple[_Job, QueryEncoding | PendingEncoding, bool]  # a query after its forward pass (or cache hit)


def _quietly(fn: Callable[[], None]) -> None:
    """Run work nobody waits for (a cache write); a failure is logged, never raised."""
    try:
        fn()
    except Exception:
        logger.exception("deferred work failed")


def _fills(job: _Job) -> bool:
    """Whether the query runs forward passes of its own after its first (whole words, entity names)."""
    return job.pipe.words is not None or job.query.answer == "entity"


class Pace:
    """Where a batch's queries are finished after their forward pass: on the model thread itself, or handed to
    the finisher pool so that the next forward overlaps them.

    A hand-off costs both threads the GIL (measured: more CPU per query than the finishing itself on a machine
    whose forward is cheap), and it gains only where the forward takes longer than what it would overlap. So the
    model thread finishes a batch itself unless its forward per query takes more than ``margin`` times as long as
    finishing one (bert-base on a CPU: about 20 times), and then hands it off. The margin keeps the choice from
    locking itself in: handed-off batches stay small, and a small batch's forward costs more per query.
    Both are running means of this process's own batches (docs/decisions/serving-processes.md).
    """

    def __init__(self, weight: float = 0.1, margin: float = 2.0):
        self.weight = weight
        self.margin = margin
        self.forward_s: float | None = None  # per query of a batch
        self.finish_s: float | None = None  # per query

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def forward(self, seconds: float, queries: int) -> None:
        self.forward_s = self._mean(self.forward_s, seconds / max(1, queries))

    def finished(self, seconds: float, queries: int) -> None:
        if queries:
            self.finish_s = self._mean(self.finish_s, seconds / queries)

    def finish_here(self) -> bool:
        if self.forward_s is None or self.finish_s is None:
            return True  # measured on the first batches
        return self.forward_s <= self.margin * self.finish_s


class AsyncAnswerer:
    """Runs an `AnswerPipeline` for the web layer.

    The model runs in one dedicated thread fed by a `MicroBatcher`; the sparse retrievers (Lucene through
    the JVM) run in another single thread; the rest of each query (p_MLM's head, kNN, interpolation, the
    answer) runs on the model thread or in a small finisher pool, which takes a whole batch from the model at
    once (`Pace`), and each answer goes straight to its waiting request. The event loop only awaits. When the model has nothing else to do (a batch
    of one, nobody queued), the model thread finishes the query itself, saving the hand-offs.

    Every hand-off between threads costs both sides the GIL; so one per batch where it can, one per request
    where it must (docs/decisions/serving-processes.md).
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
        # retrieval and kNN take turns between clients: one client's flood waits behind itself (`fair`)
        self._retrieval_thread = FairExecutor(1, "retrieval")
        # two: a query whose fill passes wait for the model (whole words, entity names) never holds up the answers
        # of others; where batches are finished on the model thread (`Pace`), they mostly idle
        self._cpu_pool = FairExecutor(2, "knn")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.pace = Pace()
        self.batcher: MicroBatcher[_Job, None] = MicroBatcher(
            self._encode_batch,
            executor=self._model_thread,
            max_batch_size=batching.max_batch_size,
            max_wait_ms=batching.max_wait_ms,
            max_queue=batching.max_queue,
            on_batch=lambda n, s: metrics.batch_size.observe(n),
            after_delivery=self._store_encodings,
            key=lambda job: job.client,
        )
        self._deferred: list[Callable[[], None]] = []  # cache writes of the last batch (model thread only)

    @property
    def pipeline(self) -> AnswerPipeline:
        return self._pipeline

    @pipeline.setter
    def pipeline(self, pipeline: AnswerPipeline) -> None:
        # Whole-word and entity answers run extra forward passes (fill) from the kNN pool: on the model thread,
        # which the batcher's loop occupies, so they go through it.
        self._pipeline = pipeline
        for words in pipeline.fill_answerers():
            words.run_model = lambda fn: self.batcher.call(fn).result()
            words.others_waiting = lambda: self.batcher.depth > 0

    def _encode_batch(self, jobs: Sequence[_Job]) -> list[None]:
        # Retrieval (Lucene, its own thread) runs during this batch's forward pass. For a query that found the
        # model idle it starts here rather than when the request came in: the Python half of a retrieval then
        # waits for the GIL while the forward runs outside it, instead of delaying the forward's start. A query
        # that had to wait started it on arrival. Each answer goes to its request's `answered` future as soon as
        # it is made, here or by the finisher pool.
        idle = len(jobs) == 1 and self.batcher.depth == 0  # (read from this thread: a hint, not a promise)
        for job in jobs:
            job.start_retrieval(self._retrieval_thread, prepare=idle)
        t = time.perf_counter()
        encs, hits = self.pipeline.queries.forward(
            [j.inp for j in jobs], defer_store=self._deferred, defer_heads=not idle, keys=[j.key for j in jobs],
            missed=True,  # each was looked up in an in-process cache as it came in (`answer`)
        )
        now = time.perf_counter()
        self.pace.forward(now - t, len(jobs))
        for job in jobs:
            job.stage.add("embedding", now - job.submitted)
        # A query alone with an idle model is finished here, saving the hand-offs; a batch where `Pace` says so.
        # Whole-word and entity answers run forward passes of their own through this thread: never here.
        inline = idle or self.pace.finish_here()
        work: list[_Work] = list(zip(jobs, encs, hits, strict=True))
        there = [w for w in work if not inline or _fills(w[0])]
        if there:  # one hand-off for the batch
            self._cpu_pool.submit(self._finish_all, there, client="-")
        if len(there) < len(work):
            self._finish_all([w for w in work if inline and not _fills(w[0])], stores=self._deferred)
        return [None] * len(jobs)

    def _store_encodings(self) -> None:
        """After a batch's answers went out: its new encodings into the cache (on the model thread)."""
        while self._deferred:
            self._deferred.pop()()

    def _finish_all(self, work: Sequence[_Work], stores: list[Callable[[], None]] | None = None) -> None:
        """On the finisher (or the model thread, `Pace`): each query's rest (`_finish_one`), its answer handed to
        its request at once. ``stores``: where a remote cache's writes go (default: made at the end, here)."""
        assert self._loop is not None
        later = stores is not None
        stores = stores if stores is not None else []
        t, made = time.perf_counter(), 0
        for job, enc, hit in work:
            if job.answered.done():  # the request gave up (its deadline, the client gone): nothing to do
                continue
            try:
                answer = self._finish_one(job, enc, hit, stores)
                if answer is None:
                    continue  # back when its retrieval ends
                made += 1
                result: tuple[asyncio.Future[Any], Any, BaseException | None] = (job.answered, answer, None)
            except Exception as exc:  # that request's error, not its batch's
                result = (job.answered, None, exc)
            try:
                self._loop.call_soon_threadsafe(deliver, [result])
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return
        self.pace.finished(time.perf_counter() - t, made)
        if not later:
            for store in stores:  # a remote cache's writes, after the answers (nobody waits for them)
                _quietly(store)

    def _finish_one(
        self, job: _Job, enc: QueryEncoding | PendingEncoding, hit: bool, stores: list[Callable[[], None]]
    ) -> Answer | None:
        """A query after its forward pass: p_MLM's head (unless kept already), its articles (unless an
        adaptive query's p_MLM is confident enough to skip them), the kNN and the answer. None: its retrieval has
        not ended on the retrieval thread; the query comes back here when it does (the finisher never waits for
        one, so nobody waits behind a slow retrieval).

        A query is finished once: its retrieval's record and answer are made on the pass that finds it done."""
        pipe, query, stage = job.pipe, job.query, job.stage
        t = time.perf_counter()
        full = pipe.queries.complete(enc, defer_store=stores) if isinstance(enc, PendingEncoding) else enc
        stage.add("embedding", time.perf_counter() - t)
        articles, search = None, None
        if not pipe.skips_knn(query, full):
            got = job.start_retrieval(self._retrieval_thread)
            if not got.done():  # back here when it ends
                got.add_done_callback(
                    lambda _: self._cpu_pool.submit(self._finish_all, [(job, full, hit)], client=job.client)
                )
                return None
            retrieved = got.result()
            retrieved.record(stage)
            articles, search = retrieved.articles, retrieved.search
        return pipe.answer_from_encoding(query, full, "hit" if hit else "miss", stage, articles=articles, search=search)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.batcher.start()

    async def answer(
        self, query: Query, inp: MaskedInput | None = None, *, pipeline: AnswerPipeline | None = None
    ) -> Answer:
        """Answer one query; ``inp`` is its tokenised form when the caller already checked it.

        ``pipeline``: the datastore version to answer from (a `lease`); default the current one. Every stage of
        the query uses that one, even when a reload swaps ``self.pipeline`` meanwhile. (The batched forward pass
        runs through whichever is current: all versions share one encoder and one cache.)
        """
        pipe = pipeline or self.pipeline
        if inp is None:
            inp = pipe.check_query(query)  # fast tokenisation; raises QueryError before queueing
        stage = Stage()
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        job = _Job(inp, pipe.queries.key(inp), query, pipe, stage, t0, loop.create_future(), client=client_var.get())
        try:
            # A repeated query found in an in-process cache skips the batcher: it never waits behind a forward.
            cached = pipe.queries.local_encoding(job.key)
            if cached is not None:
                stage.add("embedding", time.perf_counter() - t0)
                if query.interpolation != "adaptive":  # (an adaptive one may not need it: its p_MLM decides)
                    job.start_retrieval(self._retrieval_thread)
                self._cpu_pool.submit(self._finish_all, [(job, cached, True)], client=job.client)
            else:
                self.metrics.queue_depth.set(self.batcher.depth)
                if self.batcher.busy:  # it will wait for the model: retrieve meanwhile (see `_encode_batch`)
                    job.start_retrieval(self._retrieval_thread)
                await self.batcher.submit(job)  # its forward pass; the answer comes through `answered`
            answer = await job.answered
        finally:
            # A request that gave up is skipped by the finisher; an adaptive query may turn out not to need its
            # retrieval (p_MLM confident): one still queued behind others' is cancelled before it starts.
            job.answered.cancel()
            if job.retrieval is not None:
                job.retrieval.cancel()
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

    async def fill_names(
        self, pipe: AnswerPipeline, requests: Sequence[tuple[str, Sequence[str]]], deadline: float | None
    ) -> list[list[float]]:
        """Entity names of several questions scored in one fill pass (`AnswerPipeline.fill_names`): from the
        pool, its forward pass on the model thread."""
        return await asyncio.wrap_future(self._cpu_pool.submit(pipe.fill_names, requests, deadline))

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
        self._model_thread.shutdown(wait=True)
        for pool in (self._retrieval_thread, self._cpu_pool):
            pool.shutdown(wait=True)
