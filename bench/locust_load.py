"""A locust load generator (FastHttpUser, gevent): ``users`` concurrent clients send every query once.

Run in its own process (locust patches the standard library with gevent on import)::

    python -m bench.locust_load --url http://127.0.0.1:8000 --users 32 < queries.json

``queries.json``: a JSON list of [text, subject] pairs on standard input. Prints one JSON object: seconds from the
first request to the last answer, answers 200, other answers or errors, and this process's CPU seconds. Each
user has its own connection, and takes the next query as soon as its answer arrives (no think time).
`bench.serving` runs it beside its other two load generators.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator

import gevent
from locust import FastHttpUser, constant, task
from locust.env import Environment
from locust.exception import StopUser


def run(url: str, queries: list[tuple[str, str | None]], users: int) -> dict[str, float]:
    """Send every query once with ``users`` locust users; the figures `main` prints."""
    if users < 1:
        raise ValueError("users must be at least 1")
    todo: Iterator[tuple[str, str | None]] = iter(queries)
    counts = {"ok": 0, "errors": 0}

    class Client(FastHttpUser):
        host = url
        wait_time = constant(0)

        @task
        def predict(self) -> None:
            query = next(todo, None)
            if query is None:
                raise StopUser()
            text, subject = query
            with self.client.post("/predict", json={"text": text, "subject": subject}, catch_response=True) as r:
                counts["ok" if r.status_code == 200 else "errors"] += 1
                if r.status_code != 200:
                    r.failure(f"status {r.status_code}")

    env = Environment(user_classes=[Client])
    runner = env.create_local_runner()
    cpu0, t0 = time.process_time(), time.perf_counter()
    runner.start(users, spawn_rate=1e6)  # every user at once
    gevent.sleep(0)
    while runner.user_count > 0:
        gevent.sleep(0.005)
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    runner.quit()
    return {"seconds": seconds, "ok": counts["ok"], "errors": counts["errors"], "cpu_s": cpu}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.locust_load", description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--users", type=int, required=True)
    args = p.parse_args(argv)
    if args.users < 1:
        p.error("--users must be at least 1")
    try:
        queries = [(str(t), None if s is None else str(s)) for t, s in json.load(sys.stdin)]
    except (ValueError, TypeError) as exc:
        p.error(f"standard input must be a JSON list of [text, subject] pairs: {exc}")
    print(json.dumps(run(args.url, queries, args.users)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
