"""Packed model inputs: the same inputs as the objects they pack, sliced, gathered, joined and padded."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from bertknn.core.inputs import MaskedInput, PackedInputs

ITEMS = [MaskedInput((101, 7, 103, 102), 2), MaskedInput((101, 103, 102), 1), MaskedInput((101, 5, 6, 9, 103, 102), 4)]


def test_packed_inputs_give_back_each_input() -> None:
    packed = PackedInputs.of(ITEMS)
    assert len(packed) == 3 and list(packed) == ITEMS and packed[-1] == ITEMS[-1]
    assert packed.lengths.tolist() == [4, 3, 6]
    assert list(packed[1:3]) == ITEMS[1:3] and list(packed[2:1]) == []
    assert list(packed.take([2, 0])) == [ITEMS[2], ITEMS[0]] and list(packed.take([])) == []
    assert list(PackedInputs.concat([packed[:1], packed[1:], PackedInputs.of([])])) == ITEMS
    assert list(pickle.loads(pickle.dumps(packed))) == ITEMS
    with pytest.raises(IndexError):
        packed[3]


def test_padding_from_the_arrays_matches_padding_each_input() -> None:
    ids, attn, rows, mask_pos = PackedInputs.of(ITEMS).padded(0)
    assert ids.tolist() == [[101, 7, 103, 102, 0, 0], [101, 103, 102, 0, 0, 0], [101, 5, 6, 9, 103, 102]]
    assert attn.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert rows.tolist() == [0, 1, 2] and mask_pos.tolist() == [2, 1, 4]
    assert all(a.dtype == np.int64 for a in (ids, attn, rows, mask_pos))


def test_the_encoder_embeds_packed_inputs_as_it_embeds_the_objects(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from bertknn.core.encoder import MaskedLMEncoder

    enc = MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", layer=-2)
    items = [enc.query_input(t) for t in ("zorblat was born in [MASK] .", "[MASK] is a city .", "the [MASK] sings")]
    a = enc.encode(items).embeddings
    b = enc.encode(PackedInputs.of(items)).embeddings
    np.testing.assert_array_equal(a, b)
