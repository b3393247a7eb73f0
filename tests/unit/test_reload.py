"""Live reload without a model: the swap, the leases that keep a request on its version, and refusals."""

from __future__ import annotations

import asyncio
import concurrent.futures.thread
import fcntl
import gc
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from bertknn.core.errors import ModelLoadError, ReloadError
from bertknn.core.format import Manifest, ModelInfo, write_manifest
from bertknn.service import heap
from bertknn.service.api.deps import Resources
from bertknn.service.metrics import Metrics
from bertknn.service.processes import WorkerSlot
from bertknn.service.reload import DatastoreReloader, PeerReloads
from bertknn.service.serving import AsyncAnswerer
from bertknn.service.settings import BatchingSettings, ServiceSettings


class FakePipeline:
    """What the reloader uses of an AnswerPipeline: identity, the datastore's id/version/root, for_datastore."""

    words = None

    def __init__(self, root: Path, ds_id: str, version: int, next_pipeline: object = None):
        self.datastore = SimpleNamespace(id=ds_id, version=version, root=root)
        self.next_pipeline = next_pipeline
        self.released = False

    def identity(self) -> dict:
        return {"datastore": {"id": self.datastore.id, "version": self.datastore.version}}

    def for_datastore(self, root: Path, *, verify_checksums: bool = False) -> object:
        if isinstance(self.next_pipeline, Exception):
            raise self.next_pipeline
        return self.next_pipeline

    def release(self) -> None:
        self.released = True

    def fill_answerers(self) -> list:
        return []


def _manifest(root: Path, ds_id: str, version: int) -> None:
    model = ModelInfo(
        name="m", weights_sha256="0" * 64, architecture="x", num_layers=1, hidden_size=4, vocab_size=9
    )
    write_manifest(root, Manifest(model=model, layer=1, max_seq_len=8, articles_per_shard=1, stopwords_sha256="0",
                                  datastore_id=ds_id, version=version))  # fmt: skip


def _setup(tmp_path: Path, old: FakePipeline) -> tuple[Resources, AsyncAnswerer, DatastoreReloader]:
    resources = Resources(settings=ServiceSettings(datastore=tmp_path))
    answerer = AsyncAnswerer(old, BatchingSettings(), resources.metrics)  # type: ignore[arg-type]
    resources.answerer, resources.pipeline, resources.ready = answerer, old, True  # type: ignore[assignment]
    return resources, answerer, DatastoreReloader(resources, drain_timeout_s=5)


def test_a_request_holding_the_old_version_finishes_on_it_and_the_old_one_is_released_after(tmp_path: Path):
    async def scenario() -> None:
        new = FakePipeline(tmp_path.resolve(), "b", 2)
        old = FakePipeline(tmp_path.resolve(), "a", 1, next_pipeline=new)
        resources, answerer, reloader = _setup(tmp_path, old)
        _manifest(tmp_path, "b", 2)
        with answerer.lease() as held:
            outcome = await reloader.reload()
            assert outcome.status == "reloaded" and outcome.draining == 1
            assert 0 <= outcome.seconds < 60 and outcome.processes == 1
            assert (outcome.previous["version"], outcome.current["version"]) == (1, 2)
            assert held is old and answerer.pipeline is new and resources.pipeline is new
            with answerer.lease() as fresh:
                assert fresh is new  # requests that start after the swap get the new version
            await asyncio.sleep(0.05)
            assert not old.released  # still in use by the request that holds it
        for _ in range(100):
            if old.released:
                break
            await asyncio.sleep(0.01)
        assert old.released and not new.released
        assert (await reloader.reload()).status == "unchanged"  # same id and version on disk
        await answerer.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("failure", "needle"),
    [(ModelLoadError("model 'x' is not the model this datastore was built with"), "not the model"),
     (RuntimeError("boom"), "RuntimeError; see the server log")],
)  # fmt: skip
def test_a_refused_version_leaves_the_old_one_serving(tmp_path: Path, failure: Exception, needle: str):
    async def scenario() -> None:
        old = FakePipeline(tmp_path.resolve(), "a", 1, next_pipeline=failure)
        _, answerer, reloader = _setup(tmp_path, old)
        _manifest(tmp_path, "b", 2)
        with pytest.raises(ReloadError, match="still serving version 1") as info:
            await reloader.reload()
        assert needle in str(info.value)
        assert answerer.pipeline is old and not old.released
        await answerer.stop()

    asyncio.run(scenario())


