"""After a query's forward pass: p_MLM's head, its articles, the kNN and the answer, handed to its request."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from bertknn.core.inputs import MaskedInput
from bertknn.service.batching import Outbox
from bertknn.service.codec import QueryEncoding
from bertknn.service.device_vote import Voted
from bertknn.service.encoding import PendingEncoding
from bertknn.service.fair import FairExecutor
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Answer, ArticleHit, Query, Stage
from bertknn.service.retrieval.knn import ArticleSearch, Neighbours

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Retrieved:
    """A query's articles and their rows, made ready on the retrieval thread while the forward pass runs."""

    articles: tuple[list[ArticleHit], str]  # (articles, cache state), as `ArticleFinder.retrieve` returns them
    seconds: float  # the retrieval's
    cpu_seconds: float  # the retrieval's CPU on the thread that ran it (`Pace.retrieved`)
    search: ArticleSearch | None  # their rows, read and indexed for the kNN (`NeighbourFinder.prepare_search`)
    search_seconds: float

    def record(self, stage: Stage) -> None:
        stage.add("retrieval", self.seconds)
        stage.add("knn", self.search_seconds)  # reading the rows is the kNN's work, done ahead of it


@dataclass
class Job:
    """One query on its way through the batcher to the model thread."""

    inp: MaskedInput
    key: str  # its encoding's cache key (`QueryEncoder.key`)
    query: Query
    pipe: AnswerPipeline  # the datastore version the request holds
    stage: Stage
    submitted: float
    answered: asyncio.Future[Answer]  # on the event loop: the answer, from the model thread or the finisher
    # started on arrival when the model is busy, else by the model thread as the forward pass starts
    retrieval: Future[Retrieved] | None = None
    client: str = "-"  # who asked (the fair queues' turns)
    neighbours: Neighbours | None = None  # found with its batch on the model's device (`device_search`)
    voted: Voted | None = None  # its answers ranked with its batch on the model's device (`device_search`)

    def start_retrieval(
        self, executor: FairExecutor | None, *, prepare: bool = False, read: bool = True
    ) -> Future[Retrieved]:
        """Retrieve the query's articles on ``executor`` (once), or with None here and now; with ``prepare``, also
        find their rows for the kNN there, and with ``read`` read and index them. Only for a query that is the
        model's only one, or a batch searched on the device: it is answered right after its forward pass, while a
        queued query's rows (megabytes for long articles) would sit in memory until its turn."""
        if self.retrieval is None:
            pipe, query = self.pipe, self.query

            def retrieve() -> Retrieved:
                t0, cpu0 = time.perf_counter(), time.thread_time()
                articles = pipe.articles.retrieve(query)
                t1, cpu = time.perf_counter(), time.thread_time() - cpu0
                search = pipe.neighbours_of.prepare_search(query, articles[0], read=read) if prepare else None
                return Retrieved(articles, t1 - t0, cpu, search, time.perf_counter() - t1)

            if executor is None:
                self.retrieval = Future()
                try:
                    self.retrieval.set_result(retrieve())
                except Exception as exc:  # (its reader raises it, as from the retrieval thread)
                    self.retrieval.set_exception(exc)
            else:
                self.retrieval = executor.submit(retrieve, client=self.client)
        return self.retrieval


Work = tuple[Job, QueryEncoding | PendingEncoding, bool]  # a query after its forward pass (or cache hit)


def _quietly(fn: Callable[[], None]) -> None:
    """Run work nobody waits for (a cache write); a failure is logged, never raised."""
    try:
        fn()
    except Exception:
        logger.exception("deferred work failed")


