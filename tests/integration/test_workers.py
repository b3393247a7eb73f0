"""`bert-knn serve --workers N`: several real server processes behind one port answer as one service.

Each request below opens its own connection, which the kernel gives to whichever process accepts first: it may
favour one, so what each process serves is read from what each records in the run directory the processes share
(`served_versions`), and what they count from the summed metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from bench.rawhttp import AsyncRawClient
from bertknn.builder.settings import AddSettings
from bertknn.builder.update import add_articles
from tests.conftest import write_jsonl
from tests.integration.test_live_update import BRINDLE, TOKEN, UPDATE
from tests.support.processes import ServiceProcess, service_process

ENV = {"BERTKNN_MODEL__DEVICE": "cpu", "BERTKNN_DEFAULTS__RETRIEVER": "tfidf", "BERTKNN_ADMIN_TOKEN": TOKEN}


def workers_of(proc: subprocess.Popen) -> list[int]:
    """The pids of the supervisor's worker processes (its children that run the app)."""
    kids = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return [int(k) for k in kids if "spawn_main" in Path(f"/proc/{k}/cmdline").read_text()]


def wait_for_workers(svc: ServiceProcess, n: int, timeout_s: float = 120) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = workers_of(svc.proc)
        if len(pids) == n and metric(svc.url, "bertknn_ready") == n:
            return pids
        time.sleep(0.2)
    raise AssertionError(f"{n} ready workers expected, have {workers_of(svc.proc)}")


def served_versions(svc: ServiceProcess) -> dict[int, object]:
    """Each live worker's served datastore version, as it recorded it in the run directory (by slot; None for a
    worker still starting, which has recorded none yet)."""
    from bertknn.service.processes import RUN_DIR_ENV, live_slots

    pid = workers_of(svc.proc)[0]
    env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
    root = Path(env[RUN_DIR_ENV])
    found: dict[int, object] = {}
    for slot in live_slots(root):
        record = root / f"served-{slot}.json"
        found[slot] = json.loads(record.read_text())["version"] if record.exists() else None
    return found


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))  # fmt: skip


def ask(url: str, body: dict, n: int) -> list[httpx.Response]:
    """``n`` requests, each on a connection of its own."""
    return [httpx.post(f"{url}/predict", json=body, timeout=30) for _ in range(n)]


@pytest.mark.parametrize("on_event_loop", ["false", "true"])
def test_workers_answer_count_and_survive_sigkill_as_one_service(ds: Path, on_event_loop: str):
    """Also with each worker's batches on its event loop (``batching.on_event_loop``), the layout it is for."""
    env = {**ENV, "BERTKNN_BATCHING__ON_EVENT_LOOP": on_event_loop}
    with service_process(ds, env=env, args=("--workers", "2")) as svc:
        first = wait_for_workers(svc, 2)
        for pid in first:  # each worker's threads, by name in the operating system (top -H, py-spy)
            names = {p.read_text().strip() for p in Path(f"/proc/{pid}/task").glob("*/comm")}
            assert {"model_0", "retrieval_0", "knn_0"} <= names, names
        answers = ask(svc.url, {"text": "zorblat was born in [MASK] ."}, 30)
        assert {r.status_code for r in answers} == {200}
        assert len({r.json()["predictions"][0]["token"] for r in answers}) == 1
        # one process's /metrics shows the requests of both: 30, whichever process answers the scrape
        assert metric(svc.url, 'bertknn_requests_total{path="/predict",status="200"}') == 30
        assert metric(svc.url, "bertknn_ready") == 2

        os.kill(first[0], signal.SIGKILL)  # idle: it has no request in flight, so no request may fail
        answers = ask(svc.url, {"text": "quimby was born in [MASK] ."}, 20)
        assert [r.status_code for r in answers] == [200] * 20
        replaced = wait_for_workers(svc, 2)
        assert first[0] not in replaced and first[1] in replaced
        # the dead process's requests still count; its readiness no longer does
        assert metric(svc.url, 'bertknn_requests_total{path="/predict",status="200"}') == 50
        assert metric(svc.url, "bertknn_ready") == 2


def socket_owners(pids: list[int], port: int) -> dict[int, int]:
    """Each established connection to the service's ``port``, by its client's port: the process that holds it
    (its socket among that process's open files, /proc/net/tcp giving the socket's ports)."""
    inode_pid = {}
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    inode_pid[int(link[8:-1])] = pid
    owners = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        local, remote, state, inode = f[1], f[2], f[3], int(f[9])
        if state == "01" and int(local.split(":")[1], 16) == port and inode in inode_pid:  # 01: established
            owners[int(remote.split(":")[1], 16)] = inode_pid[inode]
    return owners


