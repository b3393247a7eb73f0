"""Domain errors -> HTTP: one mapping table, one body shape ``{"error": {"code", "message", "request_id"}}``."""

from __future__ import annotations

import logging
from contextvars import ContextVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from bertknn.core.errors import QueryError, ReloadError, RetrieverUnavailable

logger = logging.getLogger(__name__)
request_id_var: ContextVar[str] = ContextVar("request_id", default="-")


class ServiceError(Exception):
    status = 500
    code = "internal"


class BadRequest(ServiceError):
    status = 422
    code = "invalid_request"


class NotReady(ServiceError):
    status = 503
    code = "not_ready"


class Overloaded(ServiceError):
    status = 503
    code = "overloaded"
    retry_after_s = 1


class PayloadTooLarge(ServiceError):
    status = 413
    code = "payload_too_large"


class Unauthorized(ServiceError):
    status = 401
    code = "unauthorized"


class Forbidden(ServiceError):
    status = 403
    code = "forbidden"


class AdminDisabled(ServiceError):
    status = 403
    code = "admin_disabled"


# exception type -> (HTTP status, error code)
ERROR_TABLE: dict[type[Exception], tuple[int, str]] = {
    QueryError: (422, "invalid_query"),
    RetrieverUnavailable: (422, "retriever_unavailable"),
    ReloadError: (409, "reload_failed"),
}


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    rid = request_id_var.get()
    return JSONResponse(
        {"error": {"code": code, "message": message, "request_id": rid}},
        status_code=status,
        headers={"X-Request-ID": rid, **(headers or {})},
    )


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ServiceError)
    async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Overloaded) else None
        if isinstance(exc, Unauthorized):
            headers = {"WWW-Authenticate": 'Bearer realm="bertknn-admin"'}
        return error_response(exc.status, exc.code, str(exc) or exc.code, headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(422, "invalid_request", _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, code, str(exc.detail))

    for exc_type, (status, code) in ERROR_TABLE.items():

        async def _mapped(_: Request, exc: Exception, status: int = status, code: str = code) -> JSONResponse:
            return error_response(status, code, str(exc))

        app.add_exception_handler(exc_type, _mapped)  # type: ignore[arg-type]

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error (request %s)", request_id_var.get())
        return error_response(500, "internal", "internal error; the request id identifies it in the server log")
