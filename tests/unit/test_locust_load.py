"""The throughput benchmark's locust load generator (bench/locust_load.py, its own process) against a real
uvicorn server: every query sent exactly once, statuses counted, concurrency as asked, bad input refused."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import read_body, serve_asgi

REPO = Path(__file__).resolve().parents[2]


class _Server:
    def __init__(self) -> None:
        self.seen: Counter[str] = Counter()
        self.subjects: dict[str, object] = {}
        self.active = self.peak = 0

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        payload = json.loads(await read_body(receive))
        self.seen[payload["text"]] += 1
        self.subjects[payload["text"]] = payload["subject"]
        self.active += 1
        self.peak = max(self.peak, self.active)
        await asyncio.sleep(0.02)  # long enough for every user to have a request open at once
        self.active -= 1
        status = 503 if "overload" in payload["text"] else 200
        out = b'{"predictions": []}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out})


@pytest.fixture()
def server() -> Iterator[tuple[_Server, str]]:
    app = _Server()
    with serve_asgi(app) as port:
        yield app, f"http://127.0.0.1:{port}"


def _run(url: str, users: str, stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bench.locust_load", "--url", url, "--users", users], input=stdin,
                          capture_output=True, text=True, cwd=REPO, timeout=120)  # fmt: skip


def test_every_query_once_with_the_users_asked_for(server: tuple[_Server, str]) -> None:
    app, url = server
    queries = [[f"query {i} [MASK] .", f"Subject {i}" if i % 2 else None] for i in range(40)]
    queries += [["overload [MASK] .", "x"], ["overload again [MASK] .", None]]
    run = _run(url, "8", json.dumps(queries))
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["ok"] == 40 and out["errors"] == 2
    assert set(app.seen) == {q[0] for q in queries} and set(app.seen.values()) == {1}  # each exactly once
    assert all(app.subjects[t] == s for t, s in queries)
    assert app.peak == 8  # the users ran concurrently, no more than asked
    assert out["seconds"] >= 42 / 8 * 0.02 and out["cpu_s"] > 0


def test_bad_input_is_refused_with_a_message(server: tuple[_Server, str]) -> None:
    app, url = server
    run = _run(url, "4", "not json")
    assert run.returncode == 2 and "JSON list of [text, subject] pairs" in run.stderr
    run = _run(url, "0", "[]")
    assert run.returncode == 2 and "--users must be at least 1" in run.stderr
    assert not app.seen
