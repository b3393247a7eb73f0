"""A CPU batch of mixed lengths in groups of similar width: the grouping's optimum, and the encoder's outputs put
back in the batch's order, equal to each input's own forward."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForMaskedLM, BertConfig

from bertknn.core import width_groups as wg
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.inputs import PackedInputs
from tests.unit.test_encoder import direct


def padded_cost(lengths: np.ndarray, groups: list[np.ndarray], per_call: float) -> float:
    return sum(len(g) * int(lengths[g].max()) + per_call for g in groups)


def brute_force(lengths: np.ndarray, per_call: float) -> float:
    """The least cost over every split of the inputs sorted by length into runs."""
    s = np.sort(lengths)
    best = float("inf")
    for cuts in itertools.product((False, True), repeat=len(s) - 1):
        bounds = [0, *[i + 1 for i, c in enumerate(cuts) if c], len(s)]
        best = min(best, sum((b - a) * int(s[b - 1]) + per_call for a, b in itertools.pairwise(bounds)))
    return best


@pytest.mark.parametrize("per_call", [0.0, 1.0, 4.0, 15.0, 1e9])
def test_groups_partition_the_batch_at_the_least_padded_cost(per_call: float) -> None:
    rng = np.random.default_rng(int(per_call) % 7)
    for _ in range(25):
        lengths = rng.integers(3, 30, size=int(rng.integers(1, 11)))
        groups = wg.width_groups(lengths, per_call)
        assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))  # every input once
        for a, b in itertools.pairwise(groups):  # runs of the length order, shortest first
            assert lengths[a].max() <= lengths[b].min()
        assert padded_cost(lengths, groups, per_call) == pytest.approx(brute_force(lengths, per_call))


def test_one_group_when_a_call_costs_more_than_the_padding_it_saves() -> None:
    assert len(wg.width_groups([5, 5, 5], 0.0)) == 1  # one width
    assert len(wg.width_groups([4, 30, 6, 9], 1e9)) == 1
    assert [g.tolist() for g in wg.width_groups([30, 4, 30, 4], 0.0)] == [[1, 3], [0, 2]]


def test_a_calls_price_falls_with_the_models_size() -> None:
    small = BertConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=12, num_attention_heads=4)
    base = BertConfig()  # bert-base's shape
    assert wg.CALL_WEIGHT_POSITIONS < wg.call_positions(base, "onnx") < wg.CALL_WEIGHT_POSITIONS + 1
    assert wg.call_positions(small, "onnx") > wg.CALL_WEIGHT_POSITIONS + 10
    assert wg.call_positions(small, "eager") > wg.call_positions(small, "onnx")  # Python's dispatch costs more


@pytest.mark.parametrize("backend", ["eager", "onnx"])
def test_a_grouped_batch_gives_each_input_its_own_forward(
    tiny_model_dir: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    enc = MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", dtype="float32", max_seq_len=32)
    assert enc.set_backend(backend) == backend
    reference = AutoModelForMaskedLM.from_pretrained(str(tiny_model_dir)).eval()
    texts = ["[MASK] is a large city with a famous bridge near the sea and a river that runs through it .",
             "zorblat was born in [MASK] .", "[MASK] .", "the bridge of plonk is [MASK]",
             "a river runs through [MASK] near the sea and the bridge ."]  # fmt: skip
    items = [enc.query_input(t) for t in texts]
    widths: list[int] = []
    arrays = enc.eager.arrays
    monkeypatch.setattr(enc.eager, "arrays", lambda part: widths.append(max(len(x.input_ids) for x in part))
                        or arrays(part))  # fmt: skip
    monkeypatch.setattr(wg, "CALL_FLOPS", {"onnx": 0.0, "eager": 0.0})  # every width its own group
    monkeypatch.setattr(wg, "CALL_WEIGHT_POSITIONS", 0.0)
    out = enc.encode(items, with_mlm=True)
    assert out.mlm_log_probs is not None
    assert sorted(widths) == sorted({len(x.input_ids) for x in items})  # one padded forward per width
    for i, item in enumerate(items):
        want_emb, want_logp = direct(reference, item, enc.layer)
        np.testing.assert_allclose(out.embeddings[i], want_emb, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(out.mlm_log_probs[i].numpy(), want_logp, rtol=1e-4, atol=1e-4)
    # the builder's packed batches run whole, as they come
    widths.clear()
    packed = enc.encode(PackedInputs.of(items))
    np.testing.assert_allclose(packed.embeddings, out.embeddings, rtol=1e-4, atol=1e-4)
    assert widths == [max(len(x.input_ids) for x in items)]


def test_each_groups_rows_go_back_to_their_inputs_places() -> None:
    calls: list[list[int]] = []

    def run(part: list[int]) -> tuple[np.ndarray, torch.Tensor]:  # row i: the input's own value
        calls.append(list(part))
        rows = np.array([[v, -v] for v in part], dtype=np.float32)
        return rows, torch.from_numpy(rows * 10)

    items = [10, 11, 12, 13, 14]
    emb, log_p = wg.in_groups(run, items, [np.array([3, 0]), np.array([4, 2, 1])])
    assert calls == [[13, 10], [14, 12, 11]]
    np.testing.assert_array_equal(emb[:, 0], items)
    assert log_p is not None
    np.testing.assert_array_equal(log_p[:, 1].numpy(), [-10 * v for v in items])
    assert wg.in_groups(run, items, [np.arange(5)])[0][:, 0].tolist() == items  # one group: one call, as given
    assert calls[-1] == items
