"""Loading a masked LM: quiet (no progress bar in a service's log), and the caller's settings left as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

from bertknn.core.errors import ModelLoadError
from bertknn.core.model_files import check_model, from_pretrained, load_tokenizer, stored_layer
from tests.support.families import make_family_model


@pytest.mark.parametrize("bars", [True, False])
def test_a_model_loads_without_a_progress_bar(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], bars: bool
) -> None:
    directory = make_family_model(tmp_path / "m", "bert", ["paris is the capital of france ."] * 20, vocab_size=120)
    (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
    capfd.readouterr()
    try:
        tokenizer, model, missing = from_pretrained(str(directory))
        assert load_tokenizer(str(directory)).mask_token_id == tokenizer.mask_token_id
        out, err = capfd.readouterr()
        assert "Loading weights" not in err + out and "\r" not in err + out, err
        assert model.config.vocab_size == len(tokenizer) and not missing
        assert hf_logging.is_progress_bar_enabled() == bars  # the caller's setting, restored
    finally:
        hf_logging.enable_progress_bar()


@pytest.mark.parametrize(
    ("layer", "index"), [(None, 11), (-1, 12), (-2, 11), (-13, 0), (0, 0), (12, 12)]
)  # fmt: skip
def test_the_stored_layer_counts_negative_layers_from_the_end(layer: int | None, index: int) -> None:
    assert stored_layer(layer, 12, "m") == index  # hidden_states[0..12] of a 12-layer model; None: second-to-last


@pytest.mark.parametrize("layer", [13, -14])
def test_a_layer_the_model_has_not_is_refused_naming_the_range(layer: int) -> None:
    with pytest.raises(ModelLoadError, match=rf"^m: layer {layer} is out of range; the model has hidden_states\[0\.\.12\]$"):
        stored_layer(layer, 12, "m")


class _Tokenizer:
    def __init__(self, mask_token_id: int | None = 4, is_fast: bool = True):
        self.mask_token_id, self.is_fast = mask_token_id, is_fast


class _Config:
    max_position_embeddings = 512


@pytest.mark.parametrize(
    ("tokenizer", "max_seq_len", "says"),
    [
        (_Tokenizer(), 8, None),
        (_Tokenizer(), 512, None),
        (_Tokenizer(mask_token_id=None), 64, "m: the tokenizer has no mask token; a masked LM is required"),
        (_Tokenizer(is_fast=False), 64, "m: a fast (Rust) tokenizer is required for word alignment"),
        (_Tokenizer(), 7, "max_seq_len=7 must be between 8 and the model's limit 512"),
        (_Tokenizer(), 513, "max_seq_len=513 must be between 8 and the model's limit 512"),
    ],
)  # fmt: skip
def test_a_model_without_a_mask_a_fast_tokenizer_or_room_is_refused(
    tokenizer: _Tokenizer, max_seq_len: int, says: str | None
) -> None:
    if says is None:
        check_model(tokenizer, _Config(), "m", max_seq_len)  # type: ignore[arg-type]
        return
    with pytest.raises(ModelLoadError) as err:
        check_model(tokenizer, _Config(), "m", max_seq_len)  # type: ignore[arg-type]
    assert str(err.value) == says