def test_a_manifest_that_cannot_be_read_leaves_the_old_version_serving(tmp_path: Path):
    async def scenario() -> None:
        old = FakePipeline(tmp_path.resolve(), "a", 1, next_pipeline=FakePipeline(tmp_path.resolve(), "b", 2))
        _, answerer, reloader = _setup(tmp_path, old)
        (tmp_path / "manifest.json").write_text("{ not json")
        with pytest.raises(ReloadError, match="still serving version 1"):
            await reloader.reload()
        assert answerer.pipeline is old and not old.released
        await answerer.stop()

    asyncio.run(scenario())


def test_drained_waits_for_the_last_lease_and_times_out_while_held():
    async def scenario() -> None:
        pipe = FakePipeline(Path("."), "a", 1)
        answerer = AsyncAnswerer(pipe, BatchingSettings(), Metrics())  # type: ignore[arg-type]
        assert await answerer.leases.drained(pipe, 0.01)  # nobody holds it
        with answerer.lease(), answerer.lease():
            assert answerer.leases.in_flight(pipe) == 2
            assert not await answerer.leases.drained(pipe, 0.01)
        assert answerer.leases.in_flight(pipe) == 0 and await answerer.leases.drained(pipe, 0.01)
        await answerer.stop()

    asyncio.run(scenario())


pytestmark = pytest.mark.usefixtures("collector_restored")  # (tests/conftest.py)


@pytest.mark.parametrize("late_worker", [False, True])
def test_a_retired_version_is_collected_though_start_up_froze_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, late_worker: bool
):
    """Start-up freezes the heap (`heap.settle`); a reload thaws it once the old version is released, so the old
    version's reference cycles are collected rather than kept for the process's life. ``late_worker``: the
    executor's thread lets go of its work item (the call and its arguments) only well after the awaiting
    coroutine has gone on, as a loaded host can schedule it: the old version must not be frozen again meanwhile."""
    if late_worker:
        run = concurrent.futures.thread._WorkItem.run

        def run_then_linger(item: object) -> None:
            run(item)
            time.sleep(0.3)  # the worker still holds ``item`` (and what it was called with)

        monkeypatch.setattr(concurrent.futures.thread._WorkItem, "run", run_then_linger)
    released: list[str] = []

    class CyclicPipeline(FakePipeline):
        def release(self) -> None:
            released.append(self.datastore.id)

    async def scenario() -> None:
        new = FakePipeline(tmp_path.resolve(), "b", 2)
        old = CyclicPipeline(tmp_path.resolve(), "a", 1, next_pipeline=new)
        old.cycle = [old]  # type: ignore[attr-defined]  # only the cyclic collector can free it
        gone = weakref.ref(old)
        resources, answerer, reloader = _setup(tmp_path, old)
        _manifest(tmp_path, "b", 2)
        heap.settle()
        assert gc.get_freeze_count() > 0
        del old
        assert (await reloader.reload()).status == "reloaded"
        for _ in range(300):
            if released and gone() is None:
                break
            await asyncio.sleep(0.01)
        assert released == ["a"] and gone() is None
        await answerer.stop()

    try:
        asyncio.run(scenario())
    finally:
        heap.thaw()


def _retiring(tmp_path: Path, version: int, keeper: list[object] | None) -> tuple[AsyncAnswerer, DatastoreReloader]:
    """A service serving ``version`` (a reference to it kept in ``keeper`` if given, as a leak would keep it) and
    its reloader; ``version + 1`` is on disk."""
    old = FakePipeline(tmp_path.resolve(), "a", version, next_pipeline=FakePipeline(tmp_path.resolve(), "b", version + 1))
    if keeper is not None:
        keeper.append(old)
    _, answerer, reloader = _setup(tmp_path, old)
    _manifest(tmp_path, "b", version + 1)
    return answerer, reloader


@pytest.mark.parametrize("held", [False, True])
def test_a_stop_during_the_reload_s_collection_waits_for_it_so_the_heap_stays_given_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: bool
):
    """The app stops (`reloader.close`, then `heap.thaw`) while the retired version's collection runs on its
    thread: the close waits for that collection, which therefore cannot freeze the heap after the thaw. ``held``:
    the version is still referenced, so the collection would go on waiting and collecting: the stop ends it."""
    collecting = threading.Event()
    resettle = heap.resettle

    def slow_resettle() -> int:
        collecting.set()
        time.sleep(0.3)
        return resettle()

    monkeypatch.setattr(heap, "resettle", slow_resettle)

    keeper: list[object] = []

    async def scenario() -> None:
        answerer, reloader = _retiring(tmp_path, 1, keeper if held else None)
        heap.settle()
        assert (await reloader.reload()).status == "reloaded"
        assert await asyncio.to_thread(collecting.wait, 5)
        await asyncio.wait_for(reloader.close(), 2)  # not the collection's whole round of waits
        heap.thaw()  # as the app's stop does next
        await asyncio.sleep(0.5)  # (a collection still running would have settled by now)
        await answerer.stop()

    asyncio.run(scenario())
    assert gc.get_freeze_count() == 0 and not heap._thresholds


