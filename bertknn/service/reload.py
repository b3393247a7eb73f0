"""Live datastore reload: open the new version beside the running one, swap, release the old one once drained.

The new `AnswerPipeline` reuses the loaded model and the cache (`AnswerPipeline.for_datastore`); only the
datastore's own parts are opened (manifest, validation, article table, sparse indexes, subject lookup). The
swap is one attribute assignment on the event loop: requests that started before it hold the old pipeline
(`AsyncAnswerer.lease`) and finish on it; later ones get the new one. The old pipeline's indexes are closed
after its last request. A datastore that fails validation, or was built with another model, is refused and the
running version keeps serving.

With several server processes (`bertknn.service.processes`), a reload in one is announced to the others
(`PeerReloads`): each reloads on its own (each swaps whole versions, so none serves a mixed datastore), and the
process that was asked answers once every live process serves the new version.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bertknn.core.errors import DatastoreError, ModelLoadError, ReloadError
from bertknn.core.format import MANIFEST, read_manifest
from bertknn.service import heap
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.processes import live_slots
from bertknn.service.resources import Resources

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReloadOutcome:
    status: Literal["reloaded", "unchanged"]
    previous: dict[str, object]  # identity()["datastore"] of the version served before
    current: dict[str, object]
    seconds: float
    draining: int  # requests still finishing on the previous version
    processes: int = 1  # server processes serving ``current`` when the reload answered


class DatastoreReloader:
    """Serialises reloads (HTTP or file watch) of the datastore directory the service was started with."""

    def __init__(
        self, resources: Resources, *, drain_timeout_s: float = 300.0, peers: PeerReloads | None = None
    ):
        self.resources = resources
        self.drain_timeout_s = drain_timeout_s
        self.peers = peers
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()

    async def reload_all(self) -> ReloadOutcome:
        """`reload`, then (several processes) the others told and waited for: ``processes`` serve the result."""
        outcome = await self.reload()
        if self.peers is None:
            return outcome
        self._publish(outcome, announce=True)
        count = await self.peers.wait_for(outcome.current, self.resources.settings.reload_wait_s)
        return ReloadOutcome(outcome.status, outcome.previous, outcome.current, outcome.seconds, outcome.draining, count)

    def _root(self) -> Path:
        # Resolved at each reload: a symlink flipped to another directory is followed, while the running
        # pipeline keeps the directory it opened.
        return Path(self.resources.settings.datastore).resolve()

    async def reload(self) -> ReloadOutcome:
        """Serve the datastore's current manifest if it differs from the one being served."""
        async with self._lock:
            answerer = self.resources.answerer
            if answerer is None or not self.resources.ready or self.resources.draining:
                raise ReloadError("the service is starting or stopping; retry when /readyz says ready")
            old = answerer.pipeline
            before = old.identity()["datastore"]
            root = self._root()
            t0 = time.perf_counter()
            try:
                manifest = await asyncio.to_thread(read_manifest, root)
            except DatastoreError as exc:
                raise ReloadError(f"{exc}; still serving version {before['version']}") from exc
            if (
                manifest.datastore_id == old.datastore.id
                and manifest.version == old.datastore.version
                and root == old.datastore.root.resolve()
            ):
                return ReloadOutcome("unchanged", before, before, 0.0, 0)
            try:
                new = await asyncio.to_thread(
                    old.for_datastore, root, verify_checksums=self.resources.settings.verify_checksums
                )
            except (DatastoreError, ModelLoadError) as exc:
                raise ReloadError(f"{exc}; still serving version {before['version']}") from exc
            except Exception as exc:
                logger.exception("reload of %s failed", root)
                raise ReloadError(
                    f"opening {root} failed ({type(exc).__name__}; see the server log); still serving version "
                    f"{before['version']}"
                ) from exc
            answerer.pipeline = new  # the swap: new requests lease the new version from here on
            self.resources.pipeline = new
            seconds = time.perf_counter() - t0
            draining = answerer.leases.in_flight(old)
            task = asyncio.create_task(self._retire(old))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            after = new.identity()["datastore"]
            logger.info(
                "datastore reloaded: version %s (%s) -> %s (%s) in %.2f s, %d requests finishing on the old one",
                before["version"], before["id"], after["version"], after["id"], seconds, draining,
            )  # fmt: skip
            return ReloadOutcome("reloaded", before, after, seconds, draining)

    async def _retire(self, old: AnswerPipeline) -> None:
        answerer = self.resources.answerer
        if answerer is not None and not await answerer.leases.drained(old, self.drain_timeout_s):
            logger.warning(
                "requests still hold datastore version %s after %.0f s; its indexes stay open",
                old.datastore.version, self.drain_timeout_s,
            )  # fmt: skip
            return
        await asyncio.to_thread(old.release)
        retired, version = weakref.ref(old), old.datastore.version
        del old  # this task's reference: the old version's cycles are collectable once the requests let go too
        await _collect(retired, version)

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = (self._root() / MANIFEST).stat()
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    async def watch(self, interval_s: float) -> None:
        """Poll the manifest (inode, size, mtime: ``add`` replaces it by a rename) and reload when it changes."""
        last = self._stamp()
        while True:
            await asyncio.sleep(interval_s)
            stamp = self._stamp()
            if stamp is None or stamp == last:
                continue
            last = stamp  # a refused version is not retried until the manifest changes again
            try:
                outcome = await self.reload()
            except ReloadError as exc:
                logger.error("datastore reload (file watch) refused: %s", exc)
                continue
            self._publish(outcome, announce=True)

    def _publish(self, outcome: ReloadOutcome, *, announce: bool) -> None:
        """Several processes: record the version this one serves now, and (``announce``) tell the others when it
        changed, so that they reload too."""
        if self.peers is None:
            return
        self.peers.served(outcome.current)
        if announce and outcome.status == "reloaded":
            self.peers.announce()

    def join_peers(self, current: dict[str, object]) -> None:
        """Several processes, at start-up: record the version this process opened. When a peer that has recorded
        one serves another (this process replaces a dead one and opened a newer version, or it opened an older
        one while the others moved on during its start-up), every process is told to reload, this one included
        (`follow_peers` starts from the generation `PeerReloads` read before the model was loaded). Peers still
        starting have recorded nothing yet: they open the manifest on disk themselves."""
        assert self.peers is not None
        self.peers.served(current)
        mine = _version(current)
        others = {slot: v for slot, v in self.peers.versions().items() if slot != self.peers.slot}
        differ = sum(v != mine for v in others.values())
        if differ:
            logger.info("this process serves datastore version %s, %d of %d other processes another: reloading all",
                        current["version"], differ, len(others))  # fmt: skip
            self.peers.announce()

    async def follow_peers(self, interval_s: float = 0.2) -> None:
        """Several processes: reload whenever another process announces that it did, or did while this one was
        starting (a reload of a version already served is a no-op)."""
        assert self.peers is not None
        seen = self.peers.start_generation
        while True:
            now = self.peers.generation()
            if now != seen:
                seen = now
                try:
                    outcome = await self.reload()
                except ReloadError as exc:
                    logger.error("datastore reload (announced by another server process) refused: %s", exc)
                else:
                    self._publish(outcome, announce=False)
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        """Cancel the reload's tasks and wait for them: a collection running on a thread ends first, so that
        nothing settles the heap after the app gives it back (`heap.thaw`)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class PeerReloads:
    """The reload generation the server processes share, and the version each one serves (its slot's file)."""

    def __init__(self, root: Path, slot: int):
        """Made before the process loads its model: a dead predecessor's record in this slot is dropped, and the
        generation is read, so that a reload announced while this process starts is not missed."""
        self.root = root
        self.slot = slot
        self._generation = root / "reload-generation"
        self._generation.touch(exist_ok=True)
        (root / f"served-{slot}.json").unlink(missing_ok=True)
        self.start_generation = self.generation()

    def generation(self) -> int:
        text = self._generation.read_text().strip()
        return int(text) if text else 0

    def announce(self) -> None:
        with open(self._generation, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            value = int(f.read().strip() or 0) + 1
            f.seek(0)
            f.truncate()
            f.write(str(value))

    def served(self, identity: dict[str, object]) -> None:
        """Record the datastore version this process serves now (written whole: a rename)."""
        tmp = self.root / f"served-{self.slot}.json.tmp"
        tmp.write_text(json.dumps(_version(identity)))
        tmp.replace(self.root / f"served-{self.slot}.json")

    def versions(self) -> dict[int, dict[str, object]]:
        """The version each live process has recorded, by slot (a process still starting has none yet)."""
        return self._recorded(live_slots(self.root))

    def serving(self, identity: dict[str, object]) -> tuple[int, int]:
        """(live processes that serve ``identity``, live processes); one still starting serves nothing yet."""
        live = live_slots(self.root)
        want = _version(identity)
        return sum(v == want for v in self._recorded(live).values()), len(live)

    def _recorded(self, slots: list[int]) -> dict[int, dict[str, object]]:
        found = {}
        for slot in slots:
            with contextlib.suppress(OSError, ValueError):
                found[slot] = json.loads((self.root / f"served-{slot}.json").read_text())
        return found

    async def wait_for(self, identity: dict[str, object], timeout_s: float) -> int:
        """Wait (at most ``timeout_s``) until every live process serves ``identity``; how many do."""
        deadline = time.monotonic() + timeout_s
        while True:
            same, live = self.serving(identity)
            if same >= live or time.monotonic() >= deadline:
                if same < live:
                    logger.warning("after %.0f s, %d of %d server processes serve datastore version %s",
                                   timeout_s, same, live, identity.get("version"))  # fmt: skip
                return same
            await asyncio.sleep(0.05)


RESETTLE_WAITS_S = tuple(0.01 * 2**k for k in range(10))  # growing waits between collections, about 10 s in all


async def _collect(retired: weakref.ref[AnswerPipeline], version: int) -> None:
    """Collect the retired version's cycles and freeze the heap again (`heap.resettle`), again after a short
    wait while the version is still alive: an executor's thread keeps its work item (a call such as
    ``old.for_datastore`` and its arguments) a moment after the awaiting coroutine has gone on, and what a
    collection finds alive is frozen again, out of every later collection until the next reload."""
    for wait in (*RESETTLE_WAITS_S, None):
        await _to_thread_to_the_end(heap.resettle)
        if retired() is None:
            return
        if wait is not None:
            await asyncio.sleep(wait)
    logger.warning("datastore version %s is still referenced after its release; its memory is kept", version)


async def _to_thread_to_the_end(fn: Callable[[], object]) -> None:
    """``fn`` on a thread, waited for to its end even when this task is cancelled (then cancelled after it)."""
    run = asyncio.ensure_future(asyncio.to_thread(fn))
    try:
        await asyncio.shield(run)
    except asyncio.CancelledError:
        await run
        raise


def _version(identity: dict[str, object]) -> dict[str, object]:
    return {"id": identity.get("id"), "version": identity.get("version")}
