"""The service's ASGI middlewares: the request's id, metrics and log line; the body size limit."""

from __future__ import annotations

import logging
import re
import time
import uuid
from typing import Any

from starlette.datastructures import MutableHeaders
from starlette.requests import Request
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from bertknn.core.logs import Event
from bertknn.service.api.errors import error_response, internal_error_response, request_id_var
from bertknn.service.resources import Resources

logger = logging.getLogger("service")
_RID_OK = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_LOG_FIELDS = "log_fields"  # the request's state key under which a route leaves what its log line adds


def note(request: Request, **fields: Any) -> None:
    """Fields a route adds to its request's log line (cache use, stage times, counts)."""
    setattr(request.state, _LOG_FIELDS, fields)


class RequestContextMiddleware:
    """Request id (``X-Request-ID``, taken from the client when well formed), metrics, access log, last-resort 500.

    A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` runs each request through an extra task and
    memory streams, which cost more than the rest of the HTTP layer together on the cached path.
    """

    def __init__(self, app: ASGIApp, resources: Resources):
        self.app = app
        self.resources = resources

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next((v for k, v in scope.get("headers") or () if k == b"x-request-id"), b"").decode("latin-1")
        rid = incoming if _RID_OK.match(incoming) else uuid.uuid4().hex[:16]
        token = request_id_var.set(rid)
        state = scope.setdefault("state", {})  # (the same dict as the route's request.state)
        t0 = time.perf_counter()
        status = 500
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                started = True
                status = message["status"]
                headers = MutableHeaders(scope=message)
                headers["X-Request-ID"] = rid
            await send(message)

        try:
            try:
                await self.app(scope, receive, send_with_id)
            except Exception:  # errors escaping the handlers still get the one body shape
                logger.exception("unhandled error (request %s)", rid)
                if started:
                    raise
                await internal_error_response()(scope, receive, send_with_id)
        finally:
            elapsed = time.perf_counter() - t0
            path = route_label(scope)
            self.resources.metrics.observe_request(path, status, elapsed)
            if logger.isEnabledFor(logging.INFO):
                fields = {
                    "id": rid, "method": scope.get("method"), "path": scope.get("path"), "status": status,
                    "latency_ms": round(elapsed * 1000, 1), **state.get(_LOG_FIELDS, {}),
                }  # fmt: skip
                logger.info(Event("request", fields))
            request_id_var.reset(token)


def route_label(scope: Scope) -> str:
    """The metrics label of a request: its route's template (``/predict``, ``/docs``, ``/docs/assets``), or
    ``unmatched`` for a path no route serves (so that scanners cannot blow up the label set)."""
    route = scope.get("route")
    if route is not None:
        return str(getattr(route, "path", "unmatched"))
    app = scope.get("app")
    for candidate in getattr(getattr(app, "router", None), "routes", ()):
        match, _ = candidate.matches({**scope, "type": "http"})
        if match is Match.FULL:
            return str(getattr(candidate, "path", "unmatched"))
    return "unmatched"


class BodyLimitMiddleware:
    """Refuse request bodies over ``max_bytes`` (by header, and while streaming) with 413."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_big(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge
            return msg

        try:
            await self.app(scope, limited, send)
        except _BodyTooLarge:
            await self._too_big(scope, receive, send)

    async def _too_big(self, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(413, "payload_too_large", f"request body over {self.max_bytes} bytes")(scope, receive, send)


class _BodyTooLarge(Exception):
    pass