def fills(job: Job) -> bool:
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

    Where it finishes a batch itself, the model thread also retrieves its queries' articles, instead of the
    retrieval thread (a hand-off each), while a retrieval's CPU is at most ``retrieve_margin`` times a query's
    finishing: a cheap retrieval gains nothing from a thread of its own, whose Python waits for the GIL anyway,
    where a long one (Lucene over a large index, in the JVM outside the GIL) overlaps the model thread's work.
    """

    def __init__(self, weight: float = 0.1, margin: float = 2.0, retrieve_margin: float = 1.0):
        self.weight = weight
        self.margin = margin
        self.retrieve_margin = retrieve_margin
        self.forward_s: float | None = None  # per query of a batch
        self.finish_s: float | None = None  # per query, without a retrieval made while finishing
        self.retrieval_cpu_s: float | None = None  # per query, on whichever thread retrieved it

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.weight * (new - old)

    def forward(self, seconds: float, queries: int) -> None:
        self.forward_s = self._mean(self.forward_s, seconds / max(1, queries))

    def finished(self, seconds: float, queries: int) -> None:
        if queries:
            self.finish_s = self._mean(self.finish_s, seconds / queries)

    def retrieved(self, cpu_seconds: float) -> None:
        self.retrieval_cpu_s = self._mean(self.retrieval_cpu_s, cpu_seconds)

    def finish_here(self) -> bool:
        if self.forward_s is None or self.finish_s is None:
            return True  # measured on the first batches
        return self.forward_s <= self.margin * self.finish_s

    def hit_on_loop(self) -> bool:
        """Whether a cache hit may be answered on the event loop (`Finisher.hit`): while a query's retrieval CPU and
        its finishing take on average no longer than the interpreter lets one thread hold the GIL before another
        may take it (`sys.getswitchinterval`), the loop is held no longer than a pool thread could hold it.
        Not before both are measured."""
        if self.finish_s is None or self.retrieval_cpu_s is None:
            return False
        return self.finish_s + self.retrieval_cpu_s <= sys.getswitchinterval()

    def retrieve_here(self) -> bool:
        """Whether the model thread retrieves the articles of the batches it finishes (on the retrieval thread
        until both are measured)."""
        if self.retrieval_cpu_s is None or self.finish_s is None:
            return False
        return self.finish_here() and self.retrieval_cpu_s <= self.retrieve_margin * self.finish_s


class Finisher:
    """Finishes queries after their forward pass (or an in-process cache hit), where `Pace` says: on the model
    thread that ran it, or in one hand-off per batch to ``pool``. A query whose retrieval has not ended is put
    back on ``pool`` when it ends; nobody waits behind it. Each answer goes to its request as soon as it is made
    (`Outbox`: one wake-up of the event loop for the answers made meanwhile)."""

    def __init__(self, retrieval: FairExecutor, pool: FairExecutor):
        self.retrieval = retrieval
        self.pool = pool
        self.pace = Pace()
        self._outbox: Outbox | None = None  # answers to the event loop (`start`)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._outbox = Outbox(loop)

    def submit(self, work: Sequence[Work], client: str = "-", *, retrieve_here: bool = False) -> None:
        """`finish_all` on the pool (a whole batch in one hand-off); ``retrieve_here``: as there."""
        self.pool.submit(partial(self.finish_all, retrieve_here=retrieve_here), work, client=client)

    def hit(self, job: Job, enc: QueryEncoding, *, here: bool = True) -> Answer | None:
        """A query whose encoding an in-process cache held: its answer made on this thread (the event loop's),
        or None when it went to the pool (it then comes through ``job.answered``).

        Made here (with ``here``) when its retrieval is this interpreter's own work and not the whole-datastore
        search, it runs no forward passes of its own (`fills`), and `Pace.hit_on_loop`: it then saves the two
        hand-offs, which cost more CPU than the answer (docs/decisions/serving-processes.md). Otherwise one
        hand-off, in which the pool also retrieves where a thread of its own would overlap nothing."""
        query = job.query
        in_process = job.pipe.articles.in_process(query)
        if here and in_process and query.retriever != "none" and not fills(job) and self.pace.hit_on_loop():
            t, retrieving = time.perf_counter(), [0.0]
            answer = self._finish_one(job, enc, True, [], retrieving)
            assert answer is not None, "a retrieval made here has ended"
            self.pace.finished(time.perf_counter() - t - retrieving[0], 1)
            return answer
        if query.interpolation != "adaptive" and not in_process:  # (an adaptive one may not need it)
            job.start_retrieval(self.retrieval)
        self.submit([(job, enc, True)], client=job.client, retrieve_here=in_process)
        return None

    def finish_all(
        self, work: Sequence[Work], stores: list[Callable[[], None]] | None = None, *, retrieve_here: bool = False
    ) -> None:
        """On the finisher (or the model thread, `Pace`): each query's rest (`_finish_one`), its answer handed to
        its request at once. ``stores``: where a remote cache's writes go (default: made at the end, here).
        ``retrieve_here``: a query whose retrieval has not started retrieves here (`Pace.retrieve_here`)."""
        assert self._outbox is not None, "start() first"
        later = stores is not None
        stores = stores if stores is not None else []
        t, made, retrieving = time.perf_counter(), 0, [0.0]
        for job, enc, hit in work:
            if job.answered.done():  # the request gave up (its deadline, the client gone): nothing to do
                continue
            try:
                answer = self._finish_one(job, enc, hit, stores, retrieving if retrieve_here else None)
                if answer is None:
                    continue  # back when its retrieval ends
                made += 1
                result: tuple[asyncio.Future[Any], Any, BaseException | None] = (job.answered, answer, None)
            except Exception as exc:  # that request's error, not its batch's
                result = (job.answered, None, exc)
            try:
                self._outbox.put([result])
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return
        self.pace.finished(time.perf_counter() - t - retrieving[0], made)
        if not later:
            for store in stores:  # a remote cache's writes, after the answers (nobody waits for them)
                _quietly(store)

    def _finish_one(
        self, job: Job, enc: QueryEncoding | PendingEncoding, hit: bool, stores: list[Callable[[], None]],
        retrieving: list[float] | None = None,
    ) -> Answer | None:
        """A query after its forward pass: p_MLM's head (unless kept already), its articles (unless an
        adaptive query's p_MLM is confident enough to skip them), the kNN and the answer. None: its retrieval has
        not ended on the retrieval thread; the query comes back here when it does (the finisher never waits for
        one, so nobody waits behind a slow retrieval).

        A query is finished once: its retrieval's record and answer are made on the pass that finds it done.
        ``retrieving``: retrieve here a query whose retrieval has not started, and add its seconds there."""
        pipe, query, stage = job.pipe, job.query, job.stage
        t = time.perf_counter()
        full = pipe.queries.complete(enc, defer_store=stores) if isinstance(enc, PendingEncoding) else enc
        stage.add("embedding", time.perf_counter() - t)
        articles, search = None, None
        if not pipe.assembler.skips_knn(query, full):
            here = retrieving is not None and job.retrieval is None
            got = job.start_retrieval(None if here else self.retrieval)
            if not got.done():  # back here when it ends
                got.add_done_callback(
                    lambda _: self.submit([(job, full, hit)], client=job.client)
                )
                return None
            retrieved = got.result()
            retrieved.record(stage)
            self.pace.retrieved(retrieved.cpu_seconds)
            if here and retrieving is not None:
                retrieving[0] += retrieved.seconds
            articles, search = retrieved.articles, retrieved.search
        return pipe.assembler.answer_from_encoding(
            query, full, "hit" if hit else "miss", stage, articles=articles, search=search, neighbours=job.neighbours,
            voted=job.voted, cut=job.inp.cut,
        )
