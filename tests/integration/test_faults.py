"""Failing parts: Redis down / killed / restarted / slow / corrupted, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
import redis
from fastapi.testclient import TestClient

from bertknn.service.main import create_app
from bertknn.service.settings import ServiceSettings
from tests.conftest import RedisServer
from tests.support.processes import host_port, service_process

Q = {"text": "zorblat was born in [MASK] .", "subject": "zorblat"}
Q2 = {"text": "frelle dax was born in [MASK] .", "subject": "frelle dax"}


def _app(ds, url, prefix):
    return create_app(
        ServiceSettings(
            datastore=ds,
            model={"device": "cpu"},
            cache={"redis_url": url, "key_prefix": prefix, "timeout_ms": 100},
            batching={"max_wait_ms": 1},
        )
    )


@pytest.fixture(scope="module")
def reference(tiny_datastore):
    """Answers with no cache involved at all: what every faulty-cache answer must equal."""
    with TestClient(create_app(ServiceSettings(datastore=tiny_datastore, model={"device": "cpu"}, cache={"lru_size": 0}))) as c:
        return {q["text"]: c.post("/predict", json=q).json()["predictions"] for q in (Q, Q2)}


def _same(body, reference, q):
    assert body["predictions"] == reference[q["text"]]


def test_redis_down_at_start_then_started(tiny_datastore, reference):
    server = RedisServer(password="pw")
    with TestClient(_app(tiny_datastore, server.url, "down")) as c:
        r = c.post("/predict", json=Q)
        assert r.status_code == 200
        _same(r.json(), reference, Q)
        ready = c.get("/readyz").json()
        assert ready["status"] == "ready" and ready["cache"]["state"] == "degraded"
        server.start()  # Redis comes up: after the back-off the cache is used again
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                body = c.post("/predict", json=Q).json()
                _same(body, reference, Q)
                if body["cache"]["encoding"] == "hit":
                    break
                time.sleep(0.3)
            assert body["cache"]["encoding"] == "hit"
            assert c.get("/readyz").json()["cache"]["state"] == "ok"
        finally:
            server.stop()


def test_redis_killed_and_restarted_mid_run(tiny_datastore, reference):
    server = RedisServer(password="pw").start()
    try:
        with TestClient(_app(tiny_datastore, server.url, "restart")) as c:
            _same(c.post("/predict", json=Q).json(), reference, Q)
            server.stop()
            for _ in range(5):
                _same(c.post("/predict", json=Q).json(), reference, Q)
                _same(c.post("/predict", json=Q2).json(), reference, Q2)
            assert c.get("/readyz").json()["cache"]["state"] == "degraded"
            server.start()  # empty Redis on the same port
            deadline = time.monotonic() + 30
            state = "degraded"
            while time.monotonic() < deadline and state != "ok":
                _same(c.post("/predict", json=Q2).json(), reference, Q2)
                state = c.get("/readyz").json()["cache"]["state"]
                time.sleep(0.3)
            assert state == "ok"
    finally:
        server.stop()


def test_slow_redis_costs_at_most_a_timeout(tiny_datastore, reference):
    server = RedisServer(password="pw").start()
    try:
        with TestClient(_app(tiny_datastore, server.url, "slow")) as c:
            _same(c.post("/predict", json=Q).json(), reference, Q)
            admin = redis.Redis.from_url(server.url)
            blocker = threading.Thread(target=lambda: admin.execute_command("DEBUG", "SLEEP", "2"))
            blocker.start()
            time.sleep(0.1)
            t = time.perf_counter()
            body = c.post("/predict", json=Q).json()
            elapsed = time.perf_counter() - t
            _same(body, reference, Q)
            assert body["cache"]["encoding"] == "miss"  # bypassed, recomputed
            assert elapsed < 1.5, "a slow Redis must not hold the request for its whole stall"
            blocker.join()
    finally:
        server.stop()


def test_redis_name_that_resolves_slowly_costs_at_most_a_timeout(tiny_datastore, reference, monkeypatch):
    """A stopped container's name can take the resolver's retries to fail (getaddrinfo has no timeout of its own)."""
    import socket

    real = socket.getaddrinfo
    stalls: list[float] = []

    def slow_getaddrinfo(host, *args, **kwargs):
        if host == "redis-gone.invalid":
            stalls.append(time.monotonic())
            time.sleep(4)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow_getaddrinfo)
    t_start = time.perf_counter()
    with TestClient(_app(tiny_datastore, "redis://:pw@redis-gone.invalid:6379/0", "dns")) as c:
        assert time.perf_counter() - t_start < 3, "start-up waited on the name resolution"
        for q in (Q, Q2, Q):
            t = time.perf_counter()
            body = c.post("/predict", json=q).json()
            assert time.perf_counter() - t < 1.5, "a request waited on the name resolution"
            _same(body, reference, q)
        assert c.get("/readyz").json()["cache"]["state"] == "degraded"
        t_stop = time.perf_counter()
    assert time.perf_counter() - t_stop < 2, "shutdown waited on the name resolution"
    assert stalls, "the slow resolver was never reached: the test did not test anything"


def test_corrupted_cache_values_are_detected_and_recomputed(tiny_datastore, reference):
    server = RedisServer(password="pw").start()
    try:
        with TestClient(_app(tiny_datastore, server.url, "corrupt")) as c:
            _same(c.post("/predict", json=Q).json(), reference, Q)
            admin = redis.Redis.from_url(server.url)
            # the encoding is written after the answer is sent (nobody waits for a remote cache's writes)
            keys = _eventually(lambda: sorted(admin.keys("corrupt:*")), lambda ks: len(ks) == 2)
            assert len(keys) == 2  # one encoding, one retrieval result
            written = {}
            for i, key in enumerate(keys):
                value = admin.get(key)
                written[key] = value[:-5] + b"xxxxx" if i % 2 else b"garbage"
                admin.set(key, written[key])
            body = c.post("/predict", json=Q).json()
            _same(body, reference, Q)
            assert body["cache"] == {"encoding": "miss", "retrieval": "miss"}
            assert 'bertknn_cache_events_total{event="corrupt"} 2.0' in c.get("/metrics").text
            rewritten = lambda vs: all(v != written[k] for k, v in zip(keys, vs, strict=True))  # noqa: E731
            assert rewritten(_eventually(lambda: [admin.get(k) for k in keys], rewritten))  # both written again
            assert c.post("/predict", json=Q).json()["cache"]["encoding"] == "hit"  # healed
    finally:
        server.stop()


def _eventually(read, done, timeout_s: float = 10.0):
    """``read()`` until ``done`` holds for it (or the time is up): what it read last."""
    deadline = time.monotonic() + timeout_s
    while not done(got := read()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return got


def _refused(url: str, deadline_s: float) -> bool:
    """True once a new connection to ``url`` is refused, polling until ``deadline_s`` has passed."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/healthz", timeout=2)
        except httpx.ConnectError:
            return True
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    return False