@pytest.mark.parametrize("held", [False, True])
def test_the_collection_stops_once_the_retired_version_is_freed_and_names_one_still_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, held: bool
):
    """A version nothing holds any more: one collection, no warning. One that something still holds after every
    wait (``held``): collected again after each, then a warning that names it."""
    import bertknn.service.reload as reload_module

    monkeypatch.setattr(reload_module, "RESETTLE_WAITS_S", (0.01, 0.02))
    rounds: list[int] = []
    resettle = heap.resettle
    monkeypatch.setattr(heap, "resettle", lambda: rounds.append(1) or resettle())
    keeper: list[object] = []

    async def scenario() -> None:
        answerer, reloader = _retiring(tmp_path, 7, keeper if held else None)
        assert (await reloader.reload()).status == "reloaded"
        for _ in range(500):
            if not reloader._tasks:
                break
            await asyncio.sleep(0.01)
        assert not reloader._tasks
        await answerer.stop()

    with caplog.at_level("WARNING", logger="bertknn.service.reload"):
        asyncio.run(scenario())
    warned = [r.getMessage() for r in caplog.records if "still referenced" in r.getMessage()]
    if held:
        assert len(rounds) == 3 and warned == ["datastore version 7 is still referenced after its release; its memory is kept"]
    else:
        assert len(rounds) == 1 and not warned


def test_a_version_still_in_use_after_the_drain_timeout_is_kept_open_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """A request that outlasts ``drain_timeout_s`` still reads the retired version's indexes: they stay open."""

    async def scenario() -> None:
        old = FakePipeline(tmp_path.resolve(), "a", 3, next_pipeline=FakePipeline(tmp_path.resolve(), "b", 4))
        resources, answerer, _ = _setup(tmp_path, old)
        reloader = DatastoreReloader(resources, drain_timeout_s=0.05)
        _manifest(tmp_path, "b", 4)
        with answerer.lease():
            assert (await reloader.reload()).draining == 1
            for _ in range(300):
                if not reloader._tasks:
                    break
                await asyncio.sleep(0.01)
            assert not reloader._tasks and not old.released
        await asyncio.sleep(0.05)
        assert not old.released  # nothing releases it later either
        await answerer.stop()

    with caplog.at_level("WARNING", logger="bertknn.service.reload"):
        asyncio.run(scenario())
    assert any("still hold datastore version 3" in r.getMessage() for r in caplog.records)


def test_close_cancels_a_retirement_that_waits_for_its_requests(tmp_path: Path):
    """The service stops while a request still holds the retired version: the stop does not wait out the drain
    timeout, and the version is not released under the request."""

    async def scenario() -> None:
        old = FakePipeline(tmp_path.resolve(), "a", 1, next_pipeline=FakePipeline(tmp_path.resolve(), "b", 2))
        _, answerer, reloader = _setup(tmp_path, old)  # a drain timeout of 5 s
        _manifest(tmp_path, "b", 2)
        with answerer.lease():
            assert (await reloader.reload()).draining == 1
            t0 = time.monotonic()
            await asyncio.wait_for(reloader.close(), 2)
            assert time.monotonic() - t0 < 1 and not reloader._tasks
        assert not old.released
        await answerer.stop()

    asyncio.run(scenario())


def _peer(root: Path) -> tuple[WorkerSlot, PeerReloads]:
    """A server process's slot and reload records (two in one test process: each slot is its own lock)."""
    slot = WorkerSlot.claim(root)
    return slot, PeerReloads(root, slot.index)


