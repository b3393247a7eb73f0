"""The heavy objects of a running service, built by the lifespan and held in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from bertknn.service.cost import CostCaps, CostGate
from bertknn.service.metrics import Metrics
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.processes import WorkerSlot
from bertknn.service.serving import AsyncAnswerer
from bertknn.service.settings import ServiceSettings


class Reloader(Protocol):
    """What the routes and the lifespan need of `bertknn.service.reload.DatastoreReloader`."""

    async def reload(self) -> Any: ...

    async def reload_all(self) -> Any: ...

    async def follow_peers(self, interval_s: float = ...) -> None: ...

    async def watch(self, interval_s: float) -> None: ...

    async def close(self) -> None: ...


@dataclass
class Resources:
    settings: ServiceSettings
    metrics: Metrics = field(default_factory=Metrics)
    pipeline: AnswerPipeline | None = None
    answerer: AsyncAnswerer | None = None
    reloader: Reloader | None = None
    ready: bool = False
    draining: bool = False
    error: str = ""
    gate: CostGate = field(init=False)
    slot: WorkerSlot | None = None  # one of several server processes: its place in their run directory

    def __post_init__(self) -> None:
        lim = self.settings.limits
        self.gate = CostGate(CostCaps(lim.max_request_cost, lim.max_client_cost, lim.max_queued_cost))
