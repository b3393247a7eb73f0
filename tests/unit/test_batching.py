"""The micro-batcher gathers concurrent submissions into one call and bounds its queue."""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from bertknn.core.errors import Overloaded
from bertknn.service.batching import MicroBatcher, Outbox, WorkQueue


def test_concurrent_items_share_one_call():
    calls: list[list[int]] = []

    def fn(items):
        calls.append(list(items))
        return [x * 10 for x in items]

    async def main():
        b = MicroBatcher(fn, executor=ThreadPoolExecutor(1), max_batch_size=8, max_wait_ms=50, max_queue=100)
        b.start()
        results = await asyncio.gather(*(b.submit(i) for i in range(5)))
        await b.stop()
        return results

    assert asyncio.run(main()) == [0, 10, 20, 30, 40]
    assert calls == [[0, 1, 2, 3, 4]]


def test_full_queue_refuses_at_once_and_errors_reach_every_waiter():
    gate = threading.Event()

    def slow(items):
        gate.wait(5)
        if any(x < 0 for x in items):
            raise ValueError("bad item")
        return list(items)

    async def main():
        b = MicroBatcher(slow, executor=ThreadPoolExecutor(1), max_batch_size=1, max_wait_ms=0, max_queue=2)
        b.start()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0.05)  # 1 is running; the queue (2) can take two more
        queued = [asyncio.ensure_future(b.submit(2)), asyncio.ensure_future(b.submit(-1))]
        await asyncio.sleep(0.01)
        with pytest.raises(Overloaded):
            await b.submit(4)
        gate.set()
        assert await first == 1
        assert await queued[0] == 2
        with pytest.raises(ValueError, match="bad item"):
            await queued[1]
        await b.stop()

    asyncio.run(main())


def test_what_queues_during_a_batch_is_the_next_batch_and_runs_on_the_same_thread():
    """Continuous batching: the model thread takes everything that queued while it was busy, at once."""
    started, gate = threading.Event(), threading.Event()
    calls: list[list[int]] = []
    threads: set[int] = set()

    def fn(items):
        threads.add(threading.get_ident())
        calls.append(list(items))
        if items == [0]:
            started.set()
            gate.wait(5)
        return [x + 100 for x in items]

    async def main():
        b = MicroBatcher(fn, executor=ThreadPoolExecutor(1), max_batch_size=4, max_wait_ms=0, max_queue=100)
        b.start()
        first = asyncio.ensure_future(b.submit(0))
        while not started.is_set():
            await asyncio.sleep(0.001)
        assert b.busy and b.depth == 0  # computing: a new item would wait
        rest = [asyncio.ensure_future(b.submit(i)) for i in range(1, 7)]
        await asyncio.sleep(0.02)
        assert b.depth == 6
        # other work for the model's thread runs there, before the next batch
        side = b.call(lambda: (threading.get_ident(), list(calls)))
        gate.set()
        ident, seen = await asyncio.wrap_future(side)
        results = [await first, *[await r for r in rest]]
        deadline = asyncio.get_running_loop().time() + 5
        while b.busy and asyncio.get_running_loop().time() < deadline:  # the worker leaves fn after delivering
            await asyncio.sleep(0.001)
        assert not b.busy
        await b.stop()
        return results, ident, seen

    results, ident, seen = asyncio.run(main())
    assert results == [100 + i for i in range(7)]
    assert calls == [[0], [1, 2, 3, 4], [5, 6]]  # max_batch_size respected, nothing left waiting
    assert seen == [[0]]  # the call ran before the second batch
    assert threads == {ident}


def test_stop_finishes_queued_items_and_cancelled_waiters_are_skipped():
    gate = threading.Event()
    computed: list[int] = []

    def fn(items):
        gate.wait(5)
        computed.extend(items)
        return list(items)

    async def main():
        b = MicroBatcher(fn, executor=ThreadPoolExecutor(1), max_batch_size=1, max_wait_ms=0, max_queue=10)
        b.start()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0.02)
        gone = asyncio.ensure_future(b.submit(2))
        kept = asyncio.ensure_future(b.submit(3))
        await asyncio.sleep(0.01)
        gone.cancel()  # e.g. the client went away
        gate.set()
        await b.stop()  # drains: 3 is still computed
        with pytest.raises(RuntimeError, match="start"):
            await b.submit(4)
        return await first, await kept

    assert asyncio.run(main()) == (1, 3)
    assert computed == [1, 3]


