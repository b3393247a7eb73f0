"""Per-stage accounting of a build: the arithmetic, and a real build that reports every stage."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from bertknn.builder.stages import STAGES, StageTimes
from bertknn.core.logs import Event, JsonFormatter
from tests.conftest import TINY_ARTICLES, build_tiny


def test_wall_time_divides_the_workers_stages_and_names_the_bound() -> None:
    t = StageTimes()
    t.add("decompress", 1.0, 1000)
    t.add("parse", 2.0, 10)
    for _ in range(4):  # a worker stage, in blocks: 8 CPU-seconds over 4 workers are 2 s of wall time
        block = StageTimes()
        block.add("split", 2.0, 10)
        t.merge(block)
    t.add("forward", 3.0, 500)
    assert t.wall(4)["split"] == 2.0 and t.wall(4)["forward"] == 3.0
    assert t.bound(4) == "forward" and t.bound(1) == "split"
    summary = t.summary(4)
    assert summary["bound"] == "forward"
    assert summary["stages"]["forward"] == {"seconds": 3.0, "contexts": 500, "contexts_per_s_per_process": 166.7}
    assert summary["stages"]["write"]["contexts_per_s_per_process"] is None
    other = StageTimes()
    other.add("split", 1.0, 5)
    t.merge(other)
    assert t.seconds["split"] == 9.0 and t.items["split"] == 45
    assert "bound: forward" in t.line(4)
    early = StageTimes()
    early.add("parse", 1.0, 3)
    assert "bound: known after the first shard" in early.line(1)


def test_a_build_of_fewer_blocks_than_workers_divides_their_stages_among_the_busy_ones() -> None:
    t = StageTimes()
    t.add("forward", 3.0, 500)
    block = StageTimes()
    block.add("markup", 7.0, 20)  # one block: one worker did all of it, whatever --workers says
    t.merge(block)
    assert t.worker_blocks == 1 and t.wall(14)["markup"] == 7.0 and t.bound(14) == "markup"
    for _ in range(3):
        t.merge(block)
    assert t.worker_blocks == 4 and t.wall(14)["markup"] == 7.0 and t.wall(2)["markup"] == 14.0
    reader = StageTimes()
    reader.add("parse", 1.0, 3)  # the reading process's stages are not a worker's block
    t.merge(reader)
    assert t.worker_blocks == 4


def test_padding_is_counted_per_batch_and_merged() -> None:
    t = StageTimes()
    assert t.padding_fraction() is None and t.summary(1)["padding_fraction"] is None
    t.pad(10, 12)  # a batch of rows 4, 6 tokens wide: 10 real tokens, 12 with padding
    other = StageTimes()
    other.pad(8, 8)  # a batch without padding
    t.merge(other)
    assert (t.tokens, t.padded_tokens) == (18, 20)
    assert t.summary(1)["padding_fraction"] == 0.1


def _xml_dump(path: Path) -> Path:
    pages = "".join(
        f"<page><title>{a['title']}</title><ns>0</ns><id>{a['id']}</id><revision><text>'''{a['title']}''' "
        f"{a['text']} [[Category:Made up]]</text></revision></page>"
        for a in TINY_ARTICLES
    )
    path.write_text(f'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">{pages}</mediawiki>')
    return path


def test_a_build_reports_every_stage(tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    dump = _xml_dump(tmp_path / "dump.xml")
    with caplog.at_level(logging.INFO, logger="bertknn.builder.build"):
        build_tiny(tmp_path / "ds", [dump], tiny_model_dir, sparse_indexes=False)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("build finished: "))
    summary = json.loads(line.removeprefix("build finished: "))
    stages = summary["stages"]
    assert set(stages) == set(STAGES) and summary["bound"] in STAGES
    contexts = summary["contexts"]
    assert stages["parse"]["pages"] == len(TINY_ARTICLES) and stages["markup"]["articles"] == len(TINY_ARTICLES)
    assert stages["decompress"]["bytes"] == dump.stat().st_size
    assert stages["targets"]["contexts"] == stages["forward"]["contexts"] == stages["write"]["contexts"] == contexts
    assert stages["split"]["sentences"] == summary["sentences"]
    for name in STAGES:
        assert stages[name]["seconds"] >= 0
    # the padding share of the forward's batches: some (the sentences differ in length), never most (sorted by length)
    assert 0 < summary["padding_fraction"] < 0.5


def test_a_build_logs_its_progress_and_its_figures_as_fields_of_a_json_line(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What a build Job's log collector reads (``BERTKNN_LOG_FORMAT=json``): the figures as keys, not a sentence."""
    dump = _xml_dump(tmp_path / "dump.xml")
    with caplog.at_level(logging.INFO, logger="bertknn.builder"):
        build_tiny(tmp_path / "ds", [dump], tiny_model_dir, sparse_indexes=False)
    records = {r.msg.name: r for r in caplog.records if isinstance(r.msg, Event)}
    progress, finished = (json.loads(JsonFormatter().format(records[k])) for k in ("progress", "build finished"))
    assert progress["contexts"] == progress["prepared_contexts"] == finished["contexts"] > 0
    assert progress["articles"] == len(TINY_ARTICLES) and progress["parts"] >= 1 and progress["contexts_per_s"] > 0
    assert progress["bound"] in STAGES and set(progress["stages_wall_s"]) <= set(STAGES) and progress["eta_s"] == 0  # (the last line: all read, all embedded)
    assert finished["stages"]["forward"]["contexts"] == finished["contexts"]
    # the text line reads as it did: a sentence, and the figures as JSON after the name
    assert records["progress"].getMessage().startswith(f"progress: {finished['contexts']:,} contexts embedded of ")
    assert json.loads(records["build finished"].getMessage().removeprefix("build finished: ")) == {
        k: v for k, v in finished.items() if k not in ("time", "level", "logger", "pid", "message")
    }


