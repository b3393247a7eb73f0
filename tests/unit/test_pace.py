"""`Pace`: where a batch's queries are finished and retrieved, from the running means of this process's own batches;
a retrieval made on the model thread."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from bertknn.core.errors import RetrieverUnavailable
from bertknn.service.finishing import Job, Pace


def test_a_batch_is_finished_on_the_model_thread_until_its_forward_is_the_slower_part() -> None:
    pace = Pace(weight=0.5)
    assert pace.finish_here()  # nothing measured yet: the first batches are finished where they ran
    pace.forward(0.032, 32)  # 1 ms per query (a GPU, a small model)
    pace.finished(0.004, 2)  # 2 ms to finish one
    assert pace.finish_here()
    pace.forward(0.006, 2)  # a small batch costs more per query (3 ms: mean 2 ms), within the margin: still here
    assert pace.finish_here()
    for _ in range(8):  # the forward grows dearer (bert-base on a CPU: tens of ms per query)
        pace.forward(0.9, 32)
    assert pace.forward_s is not None and pace.forward_s > 0.02
    assert not pace.finish_here()  # the finisher overlaps the next forward
    assert Pace(margin=1.0).finish_here()
    for _ in range(8):
        pace.finished(0.3, 10)  # finishing grows dearer still (whole-word fills): back on the model thread
    assert pace.finish_here()


def test_running_means_move_by_their_weight_and_ignore_empty_batches() -> None:
    pace = Pace(weight=0.25)
    pace.forward(0.010, 10)
    assert pace.forward_s == 0.001
    pace.forward(0.005, 1)
    assert abs(pace.forward_s - (0.001 + 0.25 * (0.005 - 0.001))) < 1e-12
    pace.finished(1.0, 0)  # nothing finished: no information
    assert pace.finish_s is None


def test_the_model_thread_retrieves_where_a_retrieval_costs_less_than_finishing_a_query() -> None:
    pace = Pace(weight=0.5)
    assert not pace.retrieve_here()  # nothing measured: the retrieval thread
    pace.finished(0.004, 2)  # 2 ms to finish a query
    assert not pace.retrieve_here()  # no retrieval measured yet
    pace.retrieved(0.0005)  # TF-IDF over a small datastore: its CPU a quarter of finishing one
    assert pace.retrieve_here()
    for _ in range(8):
        pace.retrieved(0.02)  # Lucene over a large index: it overlaps the model thread's work on a thread of its own
    assert not pace.retrieve_here()
    assert Pace(retrieve_margin=20.0, weight=1.0).retrieve_here() is False  # (needs both measured)
    cheap = Pace(weight=1.0)
    cheap.finished(0.002, 1)
    cheap.retrieved(0.001)
    assert cheap.retrieve_here()
    for _ in range(3):
        cheap.forward(0.9, 32)  # the forward the slower part: batches go to the finisher, which never retrieves
    assert not cheap.finish_here() and not cheap.retrieve_here()


def test_a_cache_hit_is_answered_on_the_loop_while_retrieving_and_finishing_fit_in_the_switch_interval() -> None:
    pace = Pace(weight=1.0)
    assert not pace.hit_on_loop()  # nothing measured: the pool
    pace.finished(0.002, 1)
    assert not pace.hit_on_loop()  # the retrieval not measured yet
    pace.retrieved(0.0005)
    assert pace.hit_on_loop()  # 2.5 ms, within the default 5 ms
    interval = sys.getswitchinterval()
    pace.finished(interval - 0.0004, 1)
    assert not pace.hit_on_loop()  # together over it, though each alone is under
    pace.retrieved(0.0003)
    assert pace.hit_on_loop()


def test_a_retrieval_made_here_is_a_done_future_with_its_result_or_its_error() -> None:
    ran: list[str] = []

    def retrieve(query: Any) -> tuple[list, str]:
        ran.append(threading.current_thread().name)
        if query == "bad":
            raise RetrieverUnavailable("no such index")
        return [], "miss"

    def job(query: str) -> Job:
        pipe = SimpleNamespace(articles=SimpleNamespace(retrieve=retrieve))
        return Job(None, "k", query, pipe, None, 0.0, None)  # type: ignore[arg-type]

    good = job("fine").start_retrieval(None)
    assert good.done() and good.result().articles == ([], "miss") and good.result().cpu_seconds >= 0
    bad = job("bad").start_retrieval(None)
    assert bad.done()
    with pytest.raises(RetrieverUnavailable, match="no such index"):
        bad.result()
    assert ran == [threading.current_thread().name] * 2  # here, on the calling thread
