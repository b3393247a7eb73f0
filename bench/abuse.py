"""Fairness under abuse, ``python -m bench.load --abuse``: one client sends only the costliest requests the
server has (entity answers at the largest k and top_k, batches of the most queries, ``/follow`` with the most
hops and beam) while ``--clients`` others send ordinary ``/predict`` questions.

Two phases of ``--duration`` seconds each, in one run against one service: the ordinary clients alone, then the
same with the abuser. Each client names itself in ``X-Client`` (``limits.client_header``, as a gateway would set
it from an API key). Reported: the ordinary clients' p50/p99 in both phases and their ratio, every status code by
sender, and whether every request sent got an answer. The service runs with its default limits.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import httpx_clients, lama_queries, run_async, service_process


def abuser_requests(subjects: list[str], max_k: int = 2048, max_batch: int = 64) -> list[tuple[str, dict]]:
    """The costliest requests: over the caps (refused at once) and just within them (run)."""
    s = subjects[0]
    ask = {"text": f"{s.lower()} is located in [MASK] .", "subject": s}
    entity = {**ask, "answer": "entity", "k": max_k, "top_k": 100, "num_articles": 50}
    rel = ["[X] is located in [Y] .", "[X] is part of [Y] .", "[X] is a member of [Y] .", "[X] was born in [Y] ."]
    plain_entity = {**ask, "answer": "entity"}
    return [
        ("/predict", entity),  # the largest k and num_articles: within the default cap
        ("/predict", {**entity, "k": 512, "num_articles": 12}),
        ("/predict/batch", {"queries": [{**ask, "k": max_k, "num_articles": 50}] * max_batch}),  # over
        ("/predict/batch", {"queries": [plain_entity] * 13}),  # within
        ("/follow", {"subject": s, "relations": rel, "beam": 20, "top_k": 100, "k": max_k}),  # over
        ("/follow", {"subject": s, "relations": rel[:2], "beam": 12}),  # within
    ]


async def _phase(url: str, ordinary: list[dict], abuse: list[tuple[str, dict]] | None, clients: int,
                 duration: float) -> dict[str, Any]:
    latencies: list[float] = []
    codes: dict[str, Counter[int]] = {"ordinary": Counter(), "abuser": Counter()}
    sent = Counter[str]()
    t_end = time.monotonic() + duration

    async def one(who: str, http: httpx.AsyncClient, path: str, body: dict, name: str) -> int:
        sent[who] += 1
        try:
            r = await http.post(path, json=body, headers={"X-Client": name})
        except httpx.HTTPError:
            codes[who][-1] += 1  # no answer at all: lost
            return -1
        codes[who][r.status_code] += 1
        if r.status_code in (429, 503) and r.headers.get("retry-after"):
            await asyncio.sleep(0.05)  # an abuser retries at once, not after Retry-After
        return r.status_code

    async def ordinary_client(i: int, http: httpx.AsyncClient) -> None:
        n = i
        while time.monotonic() < t_end:
            t = time.perf_counter()
            if await one("ordinary", http, "/predict", ordinary[n % len(ordinary)], f"user-{i}") == 200:
                latencies.append(time.perf_counter() - t)
            n += clients

    async def abuser(http: httpx.AsyncClient) -> None:
        assert abuse is not None
        n = 0
        while time.monotonic() < t_end:
            path, body = abuse[n % len(abuse)]
            await one("abuser", http, path, body, "abuser")
            n += 1

    async with httpx_clients(url, clients + 1, timeout=120) as https:
        tasks = [ordinary_client(i, http) for i, http in enumerate(https[:clients])]
        if abuse is not None:
            tasks += [abuser(https[-1]), abuser(https[-1])]  # two requests at a time on one connection's client
        await asyncio.gather(*tasks)
    lat = np.asarray(latencies) * 1000
    answered = {who: sum(c.values()) - c.get(-1, 0) for who, c in codes.items()}
    return {
        "ordinary_p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
        "ordinary_p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
        "ordinary_ok": len(latencies),
        "codes": {who: {str(k): v for k, v in sorted(c.items())} for who, c in codes.items()},
        "sent": dict(sent),
        "answered": answered,
    }


def run_abuse(datastore: Path, *, clients: int, duration: float, lama: Path | None = None,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Start the service (default limits, clients named by X-Client), then the two phases; return the figures."""
    from bertknn.core.format import Datastore

    subjects = [title for title, _ in Datastore(datastore).iter_article_texts()][:1]
    ordinary = [{"text": t, "subject": s} for t, s in lama_queries(40, seed=3, lama=lama)]
    service_env = {"BERTKNN_MODEL__DEVICE": "cpu", "BERTKNN_LIMITS__CLIENT_HEADER": "X-Client", **(env or {})}
    with service_process(datastore, env=service_env) as svc:
        with httpx.Client(base_url=svc.url, timeout=60) as http:  # warm-up: every path once
            for q in ordinary[:4]:
                http.post("/predict", json=q)
        alone = run_async(_phase(svc.url, ordinary, None, clients, duration))
        abused = run_async(_phase(svc.url, ordinary, abuser_requests(subjects), clients, duration))
    ratio = (abused["ordinary_p99_ms"] / alone["ordinary_p99_ms"]) if alone["ordinary_p99_ms"] else None
    five_xx = sum(v for phase in (alone, abused) for c in phase["codes"].values() for k, v in c.items() if k.startswith("5"))
    lost = sum(phase["sent"].get(w, 0) - phase["answered"].get(w, 0) for phase in (alone, abused) for w in phase["sent"])
    ordinary_errors = sum(v for k, v in abused["codes"]["ordinary"].items() if k != "200")
    ordinary_errors += sum(v for k, v in alone["codes"]["ordinary"].items() if k != "200")
    return {"clients": clients, "duration_s": duration, "alone": alone, "with_abuser": abused,
            "ordinary_p99_ratio": ratio, "ordinary_errors": ordinary_errors, "responses_5xx": five_xx, "lost": lost}  # fmt: skip