def test_after_delivery_runs_once_per_batch_after_the_results_and_its_failures_stop_nothing(
    caplog: pytest.LogCaptureFixture,
):
    events: list[str] = []

    def fn(items):
        events.append(f"batch {list(items)}")
        return list(items)

    def after():
        events.append("after")
        if len(events) == 2:
            raise RuntimeError("a cache write failed")

    async def main():
        b = MicroBatcher(fn, executor=ThreadPoolExecutor(1), max_batch_size=8, max_wait_ms=0, after_delivery=after)
        b.start()
        first = await b.submit(1)
        second = await b.submit(2)  # the hook's failure above did not stop the worker
        await b.stop()
        return first, second

    with caplog.at_level("ERROR", logger="bertknn.service.batching"):
        assert asyncio.run(main()) == (1, 2)
    assert events == ["batch [1]", "after", "batch [2]", "after"]
    assert [r.getMessage() for r in caplog.records] == ["after_delivery hook failed"]  # with its traceback
    assert caplog.records[0].exc_info is not None


def test_a_batcher_nobody_stopped_does_not_keep_the_process_alive():
    import subprocess
    import sys
    import time

    script = (
        "import asyncio\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from bertknn.service.batching import MicroBatcher\n"
        "async def main():\n"
        "    b = MicroBatcher(lambda xs: list(xs), executor=ThreadPoolExecutor(1), max_wait_ms=0)\n"
        "    b.start()\n"
        "    print(await b.submit(7))\n"  # and no stop()
        "asyncio.run(main())\n"
    )
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "7"
    assert time.monotonic() - t < 20


def test_calls_and_batches_take_turns_when_both_wait():
    """One request's series of extra passes (calls) never holds the others' next batch back by more than one."""
    order: list[str] = []
    gate, started = threading.Event(), threading.Event()

    def fn(items):
        if items == [0]:
            started.set()
            gate.wait(5)
        order.append(f"batch {list(items)}")
        return list(items)

    async def main():
        b = MicroBatcher(fn, executor=ThreadPoolExecutor(1), max_batch_size=2, max_wait_ms=0, max_queue=100)
        b.start()
        first = asyncio.ensure_future(b.submit(0))
        while not started.is_set():
            await asyncio.sleep(0.001)
        rest = [asyncio.ensure_future(b.submit(i)) for i in range(1, 5)]
        await asyncio.sleep(0.01)
        calls = [b.call(lambda n=n: order.append(f"call {n}")) for n in range(3)]
        gate.set()
        await asyncio.gather(first, *rest, *(asyncio.wrap_future(c) for c in calls))
        await b.stop()

    asyncio.run(main())
    assert order == ["batch [0]", "call 0", "batch [1, 2]", "call 1", "batch [3, 4]", "call 2"]


def test_a_batch_takes_the_waiting_items_round_robin_over_clients():
    """One client's 6 queued items do not fill the next batch ahead of another client's."""
    batches: list[list[str]] = []
    gate, started = threading.Event(), threading.Event()

    def fn(items):
        if items == ["x0"]:
            started.set()
            gate.wait(5)
        batches.append(list(items))
        return list(items)

    async def main():
        b = MicroBatcher(fn, executor=ThreadPoolExecutor(1), max_batch_size=4, max_wait_ms=0, max_queue=100,
                         key=lambda item: item[0])  # fmt: skip
        b.start()
        first = asyncio.ensure_future(b.submit("x0"))
        while not started.is_set():
            await asyncio.sleep(0.001)
        flood = [asyncio.ensure_future(b.submit(f"a{i}")) for i in range(6)]
        await asyncio.sleep(0.01)
        others = [asyncio.ensure_future(b.submit(f"b{i}")) for i in range(2)]
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(first, *flood, *others)
        await b.stop()

    asyncio.run(main())
    assert batches == [["x0"], ["a0", "a1", "b0", "b1"], ["a2", "a3", "a4", "a5"]]