def test_a_peer_still_starting_is_not_told_to_reload_and_counts_as_not_serving_yet(tmp_path: Path):
    async def scenario() -> None:
        (a_slot, a), (b_slot, b) = _peer(tmp_path), _peer(tmp_path)
        _manifest(tmp_path, "a", 1)
        _, answerer, reloader = _setup(tmp_path, FakePipeline(tmp_path.resolve(), "a", 1))
        reloader.peers = a
        reloader.join_peers({"id": "a", "version": 1})
        assert a.generation() == 0  # b has recorded nothing: it opens the manifest itself
        assert a.serving({"id": "a", "version": 1}) == (1, 2)  # a reload's answer waits for b to record
        b.served({"id": "a", "version": 1})
        assert a.serving({"id": "a", "version": 1}) == (2, 2)
        b_slot.release()
        assert a.serving({"id": "a", "version": 1}) == (1, 1)  # a dead process no longer counts
        a_slot.release()
        await answerer.stop()

    asyncio.run(scenario())


def test_an_announce_waits_for_another_process_s_lock_on_the_generation(tmp_path: Path):
    """Two processes that announce at once each add one: the read and the write are one step under the file's
    lock (an open file of its own stands for the other process)."""
    slot, peers = _peer(tmp_path)
    done = threading.Event()
    with open(tmp_path / "reload-generation", "r+") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        announcer = threading.Thread(target=lambda: (peers.announce(), done.set()))
        announcer.start()
        assert not done.wait(0.3)  # held back while the other process holds the lock
        other.seek(0)
        other.write("41")  # what the other process's announce wrote
        other.flush()
        fcntl.flock(other, fcntl.LOCK_UN)
    assert done.wait(10)
    announcer.join(10)
    assert peers.generation() == 42
    slot.release()


def test_a_replacement_drops_its_dead_predecessors_record(tmp_path: Path):
    (tmp_path / "served-0.json").write_text('{"id": "a", "version": 9}')
    slot, peers = _peer(tmp_path)
    assert slot.index == 0 and peers.versions() == {}
    slot.release()


def test_a_process_that_opened_an_older_version_while_its_peers_moved_on_catches_up(tmp_path: Path):
    """b reloads to version 2 and announces it while a is still loading its model with version 1: a reads the
    generation before loading (`PeerReloads`), so on joining it tells everyone, itself included, to reload."""

    async def scenario() -> None:
        (a_slot, a), (b_slot, b) = _peer(tmp_path), _peer(tmp_path)
        _manifest(tmp_path, "b", 2)
        b.served({"id": "b", "version": 2})
        b.announce()  # during a's start-up: a's follow_peers must not miss it
        new = FakePipeline(tmp_path.resolve(), "b", 2)
        _, answerer, reloader = _setup(tmp_path, FakePipeline(tmp_path.resolve(), "a", 1, next_pipeline=new))
        reloader.peers = a
        reloader.join_peers({"id": "a", "version": 1})
        assert a.generation() == 2  # b serves another version: told to reload (to what it serves already)
        reloads = []
        reload = reloader.reload
        reloader.reload = lambda: reloads.append(1) or reload()  # type: ignore[method-assign]
        follow = asyncio.create_task(reloader.follow_peers(interval_s=0.01))
        for _ in range(200):
            if answerer.pipeline is new:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # ten more polls of an unchanged generation
        follow.cancel()
        assert answerer.pipeline is new and len(reloads) == 1  # one reload per change of the generation
        assert (
            a.generation() == 2
        )  # a reload that follows a peer's announces nothing (no echo between processes)
        assert a.serving({"id": "b", "version": 2}) == (2, 2)
        a_slot.release()
        b_slot.release()
        await answerer.stop()

    asyncio.run(scenario())


def test_a_reload_is_refused_while_the_service_starts_or_stops(tmp_path: Path):
    async def scenario() -> None:
        old = FakePipeline(tmp_path.resolve(), "a", 1, next_pipeline=FakePipeline(tmp_path.resolve(), "b", 2))
        resources, answerer, reloader = _setup(tmp_path, old)
        _manifest(tmp_path, "b", 2)
        for state in ({"ready": False}, {"draining": True}, {"answerer": None}):
            saved = {k: getattr(resources, k) for k in state}
            for k, v in state.items():
                setattr(resources, k, v)
            with pytest.raises(ReloadError, match="starting or stopping"):
                await reloader.reload()
            for k, v in saved.items():
                setattr(resources, k, v)
        assert answerer.pipeline is old
        assert (await reloader.reload()).status == "reloaded"  # ready again: the same reload goes through
        await answerer.stop()

    asyncio.run(scenario())


Peer = tuple[WorkerSlot, PeerReloads]


