"""Domain errors -> HTTP: one mapping table, one body shape ``{"error": {"code", "message", "request_id"}}``."""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Sequence
from contextvars import ContextVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from bertknn.core.errors import (
    AdaptiveRuleError,
    AdminDisabled,
    BertKnnError,
    ClientOverloaded,
    DatastoreError,
    DeadlineExceeded,
    Forbidden,
    InvalidRequest,
    ModelLoadError,
    ModelUnavailable,
    NotReady,
    Overloaded,
    QueryError,
    ReloadError,
    RetrieverUnavailable,
    TooCostly,
    Unauthorized,
    UnknownSubject,
)
from bertknn.service.api.schemas import BatchRequest, FollowRequest, PredictRequest

logger = logging.getLogger(__name__)
# the names each endpoint's body may use: an unknown one is answered with the closest of its own endpoint's
_PREDICT_FIELDS = tuple(sorted(PredictRequest.model_json_schema(by_alias=True)["properties"]))
_BATCH_FIELDS = tuple(sorted(BatchRequest.model_json_schema(by_alias=True)["properties"]))
_FOLLOW_FIELDS = tuple(sorted(FollowRequest.model_json_schema(by_alias=True)["properties"]))
REQUEST_FIELDS: tuple[str, ...] = tuple(sorted({*_PREDICT_FIELDS, *_BATCH_FIELDS, *_FOLLOW_FIELDS}))
_UNION_TAG = re.compile(r"[-\[('\]]")  # pydantic's name of a union member in a location: constrained-float


def fields_for(path: str, loc: Sequence[object]) -> tuple[str, ...]:
    """The fields allowed where an unknown one was sent: a batch's queries are /predict bodies."""
    if path.startswith("/predict/batch"):
        return _PREDICT_FIELDS if "queries" in loc[:-1] else _BATCH_FIELDS
    if path.startswith("/follow"):
        return _FOLLOW_FIELDS
    return _PREDICT_FIELDS if path.startswith("/predict") else REQUEST_FIELDS
request_id_var: ContextVar[str] = ContextVar("request_id", default="-")
INTERNAL_MESSAGE = "internal error; the request id identifies it in the server log"
# errors whose text names the machine's files (paths, OS errors): the log gets it, the caller a fixed message
PRIVATE_MESSAGES: dict[type[BertKnnError], str] = {
    DatastoreError: "the datastore could not be read for this request; the server log has the details under its "
    "request id",
    ModelLoadError: "the model is unavailable; the server log has the details under this request id",
}

# the one table: error class -> (HTTP status, error code). A subclass not listed takes its nearest listed base.
ERROR_TABLE: dict[type[BertKnnError], tuple[int, str]] = {
    QueryError: (422, "invalid_query"),
    TooCostly: (422, "too_costly"),
    UnknownSubject: (422, "unknown_subject"),
    InvalidRequest: (422, "invalid_request"),
    AdaptiveRuleError: (422, "invalid_request"),
    RetrieverUnavailable: (422, "retriever_unavailable"),
    Unauthorized: (401, "unauthorized"),
    AdminDisabled: (403, "admin_disabled"),
    Forbidden: (403, "forbidden"),
    ReloadError: (409, "reload_failed"),
    NotReady: (503, "not_ready"),
    ClientOverloaded: (429, "too_many_requests"),
    Overloaded: (503, "overloaded"),
    DeadlineExceeded: (504, "deadline_exceeded"),
    DatastoreError: (503, "datastore_unavailable"),
    ModelLoadError: (503, "model_unavailable"),
    BertKnnError: (500, "internal"),
}
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}


def status_and_code(exc: BertKnnError) -> tuple[int, str]:
    for cls in type(exc).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return 500, "internal"


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    rid = request_id_var.get()
    return JSONResponse(
        {"error": {"code": code, "message": message, "request_id": rid}},
        status_code=status,
        headers={"X-Request-ID": rid, **(headers or {})},
    )