async def ask_once(client: AsyncRawClient) -> tuple[int | None, int | str]:
    """One question on ``client``'s connection: (its client port, the status or the error's name). A connection
    the server broke is dropped; the next question opens a new one."""
    try:
        status, _ = await client.post_json("/predict", {"text": "zorblat was born in [MASK] ."})
        return client.local_port, status
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        port = client.local_port
        client.abort()
        return port, type(exc).__name__


async def spread_connections(url: str, n: int, pids: list[int]) -> tuple[list[AsyncRawClient], dict[int, int]]:
    """``n`` connections, each answered once, held by both processes (the kernel gives a new connection to
    whichever process accepts first, so all of them may land on one: then they are made again)."""
    host, port = url.removeprefix("http://").split(":")
    for _ in range(20):
        clients = [AsyncRawClient(host, int(port)) for _ in range(n)]
        assert {status for _, status in await asyncio.gather(*(ask_once(c) for c in clients))} == {200}
        owners = socket_owners(pids, int(port))
        if len({owners[c.local_port] for c in clients if c.local_port is not None}) == 2:
            return clients, owners
        for c in clients:
            c.abort()
    raise AssertionError("20 tries, and every time one process accepted all the connections")


async def until_each_asked(asked: list[int], n: int, timeout_s: float = 60) -> None:
    """Wait until every client's count in ``asked`` (the clients update it) is at least ``n``."""
    deadline = time.monotonic() + timeout_s
    while min(asked) < n:
        if time.monotonic() > deadline:
            raise AssertionError(f"a client was not answered {n} times in {timeout_s:.0f} s: {asked}")
        await asyncio.sleep(0.01)


def test_a_worker_killed_under_load_fails_only_its_own_in_flight_requests(ds: Path):
    """SIGKILL to one of two busy processes: only requests on the connections it held fail, one each (the one in
    flight, or the next one sent on a connection it had closed), and every client of the other process is answered
    throughout; its replacement comes up. Every client keeps asking from before the kill until after it, so each
    of the victim's connections is in use when it dies, however fast it answered."""
    clients = 12
    with service_process(ds, env=ENV, args=("--workers", "2")) as svc:
        pids = wait_for_workers(svc, 2)

        async def scenario() -> tuple[list[tuple[int | None, int | str]], dict[int, int], int]:
            conns, owners = await spread_connections(svc.url, clients, pids)
            victim = pids[0]
            out: list[tuple[int | None, int | str]] = []
            asked = [0] * clients
            stop = asyncio.Event()

            async def keep_asking(i: int, c: AsyncRawClient) -> None:
                while not stop.is_set():
                    out.append(await ask_once(c))
                    asked[i] += 1

            load = asyncio.gather(*(keep_asking(i, c) for i, c in enumerate(conns)))
            await until_each_asked(asked, 3)  # requests flowing on both processes
            os.kill(victim, signal.SIGKILL)
            await until_each_asked(asked, max(asked) + 5)  # every client asked again after the kill
            stop.set()
            await load
            return out, owners, victim

        out, owners, victim = asyncio.run(scenario())
        failed = [(me, what) for me, what in out if what != 200]
        theirs = {me for me, pid in owners.items() if pid == victim}
        assert all(owners.get(me) == victim for me, _ in failed), (failed, owners)  # only its connections
        assert sorted(me for me, _ in failed) == sorted(theirs), (failed, theirs)  # one failure each
        survivors = {me for me, pid in owners.items() if pid != victim}
        answered = [what for me, what in out if me in survivors]
        assert answered and set(answered) == {200}  # the other process's clients: every request answered
        assert all(isinstance(what, str) for _, what in failed)  # broken connections, never an error status
        replaced = wait_for_workers(svc, 2)
        assert victim not in replaced