def _two_processes_and_version_2(
    tmp_path: Path, wait_s: float
) -> tuple[Peer, Peer, AsyncAnswerer, DatastoreReloader, FakePipeline]:
    """Two server processes' records, both serving version 1, and the first one's reloader (waiting ``wait_s``
    for the others), whose next version, 2, is on disk: ``(a_slot, a), (b_slot, b), answerer, reloader, new``."""
    a, b = _peer(tmp_path), _peer(tmp_path)
    new = FakePipeline(tmp_path.resolve(), "b", 2)
    resources, answerer, reloader = _setup(
        tmp_path, FakePipeline(tmp_path.resolve(), "a", 1, next_pipeline=new)
    )
    resources.settings.reload_wait_s = wait_s
    reloader.peers = a[1]
    b[1].served({"id": "a", "version": 1})
    _manifest(tmp_path, "b", 2)
    return a, b, answerer, reloader, new


def test_reload_all_announces_once_and_answers_with_the_processes_that_serve_the_new_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    async def scenario() -> None:
        (a_slot, a), (b_slot, b), answerer, reloader, new = _two_processes_and_version_2(tmp_path, wait_s=5.0)
        reloader.join_peers({"id": "a", "version": 1})
        task = asyncio.create_task(reloader.reload_all())
        for _ in range(200):  # b is told: the generation moves on once
            if a.generation() == 1:
                break
            await asyncio.sleep(0.01)
        assert a.generation() == 1 and not task.done()  # the answer waits for b
        b.served({"id": "b", "version": 2})
        outcome = await asyncio.wait_for(task, 2)  # at once, not after the 5 s wait
        assert outcome.status == "reloaded" and outcome.processes == 2 and answerer.pipeline is new
        again = await reloader.reload_all()  # nothing new on disk: nobody is told
        assert again.status == "unchanged" and again.processes == 2 and a.generation() == 1
        assert (again.seconds, again.draining) == (0.0, 0)
        assert "server processes serve" not in caplog.text  # every process caught up: no warning
        a_slot.release()
        b_slot.release()
        await answerer.stop()

    asyncio.run(scenario())


def test_reload_all_answers_after_its_wait_with_the_processes_that_caught_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    async def scenario() -> None:
        (a_slot, _), (b_slot, _), answerer, reloader, _ = _two_processes_and_version_2(tmp_path, wait_s=0.2)
        outcome = await asyncio.wait_for(reloader.reload_all(), 5)  # b never follows version 2
        assert outcome.status == "reloaded" and outcome.processes == 1
        assert "1 of 2 server processes serve datastore version 2" in caplog.text
        a_slot.release()
        b_slot.release()
        await answerer.stop()

    asyncio.run(scenario())


class CountingPipeline(FakePipeline):
    """A version whose next one fails or succeeds as set, counting the tries."""

    tries = 0

    def for_datastore(self, root: Path, *, verify_checksums: bool = False) -> object:
        CountingPipeline.tries += 1
        return super().for_datastore(root, verify_checksums=verify_checksums)


def test_the_file_watch_reloads_on_a_new_manifest_tells_the_peers_and_retries_a_refusal_only_when_it_changes(
    tmp_path: Path,
):
    async def wait_until(check: Callable[[], bool]) -> bool:
        for _ in range(300):
            if check():
                return True
            await asyncio.sleep(0.01)
        return False

    async def scenario() -> None:
        (a_slot, a), (b_slot, _) = _peer(tmp_path), _peer(tmp_path)
        _manifest(tmp_path, "a", 1)
        CountingPipeline.tries = 0
        first = CountingPipeline(tmp_path.resolve(), "a", 1)
        first.next_pipeline = ModelLoadError("not the model this datastore was built with")
        _, answerer, reloader = _setup(tmp_path, first)
        reloader.peers = a
        watch = asyncio.create_task(reloader.watch(0.01))
        await asyncio.sleep(0.1)
        assert CountingPipeline.tries == 0  # the manifest has not changed
        _manifest(tmp_path, "b", 2)  # refused
        assert await wait_until(lambda: CountingPipeline.tries == 1)
        await asyncio.sleep(0.1)
        assert (
            CountingPipeline.tries == 1 and answerer.pipeline is first and a.generation() == 0
        )  # not retried
        second = FakePipeline(tmp_path.resolve(), "b", 2)
        first.next_pipeline = second
        _manifest(tmp_path, "b", 2)  # written again (a rename): retried, served, and the peers told
        assert await wait_until(lambda: answerer.pipeline is second)
        assert CountingPipeline.tries == 2 and a.generation() == 1
        assert a.versions()[a.slot] == {"id": "b", "version": 2}
        watch.cancel()
        a_slot.release()
        b_slot.release()
        await answerer.stop()

    asyncio.run(scenario())
