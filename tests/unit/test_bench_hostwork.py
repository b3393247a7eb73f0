"""bench.hostwork: the trees' services measured in blocks that take turns, each given the same questions."""

from __future__ import annotations

import pytest

from bench import hostwork


def test_each_level_is_measured_in_blocks_that_take_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[int]]] = []
    cpu = {1: 0.0, 2: 0.0}  # a service's CPU seconds so far, by pid
    rows = {"a": [0.0, 0.0], "b": [0.0, 0.0]}  # (rows, batches) so far, by url

    async def load(url: str, payloads: list[dict], clients: int) -> tuple[float, int, int]:
        calls.append((url, [p["n"] for p in payloads]))
        pid = 1 if url == "a" else 2
        cpu[pid] += 0.001 * len(payloads) * pid  # b costs twice a's CPU per request
        rows[url][0] += len(payloads)
        rows[url][1] += 1
        return 0.01 * len(payloads) * pid, len(payloads) - (url == "b"), int(url == "b")  # b fails one per call

    monkeypatch.setattr(hostwork, "_load", load)
    monkeypatch.setattr(hostwork, "tree_cpu_s", lambda pid: cpu[pid])
    monkeypatch.setattr(hostwork, "batches", lambda url: tuple(rows[url]))
    payloads = [{"n": i} for i in range(20 + 40)]
    got = hostwork.measure({"this": ("a", 1), "base": ("b", 2)}, payloads, clients=4, blocks=4)

    warm = list(range(20))
    assert calls[:2] == [("a", warm), ("b", warm)]
    measured = calls[2:]
    assert [url for url, _ in measured] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    for block in range(4):
        want = list(range(20 + 10 * block, 30 + 10 * block))
        assert [qs for _, qs in measured[2 * block : 2 * block + 2]] == [want, want]  # the same questions to each
    assert got["this"] == {"requests_per_s": 100.0, "server_cpu_ms_per_request": 1.0, "requests": 40, "errors": 0,
                           "blocks": 4, "rows_per_batch": 10.0}  # fmt: skip
    assert got["base"]["errors"] == 4 and got["base"]["requests"] == 40
    assert got["base"]["server_cpu_ms_per_request"] == round(2 * 40 / 36, 3)  # per answered request
