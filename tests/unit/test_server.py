"""The HTTP server's corked transport: one write per response, bytes in order, nothing lost or held back."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import bertknn.service.server as server_mod
from bertknn.service.server import CorkedTransport
from tests.conftest import serve_asgi


class FakeTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = self.aborted = self.eof = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def write_eof(self) -> None:
        self.eof = True

    def get_write_buffer_size(self) -> int:
        return 7

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5)}.get(name, default)


def test_writes_of_one_loop_step_go_out_as_one_write_at_its_end() -> None:
    async def main() -> None:
        raw = FakeTransport()
        t = CorkedTransport(raw, asyncio.get_running_loop())
        t.write(b"HTTP/1.1 200 OK\r\n\r\n")
        t.write(b"")
        t.writelines([memoryview(b"body"), bytearray(b"!")])
        assert raw.writes == [] and t.held_bytes == 24 and t.get_write_buffer_size() == 7 + 24
        await asyncio.sleep(0)  # the step ends: one write, the bytes in order
        assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody!"] and t.held_bytes == 0
        t.write(b"next")
        await asyncio.sleep(0)
        assert raw.writes[1:] == [b"next"]
        assert t.get_extra_info("peername") == ("127.0.0.1", 5)  # everything else is the transport's

    asyncio.run(main())


def test_a_full_buffer_is_written_at_once_and_close_writes_what_is_held() -> None:
    async def main() -> None:
        raw = FakeTransport()
        t = CorkedTransport(raw, asyncio.get_running_loop(), limit=10)
        t.write(b"12345")
        t.write(b"67890")  # reaches the limit: written now, not at the end of the step
        assert raw.writes == [b"1234567890"]
        t.write(b"tail")
        t.close()
        assert raw.writes == [b"1234567890", b"tail"] and raw.closed
        await asyncio.sleep(0)  # the flush scheduled for "tail" finds nothing left
        assert len(raw.writes) == 2
        t.write(b"late")  # after close: dropped, as the transport itself would drop it
        await asyncio.sleep(0)
        assert len(raw.writes) == 2

        raw2 = FakeTransport()
        t2 = CorkedTransport(raw2, asyncio.get_running_loop())
        t2.write(b"x")
        t2.write_eof()
        assert raw2.writes == [b"x"] and raw2.eof
        t2.write(b"never")
        t2.abort()  # abort discards what is held
        await asyncio.sleep(0)
        assert raw2.writes == [b"x"] and raw2.aborted

    asyncio.run(main())


@pytest.fixture
def recorded_server(monkeypatch: pytest.MonkeyPatch):
    """A real uvicorn server configured as the service's (`serve_asgi`), the writes that reach each real transport recorded."""
    writes: list[bytes] = []

    class Recorder:
        def __init__(self, transport: Any):
            self._t = transport

        def write(self, data: bytes) -> None:
            writes.append(bytes(data))
            self._t.write(data)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._t, name)

    class Recorded(CorkedTransport):
        def __init__(self, transport: Any, loop: Any, limit: int = 64 * 1024):
            super().__init__(Recorder(transport), loop, limit)  # type: ignore[arg-type]

    monkeypatch.setattr(server_mod, "CorkedTransport", Recorded)

    async def small(request: Any) -> Response:
        return JSONResponse({"answer": "ulm", "n": int(request.query_params.get("n", 0))})

    async def big(request: Any) -> Response:
        return Response(b"x" * 200_000, media_type="application/octet-stream")

    async def stream(request: Any) -> Response:
        async def parts():
            for i in range(3):
                yield f"part{i};".encode()
                await asyncio.sleep(0.01)

        return StreamingResponse(parts(), media_type="text/plain")

    app = Starlette(routes=[Route("/small", small), Route("/big", big), Route("/stream", stream)])
    with serve_asgi(app) as port:
        yield f"http://127.0.0.1:{port}", writes


def test_the_server_writes_each_response_once_and_keeps_every_byte(recorded_server) -> None:
    url, writes = recorded_server
    with httpx.Client(base_url=url) as client:  # one keep-alive connection
        for n in range(5):
            writes.clear()
            r = client.get(f"/small?n={n}")
            assert r.status_code == 200 and r.json() == {"answer": "ulm", "n": n}
            assert len(writes) == 1, writes  # status line, headers and body: one write
            assert writes[0].startswith(b"HTTP/1.1 200 OK\r\n") and writes[0].endswith(json.dumps(
                {"answer": "ulm", "n": n}, separators=(",", ":")).encode())  # fmt: skip
        writes.clear()
        assert client.get("/big").content == b"x" * 200_000  # over the limit: written at once, all of it
        assert sum(len(w) for w in writes) > 200_000
        writes.clear()
        r = client.get("/stream")  # chunked, with pauses between the parts: each part goes out in its step
        assert r.text == "part0;part1;part2;"
        assert len(writes) >= 3
        assert client.head("/small").status_code in (200, 405)
        assert client.get("/small?n=9").json()["n"] == 9  # the connection still works after all that
