"""Admin routes (``/admin/*``): enabled only when ``BERTKNN_ADMIN_TOKEN`` is set, called with that bearer token."""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from bertknn.core.errors import AdminDisabled, Forbidden, NotReady, Unauthorized
from bertknn.service.api.deps import ResourcesDep
from bertknn.service.api.schemas import DatastoreIdentity, ErrorBody, ReloadResponse

# auto_error=False: a missing or malformed header reaches require_admin, which answers in the one error shape
_bearer = HTTPBearer(auto_error=False, description="the server's BERTKNN_ADMIN_TOKEN")


async def require_admin(
    resources: ResourcesDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    token = resources.settings.admin_token
    if token is None or not token.get_secret_value():
        raise AdminDisabled("admin endpoints are disabled on this server; set BERTKNN_ADMIN_TOKEN to enable them")
    if credentials is None or not credentials.credentials.strip():
        raise Unauthorized("missing credentials: send the header 'Authorization: Bearer <BERTKNN_ADMIN_TOKEN>'")
    if not hmac.compare_digest(credentials.credentials.strip().encode(), token.get_secret_value().encode()):
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
    summary="Serve the datastore's current version (after `bert-knn add`) without a restart",
)
async def reload(resources: ResourcesDep) -> ReloadResponse:
    reloader = resources.reloader
    if reloader is None or not resources.ready or resources.draining:
        raise NotReady("the service is starting or stopping; retry when /readyz says ready")
    outcome = await reloader.reload_all()
    return ReloadResponse(
        status=outcome.status,
        previous=DatastoreIdentity.model_validate(outcome.previous),
        datastore=DatastoreIdentity.model_validate(outcome.current),
        seconds=round(outcome.seconds, 3),
        draining=outcome.draining,
        processes=outcome.processes,
    )