def test_sigterm_finishes_in_flight_requests_then_exits(tiny_datastore):
    """Stock uvicorn: SIGTERM stops new connections, lets the request in flight finish (graceful_shutdown_s), runs
    the lifespan's shutdown and exits by the signal. (Kubernetes' preStop sleep covers the endpoint removal.)

    The request is in flight for certain when the signal comes: it asks for ``100 Continue``, which the server
    sends only once the app reads the body, and its body goes only after the signal."""
    env = {"BERTKNN_MODEL__DEVICE": "cpu", "BERTKNN_GRACEFUL_SHUTDOWN_S": "30"}
    with service_process(tiny_datastore, env=env) as svc:
        url, proc = svc.url, svc.proc
        body = json.dumps({"queries": [Q, Q2] * 32}).encode()
        with socket.create_connection(host_port(url), timeout=60) as sock:
            head = (
                f"POST /predict/batch HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n"
            )
            sock.sendall(head.encode())
            assert sock.recv(64).startswith(b"HTTP/1.1 100"), "the app never read the request's body"
            proc.send_signal(signal.SIGTERM)
            assert _refused(url, 20), "new connections were still accepted after SIGTERM"
            sock.sendall(body)
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]  # the request in flight was answered
        answers = json.loads(reply.split(b"\r\n\r\n", 1)[1])
        assert len(answers["results"]) == 64
        assert proc.wait(30) in (0, -signal.SIGTERM)  # a clean exit, or the signal re-raised after the drain
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/readyz", timeout=5)
