"""A batch's restricted kNN on the model's device, right after its forward pass (``model.knn_device: model``).

For each query of the batch whose articles are known by then and whose rows are float16, the rows are searched
together in one batched product (`DeviceKnn`); the neighbours ride on the query's `Job` to its finishing, which
then skips its own search. A query left out (its retrieval still running, a datastore with a codec, retriever
``none``, adaptive interpolation, which may skip the kNN) is searched on the host as before. Runs on the model
thread: every torch call of the service comes from that one thread (`AsyncAnswerer`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from bertknn.service.codec import QueryEncoding
from bertknn.service.encoding import PendingEncoding
from bertknn.service.finishing import Job
from bertknn.service.retrieval.device_knn import DeviceKnn
from bertknn.service.retrieval.knn import ArticleSearch

logger = logging.getLogger(__name__)


def _ready(job: Job) -> ArticleSearch | None:
    """The query's prepared rows when its batch may search them on the device; None: the host searches them."""
    query = job.query
    if job.answered.done() or query.retriever == "none" or query.interpolation == "adaptive":
        return None
    got = job.retrieval
    if got is None or not got.done() or got.cancelled() or got.exception() is not None:
        return None
    retrieved = got.result()
    hits = retrieved.articles[0]
    if not hits:
        return None
    search = retrieved.search
    if search is None or search.titles != tuple(a.title for a in hits) or search.answer != query.answer:
        search = job.pipe.neighbours_of.prepare_search(query, hits)
    return search if search is not None and DeviceKnn.searchable(search) else None


def search_batch(knn: DeviceKnn, jobs: Sequence[Job], encs: Sequence[QueryEncoding | PendingEncoding]) -> int:
    """Search the ready queries of a batch in one go (`DeviceKnn.search`) and give each its neighbours
    (``Job.neighbours``) and its share of the time (its ``knn`` stage); the number searched. A failure here is logged
    and leaves every query to the host's search: the device path is never a request's only way to an answer."""
    t = time.perf_counter()
    ready = [(job, enc, search) for job, enc in zip(jobs, encs, strict=True) if (search := _ready(job)) is not None]
    if not ready:
        return 0
    try:
        found = knn.search([(np.asarray(enc.embedding), search, job.query.k) for job, enc, search in ready])
    except Exception:
        logger.exception("the batch's kNN on the device failed; its queries are searched on the host")
        return 0
    share = (time.perf_counter() - t) / len(ready)
    for (job, _, _), nbrs in zip(ready, found, strict=True):
        job.neighbours = nbrs
        job.stage.add("knn", share)
    return len(ready)
