"""Packed model inputs: the same inputs as the objects they pack, sliced, gathered, joined and padded."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from bertknn.core.inputs import MaskedInput, PackedInputs, padded_arrays

ITEMS = [MaskedInput((101, 7, 103, 102), 2), MaskedInput((101, 103, 102), 1), MaskedInput((101, 5, 6, 9, 103, 102), 4)]


def test_packed_inputs_give_back_each_input() -> None:
    packed = PackedInputs.of(ITEMS)
    assert len(packed) == 3 and list(packed) == ITEMS and packed[-1] == ITEMS[-1]
    assert packed.lengths.tolist() == [4, 3, 6]
    assert list(packed[1:3]) == ITEMS[1:3] and list(packed[2:1]) == [] and packed[2:1].offsets.tolist() == [0]
    assert list(packed.take([2, 0])) == [ITEMS[2], ITEMS[0]] and list(packed.take([])) == []
    assert list(PackedInputs.concat([packed[:1], packed[1:], PackedInputs.of([])])) == ITEMS
    assert list(pickle.loads(pickle.dumps(packed))) == ITEMS
    with pytest.raises(IndexError):
        packed[3]
    with pytest.raises(IndexError):
        packed[-4]
    assert packed[-3] == ITEMS[0] and list(packed[-2:]) == ITEMS[1:]
    with pytest.raises(ValueError, match="contiguous"):
        packed[::2]
    empty = PackedInputs.concat([])
    assert len(empty) == 0 and empty.offsets.tolist() == [0]
    joined = PackedInputs.concat([packed[1:], packed[:1]])
    assert joined.offsets.tolist() == [0, 3, 9, 13] and list(joined) == [*ITEMS[1:], ITEMS[0]]


def test_what_was_cut_is_not_part_of_an_input_s_identity() -> None:
    cut = MaskedInput((101, 7, 103, 102), 2, cut=5)
    assert cut == ITEMS[0] and hash(cut) == hash(ITEMS[0]) and cut.cut == 5 and ITEMS[0].cut == 0


def test_padding_from_the_arrays_matches_padding_each_input() -> None:
    ids, attn, rows, mask_pos = PackedInputs.of(ITEMS).padded(0)
    assert ids.tolist() == [[101, 7, 103, 102, 0, 0], [101, 103, 102, 0, 0, 0], [101, 5, 6, 9, 103, 102]]
    assert attn.tolist() == [[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]]
    assert rows.tolist() == [0, 1, 2] and mask_pos.tolist() == [2, 1, 4]
    assert all(a.dtype == np.int64 for a in (ids, attn, rows, mask_pos))
    for got, want in zip(padded_arrays(ITEMS, 0), (ids, attn, rows, mask_pos), strict=True):  # the objects' way
        assert got.dtype == np.int64 and got.tolist() == want.tolist()
    assert [a.shape for a in PackedInputs.of([]).padded(0)] == [(0, 0), (0, 0), (0,), (0,)]


def test_the_encoder_embeds_packed_inputs_as_it_embeds_the_objects(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from bertknn.core.encoder import MaskedLMEncoder

    enc = MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", layer=-2)
    items = [enc.query_input(t) for t in ("zorblat was born in [MASK] .", "[MASK] is a city .", "the [MASK] sings")]
    a = enc.encode(items).embeddings
    b = enc.encode(PackedInputs.of(items)).embeddings
    np.testing.assert_array_equal(a, b)
