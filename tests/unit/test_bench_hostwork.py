"""bench.hostwork: the trees' services measured in blocks that take turns, each given the same questions."""

from __future__ import annotations

import pytest

from bench import hostwork


def test_each_level_is_measured_in_blocks_that_take_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, list[int]]] = []
    cpu = {1: 0.0, 2: 0.0}  # a service's CPU seconds so far, by pid
    rows = {"a": [0.0, 0.0, 0.0], "b": [0.0, 0.0, 0.0]}  # (rows, batches, merged passes) so far, by url

    async def load(url: str, payloads: list[dict], clients: int) -> tuple[float, int, int]:
        calls.append((url, [p["n"] for p in payloads]))
        pid = 1 if url == "a" else 2
        cpu[pid] += 0.001 * len(payloads) * pid  # b costs twice a's CPU per request
        rows[url][0] += len(payloads)
        rows[url][1] += 1
        rows[url][2] += 0.5 * (url == "b")  # b is served in the split layout: two batches a merged pass
        return 0.01 * len(payloads) * pid, len(payloads) - (url == "b"), int(url == "b")  # b fails one per call

    monkeypatch.setattr(hostwork, "_load", load)
    monkeypatch.setattr(hostwork, "tree_cpu_s", lambda pid: cpu[pid])
    # by kind of thread: a quarter on the event loop, the rest on the model thread; a knn thread that used none
    monkeypatch.setattr(hostwork, "thread_cpu_s", lambda pid: {"main": cpu[pid] / 4, "model": cpu[pid] * 3 / 4,
                                                               "knn": 0.0})  # fmt: skip
    def counters(url: str) -> dict[str, float]:
        n, batches, passes = rows[url]
        split = {"model_rows": n, "model_passes": passes, "model_cpu_s": cpu[2] / 4} if passes else {}
        return {"rows": n, "batches": batches, "model_rows": 0.0, "model_passes": 0.0, "model_cpu_s": 0.0, **split}

    monkeypatch.setattr(hostwork, "counters", counters)
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
                           "blocks": 4, "rows_per_batch": 10.0,
                           "server_cpu_ms_per_request_by_thread": {"model": 0.75, "main": 0.25},
                           "by_block": [[0.01, 10]] * 4}  # each turn's CPU seconds and answers  # fmt: skip
    assert got["base"]["errors"] == 4 and got["base"]["requests"] == 40
    assert got["base"]["server_cpu_ms_per_request"] == round(2 * 40 / 36, 3)  # per answered request
    # the split layout's model process: its merged passes and its share of the CPU, per answered request
    assert "rows_per_model_pass" not in got["this"] and "model_process_cpu_ms_per_request" not in got["this"]
    assert got["base"]["rows_per_model_pass"] == 20.0
    assert got["base"]["model_process_cpu_ms_per_request"] == round(2 * 40 / 36 / 4, 3)


def _idle_services(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, list[int]]]:
    """Services that answer every question at once and spend no CPU: the (url, questions) of each load, in order."""
    calls: list[tuple[str, list[int]]] = []

    async def load(url: str, payloads: list[dict], clients: int) -> tuple[float, int, int]:
        calls.append((url, [p["n"] for p in payloads]))
        return 0.01 * len(payloads), len(payloads), 0

    monkeypatch.setattr(hostwork, "_load", load)
    monkeypatch.setattr(hostwork, "tree_cpu_s", lambda pid: 0.0)
    monkeypatch.setattr(hostwork, "counters", lambda url: dict.fromkeys(hostwork.METRICS.values(), 0.0))
    return calls


def test_a_level_is_warmed_with_a_block_s_worth_of_questions_before_its_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    assert hostwork.warm_up_size(3000, 1, 8) == 375 and hostwork.warm_up_size(3000, 64, 8) == 375
    assert hostwork.warm_up_size(100, 64, 8) == 64 and hostwork.warm_up_size(100, 1, 8) == 20
    calls = _idle_services(monkeypatch)
    warm = hostwork.warm_up_size(40, 4, 2)
    got = hostwork.measure({"this": ("a", 1), "base": ("b", 2)}, [{"n": i} for i in range(warm + 40)], clients=4,
                           blocks=2, warm=warm)  # fmt: skip
    assert calls[:2] == [("a", list(range(warm))), ("b", list(range(warm)))]  # unmeasured, each its own turn
    assert [len(qs) for _, qs in calls[2:]] == [20, 20, 20, 20] and got["this"]["requests"] == 40


