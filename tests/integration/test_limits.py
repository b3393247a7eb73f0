"""Bounded cost: every request under a deadline, admitted by its estimated cost, and nothing of the machine in
any response (docs/limits.md)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import ClientOverloaded, Overloaded, TooCostly
from bertknn.core.inputs import MaskedInput
from bertknn.service import fill as fill_module
from bertknn.service.cost import ENTITY_FILL_ROWS, CostCaps, CostGate
from bertknn.service.main import create_app
from bertknn.service.settings import ServiceSettings
from tests.conftest import build_tiny, corpus_words, make_tiny_bert, write_jsonl
from tests.integration.test_entities import ARTICLES as LINKED_ARTICLES
from tests.integration.test_whole_words import ARTICLES as WORD_ARTICLES
from tests.integration.test_whole_words import PIECES, QUESTION

ASK = {"text": "orvin tasker was born in [MASK] .", "subject": "Orvin Tasker"}


@pytest.fixture(scope="module")
def linked_ds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_linked(tmp_path_factory.mktemp("limits-linked"))


def build_linked(root: Path) -> Path:
    """The entity tests' six linked articles, built with a tiny model of their words."""
    model = make_tiny_bert(root / "m", corpus_words([*LINKED_ARTICLES, {"title": "x", "text": "Quellport Zembla"}]))
    return build_tiny(root / "ds", [write_jsonl(root / "c.jsonl", LINKED_ARTICLES)], model)


@pytest.fixture(scope="module")
def whole_ds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("limits-whole")
    model = make_tiny_bert(root / "m", [w for w in corpus_words(WORD_ARTICLES) if w != "kelvadorn"] + PIECES)
    return build_tiny(root / "ds", [write_jsonl(root / "c.jsonl", WORD_ARTICLES)], model, targets="whole-word")


def _client(ds: Path, **limits: Any) -> TestClient:
    return TestClient(create_app(ServiceSettings(datastore=ds, model={"device": "cpu"}, limits=limits)))