def test_the_outbox_hands_every_result_over_and_wakes_the_loop_once_while_a_hand_over_is_pending():
    async def main() -> tuple[list[object], int]:
        loop = asyncio.get_running_loop()
        wakes = 0
        real = loop.call_soon_threadsafe

        def counted(*args):  # type: ignore[no-untyped-def]
            nonlocal wakes
            wakes += 1
            return real(*args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        box = Outbox(loop)
        futures = [loop.create_future() for _ in range(200)]
        futures[7].cancel()  # a waiter that gave up is skipped
        gate = threading.Event()

        def worker(part: list[asyncio.Future[object]]) -> None:
            gate.wait()
            for i, f in enumerate(part):
                box.put([(f, i, None) if i % 50 else (f, None, ValueError(str(i)))])

        threads = [threading.Thread(target=worker, args=(futures[k::4],)) for k in range(4)]
        for t in threads:
            t.start()
        gate.set()
        for t in threads:  # the loop is held here: every put while one hand-over is pending joins it
            t.join()
        got = await asyncio.gather(*futures, return_exceptions=True)
        return got, wakes

    got, wakes = asyncio.run(main())
    assert wakes == 1
    assert isinstance(got[7], asyncio.CancelledError)
    for k in range(4):
        for i, value in enumerate(got[k::4]):
            if k == 3 and i == 1:
                continue  # futures[7]
            assert (isinstance(value, ValueError) and str(value) == str(i)) if i % 50 == 0 else value == i


# ---- batches on the event loop (no executor) ------------------------------------------------------------------


def test_on_the_loop_batches_run_on_the_loops_thread_and_what_arrived_meanwhile_is_the_next_batch():
    """Without an executor each batch runs on the event loop, blocking it. Requests that came in meanwhile each
    take a few turns of the loop to reach `submit` (an HTTP request is read, then its handler runs): the batcher
    lets the loop take them before its next batch, also when some are still waiting from before, so they share
    one."""
    calls: list[list[int]] = []
    on_loop: list[bool] = []

    async def arrive(b: MicroBatcher, i: int) -> int:
        for _ in range(2):  # read, parsed, handled: turns of the loop before it queues
            await asyncio.sleep(0)
        return await b.submit(i)

    def fn(items):
        loop = asyncio.get_running_loop()  # (raises on any other thread)
        on_loop.append(threading.current_thread() is threading.main_thread())
        calls.append(list(items))
        if items == [0]:  # while this batch runs, six requests come in
            arrived.extend(loop.create_task(arrive(b, i)) for i in range(1, 7))
        if items == [1, 2, 3, 4]:  # two are left waiting, and two more come in
            arrived.extend(loop.create_task(arrive(b, i)) for i in range(7, 9))
        return [x + 100 for x in items]

    arrived: list[asyncio.Task[int]] = []
    b: MicroBatcher[int, int]

    async def main():
        nonlocal b
        b = MicroBatcher(fn, executor=None, max_batch_size=4, max_wait_ms=0, max_queue=100)
        b.start()
        first = await b.submit(0)
        rest = [await t for t in arrived]
        await b.stop()
        return [first, *rest]

    assert asyncio.run(main()) == [100 + i for i in range(9)]
    assert calls == [[0], [1, 2, 3, 4], [5, 6, 7, 8]]  # the two left waiting did not go alone
    assert on_loop == [True, True, True]


def test_on_the_loop_calls_from_other_threads_run_there_between_batches_and_one_from_the_loop_at_once():
    """Extra forward passes asked for from a pool thread (whole words, entity names) run on the loop's thread
    between batches; one asked for on the loop's thread itself runs there and then, where waiting would deadlock."""
    order: list[str] = []

    def fn(items):
        order.append(f"batch {list(items)}")
        return list(items)

    async def main():
        b = MicroBatcher(fn, executor=None, max_batch_size=8, max_wait_ms=0, max_queue=100)
        b.start()
        loop_thread = threading.get_ident()
        with ThreadPoolExecutor(1) as pool:
            ran_on = await asyncio.wrap_future(
                pool.submit(lambda: b.call(lambda: (order.append("call"), threading.get_ident())[1]).result(5))
            )
        here = b.call(lambda: order.append("here"))
        assert here.done()
        assert await b.submit(1) == 1
        await b.stop()
        return loop_thread, ran_on

    loop_thread, ran_on = asyncio.run(main())
    assert ran_on == loop_thread
    assert order == ["call", "here", "batch [1]"]


def test_on_the_loop_stop_finishes_what_is_queued_and_a_full_queue_refuses():
    computed: list[int] = []

    def fn(items):
        computed.extend(items)
        return list(items)

    async def main():
        b = MicroBatcher(fn, executor=None, max_batch_size=1, max_wait_ms=0, max_queue=2)
        b.start()
        queued = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
        await asyncio.sleep(0)  # all three reach the queue before the batcher's task runs: the third is refused
        with pytest.raises(Overloaded):
            await queued[2]
        await b.stop()
        return [await q for q in queued[:2]]

    assert asyncio.run(main()) == [0, 1]
    assert computed == [0, 1]


def test_on_the_loop_an_idle_batcher_waits_max_wait_for_company():
    calls: list[list[int]] = []

    def fn(items):
        calls.append(list(items))
        return list(items)

    async def main():
        b = MicroBatcher(fn, executor=None, max_batch_size=8, max_wait_ms=300, max_queue=100)
        b.start()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0.05)  # within the first one's wait
        second = asyncio.ensure_future(b.submit(2))
        got = [await first, await second]
        await b.stop()
        return got

    assert asyncio.run(main()) == [1, 2]
    assert calls == [[1, 2]]


