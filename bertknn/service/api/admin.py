"""Admin routes (``/admin/*``): enabled only when ``BERTKNN_ADMIN_TOKEN`` is set, called with that bearer token."""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header

from bertknn.service.api.deps import ResourcesDep
from bertknn.service.api.errors import AdminDisabled, Forbidden, NotReady, Unauthorized
from bertknn.service.api.schemas import DatastoreIdentity, ErrorBody, ReloadResponse


def require_admin(resources: ResourcesDep, authorization: Annotated[str | None, Header()] = None) -> None:
    token = resources.settings.admin_token
    if not token:
        raise AdminDisabled("admin endpoints are disabled on this server; set BERTKNN_ADMIN_TOKEN to enable them")
    if not authorization:
        raise Unauthorized("missing credentials: send the header 'Authorization: Bearer <BERTKNN_ADMIN_TOKEN>'")
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise Unauthorized("the Authorization header must read 'Bearer <token>'")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Forbidden("wrong admin token")


router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)])
_ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "no bearer token"},
    403: {"model": ErrorBody, "description": "wrong token, or admin endpoints disabled (no BERTKNN_ADMIN_TOKEN)"},
    409: {"model": ErrorBody, "description": "the new version cannot be served (the message says why); the old one "
          "keeps serving"},
    503: {"model": ErrorBody, "description": "the service is starting or stopping"},
}  # fmt: skip


@router.post(
    "/reload",
    response_model=ReloadResponse,
    responses=_ERRORS,
    summary="Serve the datastore's current version (after `python -m datastore_builder add`) without a restart",
)
async def reload(resources: ResourcesDep) -> ReloadResponse:
    reloader = resources.reloader
    if reloader is None or not resources.ready or resources.draining:
        raise NotReady("the service is starting or stopping; retry when /readyz says ready")
    outcome = await reloader.reload()
    return ReloadResponse(
        status=outcome.status,
        previous=DatastoreIdentity.model_validate(outcome.previous),
        datastore=DatastoreIdentity.model_validate(outcome.current),
        seconds=round(outcome.seconds, 3),
        draining=outcome.draining,
    )
