"""Dependencies: the heavy objects live in one `Resources` object built by the lifespan."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from bertknn.core.errors import NotReady
from bertknn.service.resources import Resources
from bertknn.service.serving import AsyncAnswerer


# async: FastAPI runs a plain `def` dependency in its thread pool, a thread hop per request for nothing
async def get_resources(request: Request) -> Resources:
    return request.app.state.resources


async def get_answerer(resources: Annotated[Resources, Depends(get_resources)]) -> AsyncAnswerer:
    if not resources.ready or resources.answerer is None:
        raise NotReady(resources.error or "the service is starting or shutting down; retry shortly")
    return resources.answerer


ResourcesDep = Annotated[Resources, Depends(get_resources)]
AnswererDep = Annotated[AsyncAnswerer, Depends(get_answerer)]