def test_a_full_or_stopping_queue_does_not_wait_for_company():
    loop = asyncio.new_event_loop()
    try:
        q: WorkQueue[int, int] = WorkQueue(max_batch_size=2, max_wait_s=60.0, max_queue=10, key=None)
        q.add(1, loop.create_future())
        deadline = q.company_deadline()
        assert deadline is not None and q.company_left(deadline) > 30  # one of two: it waits for another
        q.add(2, loop.create_future())
        assert q.company_deadline() is None and q.company_left(deadline) == 0.0  # full: it goes now
        q.items.pop()
        q.stop()
        assert q.company_deadline() is None and q.company_left(deadline) == 0.0  # stopping: no waiting
        eager: WorkQueue[int, int] = WorkQueue(max_batch_size=2, max_wait_s=0.0, max_queue=10, key=None)
        eager.add(1, loop.create_future())
        assert eager.company_deadline() is None  # max_wait 0: a batch never waits
    finally:
        loop.close()


@pytest.mark.parametrize("bad", [{"max_batch_size": 0}, {"max_queue": 0}, {"max_wait_ms": -1.0}])
def test_each_bad_setting_is_refused(bad: dict):
    with pytest.raises(ValueError, match="max_batch_size and max_queue must be >= 1, max_wait_ms >= 0"):
        MicroBatcher(list, executor=None, **bad)


def test_busy_while_a_batch_runs_and_not_before_or_after():
    gate, running = threading.Event(), threading.Event()

    def fn(items):
        running.set()
        gate.wait(5)
        return list(items)

    async def main():
        b = MicroBatcher(fn, executor=ThreadPoolExecutor(1), max_batch_size=4, max_wait_ms=0, max_queue=10)
        b.start()
        assert not b.busy and b.depth == 0
        task = asyncio.ensure_future(b.submit(1))
        await asyncio.to_thread(running.wait, 5)
        assert b.busy  # inside fn, nothing queued
        gate.set()
        assert await task == 1
        await b.stop()
        assert not b.busy

    asyncio.run(main())