def test_token_batches_bound_rows_and_padded_tokens() -> None:
    from bertknn.builder.embed import token_batches

    lengths = [3, 3, 4, 5, 8, 8, 9, 20]  # ascending, as the builder sorts them
    cuts = token_batches(lengths, max_rows=4, max_tokens=16)
    assert [e for _, e in cuts][-1] == len(lengths) and all(a < b for a, b in cuts)
    assert [a for a, _ in cuts][1:] == [e for _, e in cuts][:-1]  # contiguous, every row once
    for a, b in cuts:
        assert b - a <= 4
        assert (b - a) * lengths[b - 1] <= 16 or b - a == 1  # a row longer than the budget goes alone
    assert cuts == [(0, 3), (3, 5), (5, 6), (6, 7), (7, 8)]  # 3x4, 2x8, 1x8, 1x9, 20 alone (over the budget)
    assert token_batches(lengths, max_rows=4, max_tokens=None) == [(0, 4), (4, 8)]  # rows alone
    assert token_batches([], 4, 16) == []


def test_a_token_budget_gives_the_same_vectors_in_smaller_batches(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches cut by a token budget embed every context as the row-count batches do (to float16 rounding)."""
    import numpy as np

    import bertknn.builder.embed as embed_module
    from bertknn.core.format import Datastore

    padded: list[tuple[int, int]] = []  # (rows, padded tokens) of each batch the budget build cut
    cut = embed_module.token_batches

    def spy(lengths, max_rows, max_tokens):  # type: ignore[no-untyped-def]
        found = cut(lengths, max_rows, max_tokens)
        if max_tokens:
            padded.extend((b - a, (b - a) * lengths[b - 1]) for a, b in found)
        return found

    monkeypatch.setattr(embed_module, "token_batches", spy)
    dump = _xml_dump(tmp_path / "dump.xml")
    rows_only = build_tiny(tmp_path / "rows", [dump], tiny_model_dir, sparse_indexes=False, batch_tokens=0)
    with caplog.at_level(logging.INFO, logger="bertknn.builder.build"):
        budget = build_tiny(tmp_path / "budget", [dump], tiny_model_dir, sparse_indexes=False, batch_tokens=40)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("build finished: "))
    a, b = Datastore(rows_only), Datastore(budget)
    va = np.concatenate([np.asarray(s.vectors, dtype=np.float32) for s in a.shards])
    vb = np.concatenate([np.asarray(s.vectors, dtype=np.float32) for s in b.shards])
    assert va.shape == vb.shape and va.shape[0] > 0
    np.testing.assert_allclose(vb, va, rtol=2e-3, atol=2e-3)
    assert json.loads(line.removeprefix("build finished: "))["contexts"] == va.shape[0]
    assert padded and all(tokens <= 40 or rows == 1 for rows, tokens in padded)
    assert sum(rows for rows, _ in padded) == va.shape[0] and len(padded) > -(-va.shape[0] // 16)  # more batches


@pytest.mark.parametrize(("device", "trims"), [("cpu", 10), ("cuda", 3)])
def test_the_host_heap_is_trimmed_per_batch_on_a_cpu_and_per_step_on_a_gpu(
    monkeypatch: pytest.MonkeyPatch, device: str, trims: int
) -> None:
    """25 rows, batches of 3 in steps of 10 (4 + 4 + 2 batches): a CPU forward trims after each batch, a GPU
    forward (activations on the device) once per step; each batch is started before the previous one's rows are
    taken; the rows come back in order either way."""
    import numpy as np
    import torch

    import bertknn.builder.embed as embed_module
    from bertknn.core.inputs import MaskedInput, PackedInputs

    calls: list[int] = []
    monkeypatch.setattr(embed_module, "return_free_memory", lambda: calls.append(1))

    events: list[str] = []

    class Fake:
        hidden_size = 2

        def __init__(self) -> None:
            self.device = torch.device(device)
            self.started = 0

        def encode_async(self, batch: PackedInputs) -> object:
            emb = np.array([[x.input_ids[1], len(x.input_ids)] for x in batch], dtype=np.float16)
            n, self.started = self.started, self.started + 1
            events.append(f"start {n}")

            def result() -> np.ndarray:
                events.append(f"take {n}")
                return emb

            return result

    inputs = [MaskedInput((101, i, *([5] * (i % 4)), 102), 1) for i in range(25)]
    prepared = embed_module.PreparedShard(0, [], [], PackedInputs.of(inputs), np.zeros(25), np.zeros(25), np.zeros((25, 2)))
    out = embed_module.embed_prepared(Fake(), prepared, 3, step_rows=10)  # type: ignore[arg-type]
    assert out[:, 0].tolist() == list(range(25)) and len(calls) == trims
    # each batch starts before the previous one's rows are taken (a step's last batch is taken at its end)
    assert events[:6] == ["start 0", "start 1", "take 0", "start 2", "take 1", "start 3"]
    assert events[6:9] == ["take 2", "take 3", "start 4"] and len(events) == 20


def test_the_embedding_step_holds_many_batches_on_a_gpu_and_the_given_size_always() -> None:
    """Batches are cut from each step's length-sorted rows: on a GPU, whose batches are large, the auto step holds
    32 of them; on a CPU it stays at 2048 rows; a step the user sets is kept as set."""
    from bertknn.builder.embed import EMBED_STEP_ROWS, embed_step, token_batches

    assert embed_step(0, 128, "cpu") == EMBED_STEP_ROWS == 2048
    assert embed_step(0, 512, "cuda") == 16_384 and embed_step(0, 16, "cuda") == EMBED_STEP_ROWS
    assert embed_step(300, 512, "cuda") == 300 and embed_step(300, 128, "cpu") == 300
    # what the step changes: lengths 10..128 at random, a budget of 64 rows of the longest: sorting 2048 rows at a
    # time pads far more than sorting a step of 32 such batches
    import numpy as np

    lengths = np.random.default_rng(0).integers(10, 129, 32_768)

    def padding(step: int) -> float:
        real = padded = 0
        for lo in range(0, len(lengths), step):
            chunk = sorted(lengths[lo : lo + step].tolist())
            for a, b in token_batches(chunk, 512, 64 * 128):
                real, padded = real + sum(chunk[a:b]), padded + (b - a) * chunk[b - 1]
        return 1 - real / padded

    assert padding(embed_step(0, 512, "cuda")) < padding(embed_step(0, 512, "cpu")) / 2
