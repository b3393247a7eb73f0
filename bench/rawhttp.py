"""A lean HTTP/1.1 keep-alive client for the serving benchmarks (one connection per client, JSON POSTs).

The load generator shares this machine's cores with the server. httpx spends 1.5-2.5 ms of CPU per request
on these 2 cores (``bench.serving`` prints it), CPU the server then lacks, so its throughput figures measure
the client as much as the server. This client writes the request bytes and parses the status line and
Content-Length itself: a few tens of microseconds per request. ``bench.serving`` reports both clients.
"""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any


class HttpError(RuntimeError):
    pass


def _request(host: str, path: str, payload: Any) -> bytes:
    body = json.dumps(payload).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


def _parse_head(head: bytes) -> tuple[int, int]:
    """(status, content length) of a response head (without the blank line)."""
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    length = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            raise HttpError("chunked responses are not supported by this client")
    if length is None:
        raise HttpError("response without Content-Length")
    return status, length


class AsyncRawClient:
    """One keep-alive connection; ``post_json`` may not be called concurrently on one client."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post_json(self, path: str, payload: Any) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
            self._writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        assert self._reader is not None
        self._writer.write(_request(self.host, path, payload))
        head = await self._reader.readuntil(b"\r\n\r\n")
        status, length = _parse_head(head[:-4])
        return status, await self._reader.readexactly(length)

    @property
    def local_port(self) -> int | None:
        """This connection's own port (None before it is opened): how the server side tells it apart."""
        return None if self._writer is None else int(self._writer.get_extra_info("sockname")[1])

    def abort(self) -> None:
        """Drop a connection the server broke, without waiting on it; the next ``post_json`` opens a new one."""
        if self._writer is not None:
            self._writer.transport.abort()
            self._writer = None

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()
            self._writer = None


class RawClient:
    """The blocking twin of `AsyncRawClient`, for sequential latency runs."""

    def __init__(self, host: str, port: int):
        self.host = host
        self._sock = socket.create_connection((host, port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""

    def post_json(self, path: str, payload: Any) -> tuple[int, bytes]:
        self._sock.sendall(_request(self.host, path, payload))
        while b"\r\n\r\n" not in self._buf:
            self._recv()
        head, self._buf = self._buf.split(b"\r\n\r\n", 1)
        status, length = _parse_head(head)
        while len(self._buf) < length:
            self._recv()
        body, self._buf = self._buf[:length], self._buf[length:]
        return status, body

    def _recv(self) -> None:
        chunk = self._sock.recv(1 << 16)
        if not chunk:
            raise HttpError("the server closed the connection")
        self._buf += chunk

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