def _within(seconds: float, main) -> Any:
    """``asyncio.run(main())`` on a thread of its own, failed if it has not returned after ``seconds``: a batcher
    task that spins without yielding holds its loop for good, and the test must fail, not hang."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - raised again on the test's thread
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the event loop did not finish within {seconds} s (a batcher task spinning?)"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("max_wait_ms", [0, 400])
def test_on_the_loop_an_idle_batcher_sleeps_and_a_waiting_one_does_not_spin(max_wait_ms: float):
    """Between batches, and while a batch waits for company, the loop's task waits on its event: the loop stays
    free (the test's own sleeps return) and its thread spends no CPU meanwhile."""

    async def main():
        b: MicroBatcher[int, int] = MicroBatcher(
            list, executor=None, max_batch_size=8, max_wait_ms=max_wait_ms, max_queue=100
        )
        b.start()
        cpu0 = time.thread_time()
        got = [await b.submit(1)]  # with max_wait_ms, it waits that long for company that never comes
        await asyncio.sleep(0.3)  # idle, after a batch
        got.append(await b.submit(2))
        spent = time.thread_time() - cpu0
        await asyncio.wait_for(b.stop(), 5)
        return got, spent

    got, spent = _within(10, main)
    assert got == [1, 2]
    assert spent < 0.1, f"the loop's thread spent {spent:.3f} s of CPU while idle or waiting for company"


@pytest.mark.parametrize("on_loop", [False, True])
def test_on_batch_hears_each_batch_s_rows_and_time_and_stop_ends_the_worker(on_loop: bool):
    heard: list[tuple[int, float]] = []

    def fn(items):
        time.sleep(0.02)
        return list(items)

    async def main():
        b = MicroBatcher(fn, executor=None if on_loop else ThreadPoolExecutor(1), max_batch_size=8, max_wait_ms=50,
                         max_queue=100, on_batch=lambda n, s: heard.append((n, s)))  # fmt: skip
        b.start()
        got = await asyncio.gather(*(b.submit(i) for i in range(3)))
        got.append(await b.submit(3))
        await asyncio.wait_for(b.stop(), 5)
        with pytest.raises(RuntimeError, match="start"):  # stopped: the worker is gone
            await b.submit(4)
        return got

    assert _within(10, main) == [0, 1, 2, 3]
    assert [n for n, _ in heard] == [3, 1]
    assert all(0.015 < s < 5 for _, s in heard), heard  # the batch's own time, fn's sleep within it


@pytest.mark.parametrize("on_loop", [False, True])
def test_a_call_that_raises_hands_its_error_to_the_caller_from_any_thread(on_loop: bool):
    """`call`'s future carries what the function raised: asked for from a pool thread (queued for the batcher's
    thread) and, on the loop, from the loop's thread itself (run there and then)."""

    def boom():
        raise LookupError("no such word")

    async def main():
        b = MicroBatcher(list, executor=None if on_loop else ThreadPoolExecutor(1), max_batch_size=8, max_wait_ms=0,
                         max_queue=100)  # fmt: skip
        b.start()
        with ThreadPoolExecutor(1) as pool:
            queued = await asyncio.wrap_future(pool.submit(lambda: b.call(boom).exception(5)))
        here = b.call(boom).exception(5)
        assert await b.submit(7) == 7  # the worker goes on
        await asyncio.wait_for(b.stop(), 5)
        return queued, here

    queued, here = _within(20, main)
    assert isinstance(queued, LookupError) and isinstance(here, LookupError)
    assert str(queued) == str(here) == "no such word"


@pytest.mark.parametrize("on_loop", [False, True])
def test_a_batch_whose_results_do_not_match_its_items_fails_every_waiter_and_the_hook_failure_is_logged(
    on_loop: bool, caplog: pytest.LogCaptureFixture
):
    """A model function that returns fewer results than it was given items must not leave a waiter hanging:
    every waiter of that batch gets the error. A failing ``on_batch`` hook is logged and stops nothing."""

    def short(items):
        return list(items)[:-1] if len(items) > 1 else list(items)

    def on_batch(n: int, s: float) -> None:
        raise RuntimeError("metrics are down")

    async def main():
        b = MicroBatcher(short, executor=None if on_loop else ThreadPoolExecutor(1), max_batch_size=8,
                         max_wait_ms=50, max_queue=100, on_batch=on_batch)  # fmt: skip
        b.start()
        got = await asyncio.wait_for(
            asyncio.gather(*(b.submit(i) for i in range(3)), return_exceptions=True), 5
        )
        alone = await b.submit(9)
        await asyncio.wait_for(b.stop(), 5)
        return got, alone

    with caplog.at_level("ERROR", logger="bertknn.service.batching"):
        got, alone = _within(20, main)
    assert all(isinstance(g, ValueError) for g in got), got  # zip(strict=True): shorter than the batch
    assert alone == 9
    assert [r.getMessage() for r in caplog.records] == ["on_batch hook failed"] * 2


class Request:
    """Stands for what a batch's items keep alive: a request, the datastore version it holds."""


@pytest.mark.parametrize("on_thread", [True, False])
def test_the_idle_worker_keeps_nothing_of_its_last_batch(on_thread: bool):
    """Waiting for the next batch, the model's worker (a thread, or a task of the event loop) holds no item of
    the last one: a retired datastore version its requests used is freed once they are answered."""

    async def main() -> None:
        executor = ThreadPoolExecutor(1) if on_thread else None
        b = MicroBatcher(lambda items: [1 for _ in items], executor=executor, max_batch_size=4, max_wait_ms=0,
                         max_queue=100)  # fmt: skip
        b.start()
        request = Request()
        gone = weakref.ref(request)
        assert await b.submit(request) == 1
        del request
        for _ in range(500):  # the worker is idle: nothing else comes
            if gone() is None:
                break
            await asyncio.sleep(0.01)
        assert gone() is None
        await b.stop()

    asyncio.run(main())
