"""A masked LM's tokenizer and weights from a hub name or a local directory, and what every model here must have."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from transformers import AutoModelForMaskedLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from bertknn.core.errors import ModelLoadError
from bertknn.core.model_ref import check_model_dir

# required: refuse a checkpoint without its MLM head; ignored: load it for its embeddings (the builder); knn-only:
# serve it with a uniform p_MLM
MlmHeadPolicy = Literal["required", "ignored", "knn-only"]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def check_model(tokenizer: PreTrainedTokenizerBase, config: Any, name: str, max_seq_len: int) -> None:
    """What every masked LM here needs: a mask token, a fast tokenizer, a sequence length it takes."""
    if tokenizer.mask_token_id is None:
        raise ModelLoadError(f"{name}: the tokenizer has no mask token; a masked LM is required")
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{name}: a fast (Rust) tokenizer is required for word alignment")
    limit = int(getattr(config, "max_position_embeddings", 512))
    if max_seq_len > limit or max_seq_len < 8:
        raise ModelLoadError(f"max_seq_len={max_seq_len} must be between 8 and the model's limit {limit}")


def stored_layer(layer: int | None, num_layers: int, name: str) -> int:
    """The hidden_states index kept: ``layer`` (negative counts from the end), by default the second-to-last."""
    index = num_layers - 1 if layer is None else (layer if layer >= 0 else num_layers + 1 + layer)
    if not 0 <= index <= num_layers:
        raise ModelLoadError(f"{name}: layer {layer} is out of range; the model has hidden_states[0..{num_layers}]")
    return index


@contextlib.contextmanager
def _quietly() -> Iterator[None]:
    """Loading without ``transformers``' warnings and progress bars: a service's log holds lines, not a bar
    redrawn with carriage returns, and its process no tqdm monitor thread (the caller says what it loaded)."""
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def load_tokenizer(name_or_path: str) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a hub name or local directory alone (a process that tokenises for a model run
    elsewhere)."""
    try:
        with _quietly():
            return AutoTokenizer.from_pretrained(name_or_path, use_fast=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {name_or_path!r}: {_first_line(exc)}") from exc


def from_pretrained(name_or_path: str) -> tuple[Any, Any, list[str]]:
    """The tokenizer and masked LM of a hub name or local directory (float32, safetensors preferred), and the
    head's weights the checkpoint lacks (sorted; none for a full masked LM)."""
    check_model_dir(name_or_path)
    try:
        with _quietly():
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, use_fast=True)
            model, info = AutoModelForMaskedLM.from_pretrained(
                name_or_path, dtype=torch.float32, use_safetensors=None, output_loading_info=True
            )
    except (OSError, ValueError, SafetensorError) as exc:  # (the last: a damaged weights file)
        raise ModelLoadError(
            f"cannot load the masked LM {name_or_path!r}: {_first_line(exc)}. Pass a local model directory "
            "(--model /path or BERTKNN_MODEL) where the Hugging Face hub is unreachable."
        ) from exc
    prefix = f"{model.base_model_prefix}."
    return tokenizer, model, sorted(k for k in info.get("missing_keys", ()) if not k.startswith(prefix))


def refuse_headless(name: str, missing: list[str], policy: MlmHeadPolicy) -> None:
    """A checkpoint without its MLM head serves random p_MLM: refused unless the policy says what to do."""
    if missing and policy == "required":
        raise ModelLoadError(
            f"{name}: the checkpoint has no MLM head ({len(missing)} head weights missing, e.g. "
            f"{missing[0]}); p_MLM would be random. Use a checkpoint with its MLM head, or serve it kNN-only "
            "(--model-knn-only / BERTKNN_MODEL__KNN_ONLY=true)"
        )
