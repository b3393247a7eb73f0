"""Queries answered twice by an `AsyncAnswerer`, the second time from its in-process cache: the threads that
finished and retrieved the hits, beside the synchronous pipeline's answers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from bertknn.service.metrics import Metrics
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Answer, Query
from bertknn.service.serving import AsyncAnswerer
from bertknn.service.settings import BatchingSettings


@dataclass
class Hits:
    answers: list[Answer]  # the hits'
    expected: list[Answer]  # the synchronous pipeline's, to the same queries
    finished: list[str]  # the threads that finished each hit (`answer_from_encoding`), as named without their number
    retrieved: list[str]  # the threads that retrieved each hit's articles, the same way
    finish_s: float | None  # the finishing time per query the answerer went by (`Pace.finish_s`)


def _threads(pipe: AnswerPipeline) -> tuple[list[str], list[str]]:
    """The names of the threads that finish and retrieve, from now on."""
    finished: list[str] = []
    retrieved: list[str] = []
    finish, retrieve = pipe.assembler.answer_from_encoding, pipe.articles.retrieve

    def finishing(*args, **kw):  # type: ignore[no-untyped-def]
        finished.append(threading.current_thread().name.split("_")[0])
        return finish(*args, **kw)

    def retrieving(query: Query):  # type: ignore[no-untyped-def]
        retrieved.append(threading.current_thread().name.split("_")[0])
        return retrieve(query)

    pipe.assembler.answer_from_encoding = finishing  # type: ignore[method-assign]
    pipe.articles.retrieve = retrieving  # type: ignore[method-assign]
    return finished, retrieved


def answer_hits(
    datastore: Path, queries: Sequence[Query], *, finish_s: float | None, retrieve_s: float = 0.0001, many: bool = False
) -> Hits:
    """Each query asked once (a miss), then again with one article fewer (its encoding cached, its retrieval not,
    so that it is made again where the test sees it): one by one, or with ``many`` in one `answer_many`. Before
    the hits, the answerer's measured finishing time and retrieval CPU per query are set to ``finish_s`` and
    ``retrieve_s`` and kept there."""
    again = [replace(q, num_articles=q.num_articles - 1) for q in queries]
    pipe = AnswerPipeline.open(datastore, device="cpu", key_prefix="hits")
    reference = AnswerPipeline.open(datastore, device="cpu")

    async def main() -> Hits:
        answerer = AsyncAnswerer(pipe, BatchingSettings(max_wait_ms=0), Metrics())
        answerer.start()
        try:
            for q in queries:
                assert (await answerer.answer(q)).cache["encoding"] == "miss"
            # the model thread done with their batches (it measures one after its answers are out), then the pace
            await asyncio.wrap_future(answerer.batcher.call(lambda: None))
            pace = answerer.finisher.pace
            pace.finish_s, pace.retrieval_cpu_s, pace.weight = finish_s, retrieve_s, 0.0
            finished, retrieved = _threads(pipe)
            if many:
                got = await answerer.answer_many(again, [pipe.check_query(q) for q in again])
            else:
                got = [await answerer.answer(q) for q in again]
            return Hits(got, [reference.predict(q) for q in again], finished, retrieved,
                        answerer.finisher.pace.finish_s)  # fmt: skip
        finally:
            await answerer.stop()

    try:
        return asyncio.run(main())
    finally:
        pipe.close()
        reference.close()
