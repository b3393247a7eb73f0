"""bench.steps: one uncached question's time in the service, step by step, from probes in the service process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import steps, steps_probe

Event = tuple[str, float, "int | None"]


def _request(t0: float, task: int, names: tuple[str, ...] = steps.ORDER) -> list[Event]:
    """A request's records as the probes make them: the model thread's without a task."""
    return [(name, t0 + i, None if name.startswith(("forward", "answer<", "answer>")) else task)
            for i, name in enumerate(names)]  # fmt: skip


def test_each_request_is_cut_from_the_probes_records_and_its_steps_add_up() -> None:
    events: list[Event] = [("http<", 0.0, 1)]  # the lifespan's start, before the measured requests
    events += [("http<", 1.0, 2), ("http>", 1.5, 2)]  # a /readyz, before them too
    first = _request(10.0, 3)
    # the first request's task ends after the next one (a /healthz) started, as it may on a busy event loop
    events += first[:-1] + [("http<", 18.5, 4), first[-1], ("http>", 30.2, 4)] + _request(40.0, 5)
    events += _request(60.0, 6, steps.CACHED)  # a question answered from the cache
    events += [("http>", 99.0, 1)]  # the lifespan's end
    got, cached, other = steps.requests_of(sorted(events, key=lambda e: e[1]), since=5.0)
    assert (cached, other) == (1, 1) and [r["http<"] for r in got] == [10.0, 40.0]
    times = steps.step_times(got[0])
    assert sum(times[name] for name, _, _ in steps.STEPS) == pytest.approx(times["held"])
    assert times["held"] == pytest.approx(1000 * (len(steps.ORDER) - 1))
    assert times["own"] == pytest.approx(times["held"] - times["forward"]) and times["forward"] == pytest.approx(1000)


def test_the_clients_time_of_each_request_is_its_own_question_s_round_trip() -> None:
    asked = [(0.0, 1.0), (2.0, 3.5), (4.0, 4.25)]
    assert steps.client_ms(asked, [{"http<": 2.5}, {"http<": 4.1}]) == [1500.0, 250.0]  # the cached first is left out
    with pytest.raises(RuntimeError, match="outside every question"):
        steps.client_ms(asked, [{"http<": 1.5}])


def test_a_probe_on_a_function_that_is_gone_stops_the_run_with_its_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps_probe, "PROBES", (("bertknn.service.main", "RequestContextMiddleware.gone", "http"),))
    with pytest.raises(RuntimeError, match="RequestContextMiddleware.gone is gone"):
        steps_probe.install()


def test_a_probe_records_a_methods_and_a_module_functions_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from bertknn.service import answer as answer_module
    from bertknn.service.retrieval.neighbours import NeighbourFinder

    # (set to themselves first, so that the test's end puts the unprobed ones back)
    monkeypatch.setattr(answer_module, "knn_sparse", answer_module.knn_sparse)
    monkeypatch.setattr(NeighbourFinder, "neighbours", NeighbourFinder.neighbours)
    monkeypatch.setattr(steps_probe, "PROBES", (("bertknn.service.answer", "knn_sparse", "vote"),
                                                ("bertknn.service.retrieval.neighbours", "NeighbourFinder.neighbours", "knn")))  # fmt: skip
    monkeypatch.setattr(steps_probe, "EVENTS", [])
    steps_probe.install()
    ids, probs = answer_module.knn_sparse(np.array([1.0, 2.0]), np.array([7, 7]), 6.0)
    assert ids.tolist() == [7] and probs.tolist() == pytest.approx([1.0])
    assert [(name, task) for name, _, task in steps_probe.EVENTS] == [("vote<", None), ("vote>", None)]
    assert NeighbourFinder.neighbours.__wrapped__ is not None  # type: ignore[attr-defined]


def test_the_steps_of_a_real_service_process(tiny_datastore: Path, tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    assert steps.main(["--datastore", str(tiny_datastore), "--requests", "12", "--warm-up", "2", "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    # (the tiny model's vocabulary makes some distinct questions one token sequence: those come from the cache)
    assert got["requests"] + got["cache_hits"] == 12 and got["requests"] >= 6 and got["device"] == "auto"
    ms = got["ms"]
    assert set(ms) == {*(name for name, _, _ in steps.STEPS), "held", "own", "client"}
    assert all(0 <= v["p50"] <= v["p90"] for v in ms.values())
    assert ms["forward"]["p50"] > 0 and ms["answer"]["p50"] > 0 and ms["request_in"]["p50"] > 0
    assert ms["held"]["p50"] <= ms["client"]["p50"]  # the client's time holds the service's
    assert got["own_over_forward_p50"] == pytest.approx(ms["own"]["p50"] / ms["forward"]["p50"], rel=1e-3)
    tax = got["cold_tax"]
    assert tax["gap_ms"] == pytest.approx(ms["forward"]["p50"], rel=1e-3) and tax["tokenise_back_to_back_us"] > 0
    assert tax["after_gap_over_back_to_back"] == pytest.approx(
        tax["tokenise_after_gap_us"] / tax["tokenise_back_to_back_us"], rel=1e-2)


def test_refuses_what_it_cannot_run_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        steps.main(["--datastore", str(tmp_path), "--out", str(tmp_path / "s.json")])
    assert exc.value.code == 2 and "no datastore there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        steps.main(["--requests", "3"])
    assert "--requests must be at least 10" in capsys.readouterr().err


def test_bench_gpu_runs_the_steps_on_the_device_and_tabulates_them(tmp_path: Path) -> None:
    """The lease's ``steps`` stage: bench.steps on CUDA, its figures read back from the file it was told to write,
    and one row of the GPU table (from this CPU's report, standing in for the device's)."""
    import argparse

    from bench.common import RESULTS
    from bench.gpu import _report, _stage_commands, gpu_table

    args = argparse.Namespace(model=Path("runs/bert-base-shaped"), articles=40, workers=2, runs=1, retriever="tfidf",
                              batch_tokens="16384", ivfpq_rows=0)  # fmt: skip
    cmd = _stage_commands(args)["steps"]
    assert cmd[1:3] == ["-m", "bench.steps"] and cmd[cmd.index("--device") + 1] == "cuda"
    assert cmd[cmd.index("--out") + 1] == str(_report("steps"))
    report = json.loads((RESULTS / "gpu.json").read_text())
    measured = json.loads((RESULTS / "steps-bert-base-shaped.json").read_text())
    rows = [r for r in gpu_table({**report, "steps": measured}).splitlines() if "steps in one service process" in r]
    assert len(rows) == 1 and f"forward {measured['ms']['forward']['p50']}" in rows[0]
    assert f"own {measured['ms']['own']['p50']}" in rows[0]
