"""Loading a masked LM: quiet (no progress bar in a service's log), and the caller's settings left as they were."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers.utils import logging as hf_logging

from bertknn.core.model_files import from_pretrained, load_tokenizer
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
