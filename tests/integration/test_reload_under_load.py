"""A reload while every process of a several-process service is busy: no request fails, each answer comes wholly
from one datastore version, and once `/admin/reload` has answered, no process answers from the old one.

Both layouts (`--workers 2`, and `--layout split`), with clients held on connections that both server processes
accepted, each client asking two questions in turn whose answers tell the versions apart (the update's words are in
no article of the first build).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from bench.rawhttp import AsyncRawClient
from bertknn.builder.settings import AddSettings
from bertknn.builder.update import add_articles
from tests.conftest import write_jsonl
from tests.integration.test_live_update import BRINDLE, TOKEN, UPDATE, ZORBLAT
from tests.integration.test_split_layout import SPLIT, api_pids
from tests.integration.test_workers import (
    ENV,
    served_versions,
    spread_connections,
    until_each_asked,
    wait_for_workers,
)
from tests.support.processes import ServiceProcess, service_process

CLIENTS = 8
QUESTIONS = {"zorblat": ZORBLAT, "brindle": BRINDLE}


@dataclass(frozen=True)
class Answer:
    client: int
    question: str
    sent: float  # time.monotonic() just before the request's bytes were written
    status: int | str  # the HTTP status, or the name of the error that broke the connection
    version: int  # the datastore version the answer names (-1 where there is no answer)
    top: str


async def ask(client: AsyncRawClient, i: int, name: str) -> Answer:
    sent = time.monotonic()
    try:
        status, body = await client.post_json("/predict", QUESTIONS[name])
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        client.abort()
        return Answer(i, name, sent, type(exc).__name__, -1, "")
    if status != 200:
        return Answer(i, name, sent, status, -1, body.decode(errors="replace")[:200])
    doc = json.loads(body)
    return Answer(i, name, sent, status, doc["datastore"]["version"], doc["predictions"][0]["token"])


async def load_through_a_reload(svc: ServiceProcess, pids: list[int], ds: Path, corpus: Path) -> tuple[list[Answer], float]:
    """Every client asks without pause while `add` writes version 2 and `/admin/reload` switches to it, and until
    each client has been answered three more times after the reload answered. Returns the answers and the moment
    (monotonic) the reload's response arrived."""
    conns, _ = await spread_connections(svc.url, CLIENTS, pids)
    out: list[Answer] = []
    asked = [0] * CLIENTS
    stop = asyncio.Event()

    async def keep_asking(i: int, c: AsyncRawClient) -> None:
        names = ("zorblat", "brindle") if i % 2 else ("brindle", "zorblat")
        while not stop.is_set():
            out.append(await ask(c, i, names[asked[i] % 2]))
            asked[i] += 1

    load = asyncio.gather(*(keep_asking(i, c) for i, c in enumerate(conns)))
    try:
        await until_each_asked(asked, 2)
        settings = AddSettings(datastore=ds, corpus=[corpus], device="cpu")
        await asyncio.to_thread(add_articles, settings)
        async with httpx.AsyncClient(timeout=180) as admin:
            r = await admin.post(f"{svc.url}/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"})
        answered = time.monotonic()
        assert r.status_code == 200, r.text
        assert (r.json()["status"], r.json()["datastore"]["version"], r.json()["processes"]) == ("reloaded", 2, 2)
        await until_each_asked(asked, max(asked) + 3)
    finally:
        stop.set()
        await load
        for c in conns:
            c.abort()
    return out, answered


def check(out: list[Answer], answered: float, tops_v1: dict[str, str]) -> None:
    failed = [a for a in out if a.status != 200]
    assert not failed, failed[:3]
    assert {a.version for a in out} == {1, 2}  # requests ran on both sides of the switch
    expected = {**{(1, name): top for name, top in tops_v1.items()}, (2, "zorblat"): "kelbo", (2, "brindle"): "zandor"}
    mixed = [a for a in out if a.top != expected[(a.version, a.question)]]
    assert not mixed, mixed[:3]  # each answer from the version it names, wholly
    late = [a for a in out if a.sent > answered and a.version != 2]
    assert not late, late[:3]  # once the reload answered, every process serves version 2
    for i in range(CLIENTS):  # a client's connection stays with one process: once on version 2, never back
        versions = [a.version for a in sorted(out, key=lambda a: a.sent) if a.client == i]
        assert versions == sorted(versions), (i, versions)


@pytest.mark.parametrize("layout", ["workers", "split"])
def test_a_reload_under_load_fails_no_request_and_mixes_no_versions(ds: Path, tmp_path: Path, layout: str):
    args = SPLIT if layout == "split" else ("--workers", "2")
    env = {**ENV, "BERTKNN_LIMITS__DEADLINE_MS": "60000"}  # the small test machine also runs `add` meanwhile
    with service_process(ds, env=env, args=args) as svc:
        pids = api_pids(svc, 2) if layout == "split" else wait_for_workers(svc, 2)
        v1 = {name: httpx.post(f"{svc.url}/predict", json=q, timeout=30).json() for name, q in QUESTIONS.items()}
        assert {a["datastore"]["version"] for a in v1.values()} == {1}
        tops = {name: a["predictions"][0]["token"] for name, a in v1.items()}
        assert tops["brindle"] != "zandor" and tops["zorblat"] != "kelbo"
        corpus = write_jsonl(tmp_path / "update.jsonl", UPDATE)
        out, answered = asyncio.run(load_through_a_reload(svc, pids, ds, corpus))
        check(out, answered, tops)
        assert sorted(served_versions(svc).values()) == [2, 2]