def test_a_request_over_the_cost_cap_is_a_422_naming_the_cap(linked_ds: Path) -> None:
    cap = ENTITY_FILL_ROWS  # an entity answer is 1 + ENTITY_FILL_ROWS rows: one over
    with _client(linked_ds, max_request_cost=cap) as c:
        assert c.post("/predict", json=ASK).status_code == 200  # a word answer: 1 row
        r = c.post("/predict", json={**ASK, "answer": "entity"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "too_costly"
        assert f"limits.max_request_cost of {cap}" in r.json()["error"]["message"]
        batch = c.post("/predict/batch", json={"queries": [ASK] * (cap + 1)})
        assert batch.status_code == 422 and "this batch of" in batch.json()["error"]["message"]
        assert c.post("/predict/batch", json={"queries": [ASK] * cap}).status_code == 200
        follow = {"subject": "Orvin Tasker", "relations": ["[X] was born in [Y] ."] * 2, "beam": 2}
        r = c.post("/follow", json=follow)
        assert r.status_code == 422 and "limits.max_request_cost" in r.json()["error"]["message"]
    with _client(linked_ds) as c:  # the defaults admit the same follow
        assert c.post("/follow", json=follow).status_code == 200


def test_a_whole_word_request_s_cost_grows_with_k(whole_ds: Path) -> None:
    with _client(whole_ds, max_request_cost=8) as c:
        small = c.post("/predict", json={**QUESTION, "k": 1, "top_k": 1})
        big = c.post("/predict", json={**QUESTION, "k": 500})
    assert small.status_code == 200, small.text
    assert big.status_code == 422 and big.json()["error"]["code"] == "too_costly", big.text


def test_past_its_deadline_a_request_is_a_504_in_time_and_the_next_one_is_served(
    whole_ds: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each fill pass made slow: a whole-word question needs several, the deadline allows two."""
    passes: list[float] = []
    slow_down = [True]
    real = fill_module._encode_by

    def slow(encoder: MaskedLMEncoder, items: Sequence[MaskedInput], deadline: float | None) -> Any:
        out = real(encoder, items, deadline)
        passes.append(time.monotonic())
        if slow_down[0]:
            time.sleep(0.3)
        return out

    monkeypatch.setattr(fill_module, "_encode_by", slow)
    monkeypatch.setattr(fill_module, "FILL_BATCH", 1)  # one row per pass: several passes
    with _client(whole_ds) as c:
        t0 = time.monotonic()
        r = c.post("/predict", json={**QUESTION, "deadline_ms": 400})
        took = time.monotonic() - t0
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "deadline_exceeded" and r.headers["retry-after"] == "1"
        assert "deadline of 400 ms" in r.json()["error"]["message"]
        assert took < 1.0, took  # at the deadline, not when the work would have ended
        time.sleep(0.8)
        ran = len(passes)
        assert ran <= 2, passes  # passes 1 and 2 started within the deadline; the rest were dropped
        slow_down[0] = False
        ok = c.post("/predict", json=QUESTION)
        assert ok.status_code == 200 and ok.json()["predictions"][0]["token"] == "kelvadorn"
        assert len(passes) - ran >= 3, "the question needs at least three passes (so the deadline cut it short)"
        assert c.post("/predict", json={**QUESTION, "deadline_ms": 0}).status_code == 422


def test_the_server_deadline_caps_a_request_s_own(whole_ds: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = fill_module._encode_by

    def slow(encoder: MaskedLMEncoder, items: Sequence[MaskedInput], deadline: float | None) -> Any:
        time.sleep(0.3)
        return real(encoder, items, deadline)

    monkeypatch.setattr(fill_module, "_encode_by", slow)
    monkeypatch.setattr(fill_module, "FILL_BATCH", 1)
    with _client(whole_ds, deadline_ms=300) as c:
        r = c.post("/predict", json={**QUESTION, "deadline_ms": 60_000})
    assert r.status_code == 504 and "deadline of 300 ms" in r.json()["error"]["message"]


def test_the_gate_holds_costs_per_client_and_in_all() -> None:
    gate = CostGate(CostCaps(max_request_cost=10, max_client_cost=12, max_queued_cost=20))
    with pytest.raises(TooCostly, match="max_request_cost of 10"), gate.admit("a", 11, "this"):
        pass
    with gate.admit("a", 10, "q"):
        with pytest.raises(ClientOverloaded, match="max_client_cost 12"), gate.admit("a", 3, "q"):
            pass
        with gate.admit("a", 2, "q"), gate.admit("b", 8, "q"):
            assert gate.in_flight == 20
            with pytest.raises(Overloaded, match="max_queued_cost 20"), gate.admit("c", 1, "q"):
                pass
    assert gate.in_flight == 0 and not gate._by_client  # everything given back, also after refusals


def test_one_client_s_second_costly_request_is_a_429_while_others_are_served(
    linked_ds: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients named by a header (limits.client_header): the same name's second entity answer waits for none,
    and another client is served while the first client's request is still held."""
    gate_open, reached = threading.Event(), threading.Event()
    real = fill_module._log_probs_by

    def held(encoder: MaskedLMEncoder, sequences: Any, reads: Any, deadline: float | None) -> Any:
        reached.set()
        gate_open.wait(60)
        return real(encoder, sequences, reads, deadline)

    monkeypatch.setattr(fill_module, "_log_probs_by", held)
    entity = {**ASK, "answer": "entity"}
    with _client(linked_ds, max_client_cost=1 + ENTITY_FILL_ROWS, client_header="X-Client") as c:
        results: dict[str, Any] = {}

        def post(name: str, body: dict, client: str) -> threading.Thread:
            t = threading.Thread(target=lambda: results.update({name: c.post("/predict", json=body, headers={"X-Client": client})}))
            t.start()
            return t

        first = post("first", entity, "a")
        assert reached.wait(60), "the first request never reached its fill pass"  # admitted, and held there
        second = c.post("/predict", json=entity, headers={"X-Client": "a"})  # refused before any work
        other = post("other", ASK, "b")
        other.join(60)  # served while the first is held: its answer comes first
        assert not other.is_alive() and first.is_alive() and "first" not in results
        gate_open.set()
        first.join(60)
    assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_requests"
    assert second.headers["retry-after"] == "1" and "limits.max_client_cost" in second.json()["error"]["message"]
    assert results["other"].status_code == 200 and results["first"].status_code == 200


INTERNALS = ("Errno", "Traceback", "No such file", "/tmp/", "/home/", "/work/", "/root/", ".npy", "shard-0")


def assert_nothing_internal(body: str, *paths: Path) -> None:
    """No path of the machine, OS error or exception text in a response body."""
    for marker in (*INTERNALS, *(str(p) for p in paths)):
        assert marker not in body, f"{marker!r} in {body[:300]}"


def test_a_shard_that_cannot_be_read_is_a_503_without_paths_and_the_log_has_them(
    tiny_datastore: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    ds = Path(shutil.copytree(tiny_datastore, tmp_path / "ds"))
    # (without the warm-up, which would open the first articles' shards before they go: an open file stays readable)
    settings = ServiceSettings(datastore=ds, model={"device": "cpu"}, warmup=False)
    with TestClient(create_app(settings)) as c:
        for shard in sorted((ds / "shards").iterdir()):
            shutil.move(shard, tmp_path / shard.name)  # gone after start-up (a disk unmounted, a bad sync)
        r = c.post("/predict", json={"text": "zorblat was born in [MASK] .", "subject": "Zorblat"})
        ready = c.get("/readyz")
    assert r.status_code == 503 and r.json()["error"]["code"] == "datastore_unavailable", r.text
    assert_nothing_internal(r.text + ready.text, ds, tiny_datastore)
    rid = r.json()["error"]["request_id"]
    assert any(rid in m and str(ds) in m for m in caplog.messages), caplog.messages[-5:]