def internal_error_response() -> JSONResponse:
    """The catch-all: the traceback goes to the log (by the caller), the client gets a fixed message."""
    return error_response(500, "internal", INTERNAL_MESSAGE)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _unknown_field(name: str, allowed: Sequence[str]) -> str:
    close = difflib.get_close_matches(name, allowed, n=1, cutoff=0.6)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown field; {hint}allowed: {', '.join(allowed)}"


BODY_UNREADABLE = "There was an error parsing the body"


def _validation_message(exc: RequestValidationError, content_type: str | None, path: str = "/predict") -> str:
    """Pydantic's errors, each with the field it is about (in the request's own words: no union member names;
    the alternatives of one field in one part); a body that is not a JSON object says what to send."""
    parts: dict[str, list[str]] = {}
    for err in exc.errors()[:8]:
        loc = tuple(x for x in err.get("loc", ()) if not (isinstance(x, str) and _UNION_TAG.search(x)))
        where = ".".join(str(x) for x in loc if x != "body") or "body"
        kind = err.get("type", "")
        if loc == ("body",) and content_type is not None and not _is_json(content_type):
            msg = f"send JSON with Content-Type: application/json (got {content_type or 'no content type'})"
        elif kind == "json_invalid":
            msg = f"Invalid JSON ({err.get('ctx', {}).get('error', 'cannot be parsed')})"
            where = "body"
        elif loc == ("body",) and kind in ("model_attributes_type", "dict_type"):
            msg = "Input should be an object"
        elif kind == "extra_forbidden":
            msg = _unknown_field(str(loc[-1]), fields_for(path, loc))
        elif isinstance(err.get("input"), float) and not math.isfinite(err["input"]):
            x = err["input"]  # JSON's NaN and Infinity fail any bound: named as the request spelt them
            msg = f"must be a finite number, not {'NaN' if math.isnan(x) else ('-' if x < 0 else '') + 'Infinity'}"
        else:
            msg = str(err.get("msg", "invalid"))
        if msg not in parts.setdefault(where, []):
            parts[where].append(msg)
    return "; ".join(f"{where}: {' or '.join(msgs)}" for where, msgs in list(parts.items())[:5])


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BertKnnError)
    async def _domain(_: Request, exc: BertKnnError) -> JSONResponse:
        status, code = status_and_code(exc)
        if status >= 500 and code == "internal":
            logger.error("unexpected domain error (request %s)", request_id_var.get(), exc_info=exc)
            return internal_error_response()
        private = next((m for cls, m in PRIVATE_MESSAGES.items() if isinstance(exc, cls)), None)
        if private is not None:
            logger.error("request %s: %s", request_id_var.get(), exc)
            return error_response(status, code, private)
        headers = None
        if isinstance(exc, Overloaded | DeadlineExceeded | ModelUnavailable):
            headers = {"Retry-After": str(exc.retry_after_s)}
        elif isinstance(exc, Unauthorized):
            headers = {"WWW-Authenticate": 'Bearer realm="bertknn-admin"'}
        return error_response(status, code, str(exc) or code, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        has_body = request.method in ("POST", "PUT", "PATCH")
        content_type = request.headers.get("content-type", "") if has_body else None
        return error_response(422, "invalid_request", _validation_message(exc, content_type, request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        path = request.url.path
        if exc.status_code == 400 and message == BODY_UNREADABLE:  # FastAPI's words for a body json.loads refused
            body = await request.body()
            try:
                body.decode("utf-8")
            except UnicodeDecodeError as err:
                return error_response(422, "invalid_request", f"body: not UTF-8 text (byte {err.start} is "
                                      f"{body[err.start:err.start + 1]!r}); send JSON encoded as UTF-8")  # fmt: skip
            return error_response(422, "invalid_request", "body: cannot be parsed as JSON; send a JSON object")
        if exc.status_code == 404 and path.endswith("/") and path != "/":
            message = f"no route {path}: the API's paths have no trailing slash (use {path.rstrip('/')})"
        elif exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {path}; use {allowed or 'another method'}"
        return error_response(
            exc.status_code, HTTP_CODES.get(exc.status_code, "http_error"), message, dict(exc.headers or {})
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error (request %s)", request_id_var.get())
        return internal_error_response()