def test_a_run_s_server_cpu_is_split_into_the_forward_at_its_batch_size_and_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import bench.common

    asked: list[tuple[int, int]] = []  # (questions, batch) of each timed call

    class Encoder:
        def set_backend(self, name: str) -> str:
            return "onnx"

    def bare_forward(enc: Encoder, texts: list[str], batch: int = 1) -> list[float]:
        asked.append((len(texts), batch))
        return [0.001 * (2 + batch)] * -(-len(texts) // batch)  # 2 ms a call, and 1 ms a question

    monkeypatch.setattr(bench.common, "bare_forward", bare_forward)
    per_row = hostwork.forward_per_row_ms(Encoder(), ["a", "b", "c"], {1, 26})
    assert per_row == {1: 3.0, 26: round(28 / 26, 3)}
    assert (26 * 20, 26) in asked and (20, 1) in asked  # 20 batches of each size, the texts repeated to fill them

    runs = [{"rows_per_batch": 25.86, "server_cpu_ms_per_request": 2.4},
            {"rows_per_batch": 1.0, "server_cpu_ms_per_request": 4.0}]  # fmt: skip
    hostwork.split_forward(runs, per_row)
    assert runs[0]["forward_ms_per_request"] == per_row[26]
    assert runs[0]["host_ms_per_request"] == round(2.4 - per_row[26], 3)
    assert runs[1] == {"rows_per_batch": 1.0, "server_cpu_ms_per_request": 4.0, "forward_ms_per_request": 3.0,
                       "host_ms_per_request": 1.0}  # fmt: skip


def test_a_setting_is_served_as_the_services_environment_variable_and_a_wrong_one_is_named() -> None:
    assert hostwork.setting_env("batching.on_event_loop=true") == {"BERTKNN_BATCHING__ON_EVENT_LOOP": "true"}
    assert hostwork.setting_env(" model.threads = 2") == {"BERTKNN_MODEL__THREADS": "2"}
    assert hostwork.setting_env("reload_poll_s=5") == {"BERTKNN_RELOAD_POLL_S": "5"}
    for wrong in ("batching.on_event_loop", "batching.no_such=1", "nowhere.max_queue=3", "batching=1", "no_such=1"):
        with pytest.raises(ValueError, match=r"\[SECTION.\]NAME=VALUE") as err:
            hostwork.setting_env(wrong)
        assert "batching" in str(err.value) and repr(wrong) in str(err.value)


def test_the_setting_is_compared_with_this_tree_at_each_worker_and_client_count() -> None:
    def run(tree: str, workers: int, clients: int, cpu: float, rps: float) -> dict:
        return {"tree": tree, "workers": workers, "clients": clients, "server_cpu_ms_per_request": cpu,
                "requests_per_s": rps}  # fmt: skip

    setting = "this tree, batching.on_event_loop=true"
    result = {"runs": [run("this tree", 1, 64, 2.0, 500.0), run(setting, 1, 64, 1.8, 450.0),
                       run("this tree", 2, 64, 2.0, 900.0), run(setting, 2, 64, 1.6, 990.0)]}  # fmt: skip
    hostwork._ratios(result)
    got = [r.get("vs_this_tree") for r in result["runs"]]
    assert got == [None, {"cpu_per_request": 0.9, "requests_per_s": 0.9, "cpu_per_request_95": None}, None,
                   {"cpu_per_request": 0.8, "requests_per_s": 1.1, "cpu_per_request_95": None}]  # fmt: skip


def test_in_the_split_layout_the_model_process_s_cpu_is_split_too_and_bounds_its_requests_per_second() -> None:
    per_row = {3: 0.5, 26: 0.25}  # the bare forward's ms per question at 3 and 26 rows per pass
    runs = [{"tree": "t", "workers": 4, "clients": 64, "rows_per_batch": 3.2, "rows_per_model_pass": 25.6,
             "server_cpu_ms_per_request": 3.0, "model_process_cpu_ms_per_request": 0.75}]  # fmt: skip
    hostwork.split_forward(runs, per_row)
    r = runs[0]
    assert r["forward_ms_per_request"] == 0.25  # at the merged passes' size, not the API processes' batches
    assert r["host_ms_per_request"] == 2.75
    assert r["model_process_host_ms_per_request"] == 0.5
    assert r["model_process_bound_per_s"] == 2000.0
    assert r["api_processes_cpu_ms_per_request"] == 2.25
    line = hostwork.split_line(r)
    assert "26 rows per batch" in line and "at most 2000.0 req/s" in line and "API processes 2.25 ms" in line
    full = {"tree": "t", "workers": 1, "clients": 64, "rows_per_batch": 3.0, "server_cpu_ms_per_request": 2.0}
    hostwork.split_forward([full], per_row)
    assert "model_process_bound_per_s" not in full and "model process" not in hostwork.split_line(full)


def test_with_hits_every_question_is_asked_before_it_is_measured_and_no_forward_is_taken_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _idle_services(monkeypatch)
    payloads = [{"n": i} for i in range(20 + 40)]
    got = hostwork.measure({"this": ("a", 1), "base": ("b", 2)}, payloads, clients=4, blocks=2, hits=True)
    everything = list(range(60))
    assert calls[:2] == [("a", everything), ("b", everything)]  # each service has seen every question
    measured = calls[2:]
    assert [url for url, _ in measured] == ["a", "b", "b", "a"]
    assert sorted(n for _, qs in measured for n in qs) == sorted(list(range(20, 60)) * 2)
    assert got["this"]["requests"] == 40 and got["this"]["rows_per_batch"] == 0.0  # no batch: every one a hit
    runs = [{"tree": "t", "workers": 1, "clients": 64, "rows_per_batch": 0.0, "server_cpu_ms_per_request": 1.2}]
    hostwork.split_forward(runs, None)
    assert runs[0]["forward_ms_per_request"] == 0.0 and runs[0]["host_ms_per_request"] == 1.2
    assert "no forward" in hostwork.split_line(runs[0])


def test_hits_with_several_processes_are_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        hostwork.main(["--hits", "--workers", "1,2"])
    assert err.value.code == 2 and "--workers 1" in capsys.readouterr().err


def test_a_ratio_s_interval_comes_from_the_same_blocks_drawn_for_both_services() -> None:
    base = [[0.30, 100], [0.36, 100], [0.42, 100], [0.33, 100], [0.39, 100], [0.45, 100]]  # the host drifts
    assert hostwork.paired_interval(base, base) == [1.0, 1.0]  # the same turns: no noise left, whatever the drift
    dearer = [[cpu * 1.1, n] for cpu, n in base]
    assert hostwork.paired_interval(dearer, base) == [1.1, 1.1]  # 10 % more in every block, told exactly
    # a service 10 % dearer in half the blocks and 10 % cheaper in the others: an interval around 1 holding both
    mixed = [[cpu * (1.1 if i % 2 else 0.9), n] for i, (cpu, n) in enumerate(base)]
    low, high = hostwork.paired_interval(mixed, base)
    assert 0.9 < low < 1 < high < 1.1
    assert hostwork.paired_interval(base[:3], base[:3]) is None  # too few blocks to draw from
    assert hostwork.paired_interval(base, base[:5]) is None
    said = {"cpu_per_request": 1.1, "cpu_per_request_95": [1.1, 1.1]}
    assert hostwork._said(said) == " (95 % interval over the blocks 1.10-1.10; 1 is outside it)"
    assert hostwork._said({"cpu_per_request_95": [0.97, 1.04]}) == " (95 % interval over the blocks 0.97-1.04)"


def test_each_level_runs_in_two_halves_the_services_started_in_one_order_then_in_the_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import argparse
    import contextlib
    from pathlib import Path

    started: list[str] = []
    measured: list[tuple[list[str], int, list[int], int]] = []  # (turn order, clients, questions, blocks)

    @contextlib.contextmanager
    def service(ds, *, env, cwd, args):  # noqa: ANN001, ANN202 - stands in for tests.support.processes'
        started.append(env["WAY"])
        yield type("Svc", (), {"url": env["WAY"], "proc": type("P", (), {"pid": 1})()})()

    def sums(services, payloads, clients, blocks, *, hits, warm):  # noqa: ANN001, ANN202
        measured.append((list(services), clients, [q["n"] for q in payloads[warm:]], blocks))
        out = {}
        answered = len(payloads) - warm
        for name in services:
            level = hostwork.LevelSums(turns=[[0.01, answered // blocks]] * blocks)
            level.totals.update(secs=1.0, ok=answered, cpu_s=0.01 * blocks)
            out[name] = level
        return out

    monkeypatch.setattr(hostwork, "service_process", service)
    monkeypatch.setattr(hostwork, "measure_sums", sums)
    ways = {"this tree": (Path("a"), {"WAY": "a"}), "baseline X": (Path("b"), {"WAY": "b"})}
    args = argparse.Namespace(requests=100, blocks=4, hits=False)
    need = sum(hostwork.level_questions(100, c, 4) for c in (1, 8))
    pool = [{"n": i} for i in range(need)]
    got = hostwork.serve_levels(ways, 1, Path("ds"), {}, [1, 8], pool, args, [], {})
    assert started == ["a", "b", "b", "a"]  # the second half starts them the other way round
    assert [m[0] for m in measured] == [["this tree", "baseline X"]] * 2 + [["baseline X", "this tree"]] * 2
    assert [(m[1], len(m[2]), m[3]) for m in measured] == [(1, 50, 2), (8, 50, 2), (1, 50, 2), (8, 50, 2)]
    every = [n for m in measured for n in m[2]]
    assert len(every) == len(set(every)) and max(every) < need  # distinct questions, within what the level takes
    for key in [(1, "this tree"), (1, "baseline X"), (8, "this tree"), (8, "baseline X")]:
        row = got[key].figures()
        assert row["requests"] == 100 and row["blocks"] == 4 and len(row["by_block"]) == 4  # both halves summed