def test_reload_switches_every_worker(ds: Path, tmp_path: Path):
    with service_process(ds, env=ENV, args=("--workers", "2")) as svc:
        wait_for_workers(svc, 2)
        before = ask(svc.url, BRINDLE, 10)
        assert {r.json()["datastore"]["version"] for r in before} == {1}
        add_articles(AddSettings(datastore=ds, corpus=[write_jsonl(tmp_path / "u.jsonl", UPDATE)], device="cpu"))
        r = httpx.post(f"{svc.url}/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
        assert r.status_code == 200, r.text
        assert (r.json()["status"], r.json()["datastore"]["version"], r.json()["processes"]) == ("reloaded", 2, 2)
        assert served_versions(svc) == {0: 2, 1: 2}  # both processes, when the reload answered
        after = ask(svc.url, BRINDLE, 20)
        assert {x.json()["datastore"]["version"] for x in after} == {2}
        assert {x.json()["predictions"][0]["token"] for x in after} == {"zandor"}


def test_a_replacement_that_opens_a_newer_version_brings_the_others_along(ds: Path, tmp_path: Path):
    """`add` ran and nobody reloaded; a process dies and its replacement opens the new version: the others follow
    it, so the service does not answer from two versions for longer than a reload takes."""
    with service_process(ds, env=ENV, args=("--workers", "2")) as svc:
        first = wait_for_workers(svc, 2)
        add_articles(AddSettings(datastore=ds, corpus=[write_jsonl(tmp_path / "u.jsonl", UPDATE)], device="cpu"))
        assert {x.json()["datastore"]["version"] for x in ask(svc.url, BRINDLE, 10)} == {1}  # no reload asked
        assert served_versions(svc) == {0: 1, 1: 1}
        os.kill(first[0], signal.SIGKILL)
        wait_for_workers(svc, 2)
        deadline = time.monotonic() + 60
        while served_versions(svc) != {0: 2, 1: 2} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert served_versions(svc) == {0: 2, 1: 2}
        assert {x.json()["datastore"]["version"] for x in ask(svc.url, BRINDLE, 10)} == {2}


def test_reload_poll_in_every_worker(ds: Path, tmp_path: Path):
    env = {**ENV, "BERTKNN_RELOAD_POLL_S": "0.2"}
    with service_process(ds, env=env, args=("--workers", "2")) as svc:
        wait_for_workers(svc, 2)
        add_articles(AddSettings(datastore=ds, corpus=[write_jsonl(tmp_path / "u.jsonl", UPDATE)], device="cpu"))
        deadline = time.monotonic() + 60
        while served_versions(svc) != {0: 2, 1: 2} and time.monotonic() < deadline:
            time.sleep(0.2)
        assert served_versions(svc) == {0: 2, 1: 2}  # each process's own file watch
        assert {x.json()["datastore"]["version"] for x in ask(svc.url, BRINDLE, 10)} == {2}


def test_first_run_checks_run_once_before_any_worker(tmp_path: Path):
    """A missing datastore: one line, exit 2, and no worker process was ever started."""
    cmd = [sys.executable, "-m", "service", "--datastore", str(tmp_path / "nope"), "--workers", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "no datastore here" in done.stderr
    assert "Started parent process" not in done.stderr


def test_a_client_cost_cap_holds_across_processes(tmp_path: Path):
    """One OS process holds a client's rows in the shared gate; another process's gate refuses that client more,
    admits another client, and (the holder killed) its replacement frees the rows."""
    from bertknn.core.errors import ClientOverloaded, Overloaded
    from bertknn.service.cost import CostCaps
    from bertknn.service.processes import WorkerSlot
    from bertknn.service.shared_gate import SharedCostGate

    caps = CostCaps(max_request_cost=100, max_client_cost=100, max_queued_cost=150)
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from bertknn.service.cost import CostCaps
        from bertknn.service.processes import WorkerSlot
        from bertknn.service.shared_gate import SharedCostGate
        root = Path({str(tmp_path)!r})
        gate = SharedCostGate(CostCaps(100, 100, 150), root, WorkerSlot.claim(root))
        with gate.admit("ip:10.0.0.1", 80, "a request"):
            print("held", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        gate = SharedCostGate(caps, tmp_path, WorkerSlot.claim(tmp_path))
        assert gate.held_total() == 80
        with pytest.raises(ClientOverloaded, match="already has 80 forward rows"), gate.admit("ip:10.0.0.1", 30, "q"):
            pass
        # another client: 140 of 150 in flight
        with gate.admit("ip:10.0.0.2", 60, "q"), pytest.raises(Overloaded, match="140 forward rows"), gate.admit(
            "ip:10.0.0.3", 20, "q"
        ):
            pass
        holder.kill()
        holder.wait()
        takeover = SharedCostGate(caps, tmp_path, WorkerSlot.claim(tmp_path))  # the dead holder's slot
        assert takeover.slot == 0 and gate.held_total() == 0
        with gate.admit("ip:10.0.0.1", 100, "a request"):
            pass
    finally:
        holder.kill()
        holder.wait()


def test_worker_count_defaults(monkeypatch: pytest.MonkeyPatch):
    from bertknn.service import model_load
    from bertknn.service.processes import default_workers

    assert default_workers("cpu", 16) == 1
    assert [default_workers("cuda", c) for c in (1, 4, 16, 64)] == [2, 2, 8, 8]
    monkeypatch.setattr(model_load.runtime, "cpu_quota_threads", lambda: 17)
    assert [model_load.default_threads(w) for w in (1, 2, 8, 32)] == [16, 8, 2, 1]


@pytest.fixture(autouse=True)
def _no_leftover_run_dirs(tmp_path: Path):
    """A stopped server leaves no run directory behind (checked by name: they are made under the temp dir)."""
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("bertknn-run-*"))
    yield
    left = set(Path(tempfile.gettempdir()).glob("bertknn-run-*")) - before
    for d in left:
        shutil.rmtree(d, ignore_errors=True)
    assert not left, f"run directories left behind: {left}"
