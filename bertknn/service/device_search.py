"""A batch's restricted kNN on the model's device, right after its forward pass (``model.knn_device: model``),
and with ``model.vote_device: model`` its vote there too (`vote_batch`).

For each query of the batch whose articles are known by then and whose rows are float16, the rows are searched
together in one batched pass (`DeviceKnn`); the neighbours ride on the query's `Job` to its finishing, which
then skips its own search. A query left out (its retrieval still running, a datastore with a codec, retriever
``none``, adaptive interpolation, which may skip the kNN) is searched on the host as before; so is every query
of a batch whose device search failed. Runs on the model thread: every torch call of the service comes from that
one thread (`AsyncAnswerer`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bertknn.service.answer import knn_offsets
from bertknn.service.assemble import AnswerAssembler
from bertknn.service.codec import QueryEncoding
from bertknn.service.device_vote import DeviceVote, VoteInput
from bertknn.service.encoding import PendingEncoding
from bertknn.service.finishing import Job
from bertknn.service.metrics import Metrics
from bertknn.service.results import ArticleHit, Query
from bertknn.service.retrieval.device_knn import DeviceKnn
from bertknn.service.retrieval.knn import ArticleSearch, Neighbours
from bertknn.service.retrieval.resident_rows import STEP_BYTES

logger = logging.getLogger(__name__)


def _ready(job: Job, read: bool) -> ArticleSearch | None:
    """The query's prepared rows when its batch may search them on the device; None: the host searches them.
    ``read``: rows not prepared yet are read now (else only found: the device keeps them)."""
    query = job.query
    if job.answered.done() or query.interpolation == "adaptive":
        return None
    got = job.retrieval
    if got is None or not got.done() or got.cancelled() or got.exception() is not None:
        return None
    retrieved = got.result()
    search = job.pipe.neighbours_of.search_for(query, retrieved.articles[0], retrieved.search, read=read)
    return search if search is not None and DeviceKnn.searchable(search) else None


@dataclass(frozen=True)
class OnDevice:
    """What `search_batch` (or `vote_batch`) did with a batch: questions searched (voted) on the device, and
    questions whose device search (vote) failed, left to the host."""

    done: int = 0
    failed: int = 0


class FailureLog:
    """The device search's failures, logged with their traceback at most once per ``every_s`` (a device that
    fails every batch would otherwise log every batch); the rest are counted in the metrics only."""

    def __init__(self, every_s: float = 60.0):
        self.every_s = every_s
        self._last: float | None = None

    def failed(self) -> None:
        now = time.monotonic()
        if self._last is None or now - self._last >= self.every_s:
            self._last = now
            logger.exception("the batch's kNN on the device failed; its queries are searched on the host")


def search_batch(
    knn: DeviceKnn, jobs: Sequence[Job], encs: Sequence[QueryEncoding | PendingEncoding], failures: FailureLog
) -> OnDevice:
    """Search the ready queries of a batch in one go (`DeviceKnn.search`) and give each its neighbours
    (``Job.neighbours``) and its share of the time (its ``knn`` stage). A failure here goes to ``failures`` and
    leaves every query to the host's search: the device path is never a request's only way to an answer."""
    t = time.perf_counter()
    ready = [(job, enc, search) for job, enc in zip(jobs, encs, strict=True)
             if (search := _ready(job, knn.reads_rows)) is not None]  # fmt: skip
    if not ready:
        return OnDevice()
    try:
        items = [(np.asarray(enc.embedding), search, job.query.k) for job, enc, search in ready]
        found = knn.search(items, [job.pipe.neighbours_of.datastore for job, _, _ in ready])
    except Exception:
        failures.failed()
        return OnDevice(failed=len(ready))
    share = (time.perf_counter() - t) / len(ready)
    for (job, _, _), nbrs in zip(ready, found, strict=True):
        job.neighbours = nbrs
        job.stage.add("knn", share)
    return OnDevice(done=len(ready))


def vote_input(assembler: AnswerAssembler, query: Query, enc: QueryEncoding, nbrs: Neighbours,
               articles: list[ArticleHit]) -> VoteInput | None:  # fmt: skip
    """A question's part of its batch's vote on the device, as the host would vote it (its temperature resolved,
    its articles' offsets); None where the device does not vote it (`AnswerAssembler.votes_on_device`)."""
    if not assembler.votes_on_device(query):
        return None
    query = assembler.resolve_temperature(query, nbrs)
    return VoteInput.of(query, enc, nbrs, knn_offsets(query, nbrs.article, articles))


def _vote_input(job: Job, enc: QueryEncoding | PendingEncoding) -> VoteInput | None:
    """`vote_input` of a question of the batch; None also where it was not searched on the device or its heads
    are not picked yet: the host votes it."""
    if job.neighbours is None or not isinstance(enc, QueryEncoding) or job.retrieval is None:
        return None
    return vote_input(job.pipe.assembler, job.query, enc, job.neighbours, job.retrieval.result().articles[0])


def vote_batch(
    vote: DeviceVote, jobs: Sequence[Job], encs: Sequence[QueryEncoding | PendingEncoding], failures: FailureLog
) -> OnDevice:
    """The vote, interpolation and top-k of a batch's questions searched on the device, in one go there
    (`DeviceVote.vote`): each gets its rankings (``Job.voted``), which its finishing turns into its answer. A
    failure goes to ``failures`` and leaves every question to the host's vote, as `search_batch` does."""
    t = time.perf_counter()
    ready = [(job, item) for job, enc in zip(jobs, encs, strict=True) if (item := _vote_input(job, enc)) is not None]
    if not ready:
        return OnDevice()
    try:
        voted = vote.vote([item for _, item in ready])
    except Exception:
        failures.failed()
        return OnDevice(failed=len(ready))
    share = (time.perf_counter() - t) / len(ready)
    for (job, _), got in zip(ready, voted, strict=True):
        job.voted = got
        job.stage.add("interpolation", share)
    return OnDevice(done=len(ready))


def keep_rows(knn: DeviceKnn, jobs: Sequence[Job], failures: FailureLog, step_bytes: int = STEP_BYTES) -> None:
    """After a batch: a step of its newest datastore's rows onto the device, where they are kept there and not
    all loaded yet (after a reload). A failure is logged as the search's are; the rows stay on the host."""
    if knn.resident is None or not jobs:
        return
    try:
        knn.keep_rows(jobs[-1].pipe.neighbours_of.datastore, step_bytes)
    except Exception:
        failures.failed()


class OnDeviceWork:
    """What a batch does on the model's device after its forward pass: its kNN (`search_batch`), with ``vote``
    its vote too (`vote_batch`), counted in ``metrics``; after its answers, a step of a new datastore's rows kept
    there (`keep_rows`). On the model thread, as every torch call."""

    def __init__(self, knn: DeviceKnn, vote: DeviceVote | None, metrics: Metrics):
        self.knn = knn
        self.vote = vote
        self.metrics = metrics
        self._failures = FailureLog()
        self.count_kept_rows()

    def after_forward(self, jobs: Sequence[Job], encs: Sequence[QueryEncoding | PendingEncoding]) -> None:
        done = search_batch(self.knn, jobs, encs, self._failures)
        self.metrics.knn_on_device.labels("searched").inc(done.done)
        self.metrics.knn_on_device.labels("failed").inc(done.failed)
        if self.vote is not None:
            voted = vote_batch(self.vote, jobs, encs, self._failures)
            self.metrics.vote_on_device.labels("voted").inc(voted.done)
            self.metrics.vote_on_device.labels("failed").inc(voted.failed)

    def keep_rows(self, jobs: Sequence[Job]) -> None:
        """`keep_rows` after the batch ``jobs``, and the metrics' count of rows kept."""
        keep_rows(self.knn, jobs, self._failures)
        self.count_kept_rows()

    def count_kept_rows(self) -> None:
        if self.knn.resident is not None:
            self.metrics.knn_device_rows.set(self.knn.resident.loaded)
