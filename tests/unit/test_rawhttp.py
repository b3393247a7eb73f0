"""The benchmarks' lean HTTP client against a real uvicorn server: keep-alive, bodies, statuses, refusals."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest

from bench.rawhttp import AsyncRawClient, HttpError, RawClient
from tests.conftest import read_body, serve_asgi


async def _app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    body = await read_body(receive)
    if scope["path"] == "/chunked":  # no Content-Length: uvicorn sends it chunked
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"a", "more_body": True})
        await send({"type": "http.response.body", "body": b"b"})
        return
    payload = json.loads(body)
    out = json.dumps({"echo": payload, "path": scope["path"], "pad": "x" * payload.get("pad", 0)}).encode()
    status = 422 if scope["path"] == "/bad" else 200
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": out})


@pytest.fixture(scope="module")
def server() -> Iterator[int]:
    with serve_asgi(_app) as port:
        yield port


def test_blocking_client_keeps_one_connection_and_reads_whole_bodies(server: int) -> None:
    with RawClient("127.0.0.1", server) as c:
        for i, pad in enumerate((0, 200_000, 3)):  # a body larger than one recv, then small ones
            status, body = c.post_json("/predict", {"i": i, "pad": pad})
            assert status == 200
            got = json.loads(body)
            assert got["echo"] == {"i": i, "pad": pad} and len(got["pad"]) == pad
        status, body = c.post_json("/bad", {"x": 1})
        assert status == 422 and json.loads(body)["path"] == "/bad"
        with pytest.raises(HttpError, match="chunked"):
            c.post_json("/chunked", {})


def test_async_clients_run_concurrently(server: int) -> None:
    async def main() -> list[tuple[int, dict]]:
        clients = [AsyncRawClient("127.0.0.1", server) for _ in range(4)]
        try:
            replies = await asyncio.gather(*(c.post_json("/p", {"n": n}) for n, c in enumerate(clients)))
            again = await clients[0].post_json("/p", {"n": 9})  # the same connection, reused
            return [(s, json.loads(b)) for s, b in [*replies, again]]
        finally:
            for c in clients:
                await c.close()

    out = asyncio.run(main())
    assert [(s, b["echo"]["n"]) for s, b in out] == [(200, 0), (200, 1), (200, 2), (200, 3), (200, 9)]
