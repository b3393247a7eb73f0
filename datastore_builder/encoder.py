"""Masked contexts -> [MASK] embeddings at one hidden layer (and, for the service, the MLM distribution).

`MaskedLMEncoder.encode` is the single function that embeds both datastore contexts and queries; a mismatch
between the two would silently ruin the kNN search, so there is no second code path.
"""

from __future__ import annotations

import hashlib
import logging
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "float32", "float16", "bfloat16"]
_MASK_RE = re.compile(r"\[\s*mask\s*\]", re.IGNORECASE)


class ModelLoadError(Exception):
    """The model cannot be loaded or does not fit the datastore; the message says which and why."""


class QueryError(ValueError):
    """A cloze query that cannot be embedded (no [MASK], several, empty...)."""


def resolve_device(device: DeviceName | str) -> torch.device:
    """Decide the device once; log when `auto` falls back to the CPU."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        logger.info("device=auto: no CUDA device visible, using the CPU")
        return torch.device("cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device=cuda was asked for but torch sees no CUDA device; use --device cpu or auto")
    return torch.device(device)


def resolve_dtype(dtype: DtypeName | str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def weights_sha256(model: torch.nn.Module) -> str:
    """Hash of the float32 weights by parameter name: the model identity recorded in the manifest."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class MaskedInput:
    """Token ids with special tokens added, and the position of the single [MASK]."""

    input_ids: tuple[int, ...]
    mask_pos: int


@dataclass(frozen=True)
class EncoderOutput:
    embeddings: np.ndarray  # float32 [n, hidden]
    mlm_log_probs: torch.Tensor | None  # float32 [n, vocab], log-softmax at the [MASK] position


class ContextTokenizer:
    """Token ids -> model inputs around one [MASK]; the shared path for datastore contexts and queries."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_seq_len: int):
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.mask_id = int(tokenizer.mask_token_id)

    def masked_input(self, ids: Sequence[int], mask_pos: int) -> MaskedInput:
        """Special tokens around ``ids`` (which hold the mask at ``mask_pos``), windowed to ``max_seq_len``.

        Shared by the builder (a sentence with one target replaced by the mask id) and the service (a query
        tokenised as is), so both embed identically.
        """
        budget = self.max_seq_len - 2
        if len(ids) > budget:
            start = min(max(0, mask_pos - budget // 2), len(ids) - budget)
            ids = ids[start : start + budget]
            mask_pos -= start
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        if cls_id is None or sep_id is None:
            full = self.tokenizer.build_inputs_with_special_tokens(list(ids))
            return MaskedInput(tuple(full), full.index(self.mask_id))
        return MaskedInput((cls_id, *ids, sep_id), mask_pos + 1)

    def normalize_query(self, text: str) -> str:
        """Any spelling of [MASK] (``[mask]``, ``[ Mask ]``) becomes the tokenizer's mask token."""
        return _MASK_RE.sub(self.tokenizer.mask_token, text)

    def query_input(self, text: str) -> MaskedInput:
        """A cloze question -> model input; `QueryError` says what is wrong with the text."""
        text = self.normalize_query(text)
        n_masks = text.count(self.tokenizer.mask_token)
        if n_masks != 1:
            raise QueryError(f"the text must contain exactly one [MASK]; found {n_masks}")
        if not text.replace(self.tokenizer.mask_token, "").strip():
            raise QueryError("the text has nothing but [MASK]; give the words around it")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        positions = [i for i, t in enumerate(ids) if t == self.mask_id]
        if len(positions) != 1:
            raise QueryError(f"the text must tokenise to exactly one [MASK]; found {len(positions)}")
        return self.masked_input(ids, positions[0])


BackendName = Literal["auto", "eager", "torchscript"]


class _MaskCore(torch.nn.Module):
    """The service's forward as one module: the [MASK] row at ``layer`` and log p_MLM there (head on that row only)."""

    def __init__(self, base: torch.nn.Module, head: torch.nn.Module, layer: int):
        super().__init__()
        self.base, self.head, self.layer = base, head, layer

    def forward(
        self, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.base(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states
        return hidden[self.layer][rows, pos], torch.log_softmax(self.head(hidden[-1][rows, pos]).float(), dim=-1)


class MaskedLMEncoder:
    """A Hugging Face masked LM used for two things: the [MASK] embedding at ``layer`` and p_MLM at [MASK]."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        name: str,
        layer: int | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        max_seq_len: int = 128,
        weights_hash: str | None = None,
    ):
        if tokenizer.mask_token_id is None:
            raise ModelLoadError(f"{name}: the tokenizer has no mask token; a masked LM is required")
        if not getattr(tokenizer, "is_fast", False):
            raise ModelLoadError(f"{name}: a fast (Rust) tokenizer is required for word alignment")
        self.name = name
        self.tokenizer = tokenizer
        config: Any = model.config
        self.config = config
        self.num_layers = int(config.num_hidden_layers)
        self.layer = self.num_layers - 1 if layer is None else (layer if layer >= 0 else self.num_layers + 1 + layer)
        if not 0 <= self.layer <= self.num_layers:
            raise ModelLoadError(
                f"{name}: layer {layer} is out of range; the model has hidden_states[0..{self.num_layers}]"
            )
        limit = int(getattr(model.config, "max_position_embeddings", 512))
        if max_seq_len > limit or max_seq_len < 8:
            raise ModelLoadError(f"max_seq_len={max_seq_len} must be between 8 and the model's limit {limit}")
        self.max_seq_len = max_seq_len
        self.inputs = ContextTokenizer(tokenizer, max_seq_len)
        self.weights_sha256 = weights_hash or weights_sha256(model)
        self.device = device or torch.device("cpu")
        self.dtype = dtype
        model = model.to(self.device, dtype).eval()
        self.model = model
        self.base: torch.nn.Module = cast(torch.nn.Module, model.base_model)
        heads = [m for n, m in model.named_children() if n != model.base_model_prefix]
        # BERT-like models have exactly one head module (``cls``); it is applied at the [MASK] row only.
        self.head: torch.nn.Module | None = heads[0] if len(heads) == 1 else None
        self.vocab_size = int(config.vocab_size)
        self.hidden_size = int(config.hidden_size)
        self.backend: Literal["eager", "torchscript"] = "eager"
        self._traced: torch.jit.ScriptModule | None = None

    @classmethod
    def load(
        cls,
        name_or_path: str,
        *,
        layer: int | None = None,
        device: DeviceName | str = "auto",
        dtype: DtypeName | str = "auto",
        max_seq_len: int = 128,
    ) -> MaskedLMEncoder:
        """Load any Hugging Face masked LM by hub name or local directory (safetensors preferred)."""
        dev = resolve_device(device)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, use_fast=True)
            model = AutoModelForMaskedLM.from_pretrained(name_or_path, dtype=torch.float32, use_safetensors=None)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                f"cannot load the masked LM {name_or_path!r}: {exc}. Pass a local model directory "
                "(--model /path or BERTKNN_MODEL) where the Hugging Face hub is unreachable."
            ) from exc
        return cls(
            model,
            tokenizer,
            name=name_or_path,
            layer=layer,
            device=dev,
            dtype=resolve_dtype(dtype, dev),
            max_seq_len=max_seq_len,
        )

    # ---- inputs (delegated, so worker processes can tokenise without the model) ---------------------------

    def masked_input(self, ids: Sequence[int], mask_pos: int) -> MaskedInput:
        return self.inputs.masked_input(ids, mask_pos)

    def query_input(self, text: str) -> MaskedInput:
        return self.inputs.query_input(text)

    # ---- backend ------------------------------------------------------------------------------------------

    def set_backend(self, backend: BackendName | str) -> str:
        """Run ``encode(..., with_mlm=True)`` eagerly or through a TorchScript trace of the same modules.

        The trace runs the whole forward in C++: no Python between the layers, so no GIL hand-offs with the
        web server's threads (which made the eager forward several times slower under load on few cores).
        ``auto`` traces on the CPU and stays eager on a GPU. The trace is checked against the eager forward on a
        padded batch before it is used; a model that cannot be traced, or whose trace differs, stays eager (logged).
        Returns the backend in use.
        """
        if backend not in ("auto", "eager", "torchscript"):
            raise ValueError(f"backend must be auto, eager or torchscript, not {backend!r}")
        want = ("torchscript" if self.device.type == "cpu" else "eager") if backend == "auto" else backend
        self._traced, self.backend = None, "eager"
        if want == "eager":
            return self.backend
        if self.head is None:
            logger.warning("%s: no single LM head module to trace; the eager backend stays in use", self.name)
            return self.backend
        try:
            self._traced = self._trace()
            self.backend = "torchscript"
        except Exception as exc:  # noqa: BLE001 - any tracing failure falls back to the eager forward
            logger.warning("%s: TorchScript trace not used (%s); the eager backend stays in use", self.name, exc)
        return self.backend

    @torch.inference_mode()
    def _trace(self) -> torch.jit.ScriptModule:
        assert self.head is not None
        core = _MaskCore(self.base, self.head, self.layer).eval()
        mask = self.tokenizer.mask_token
        # A padded example (two lengths), so the attention mask is part of the traced graph; then a check on
        # other shapes (another width, batch sizes 1 and 3) against the eager forward.
        example = [self.query_input(f"the {mask} ."), self.query_input(f"a b c d e f g h {mask} i j .")]
        texts = (f"{mask} x y z w .", f"p q {mask} .", f"one two three four five {mask} six seven eight nine ten .")
        check = [self.query_input(t) for t in texts]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings about shape-dependent Python values (constants here)
            traced = cast(torch.jit.ScriptModule, torch.jit.trace(core, self._tensors(example), check_trace=False))
        for batch in (check[:1], check):
            want_emb, want_lp = core(*self._tensors(batch))
            got_emb, got_lp = traced(*self._tensors(batch))
            tol = 1e-4 if self.dtype == torch.float32 else 2e-2
            err = max((want_emb - got_emb).abs().max().item(), (want_lp - got_lp).abs().max().item())
            if not err <= tol:
                raise RuntimeError(f"trace differs from the eager forward by {err:.3g} (tolerance {tol})")
        return traced

    def _tensors(
        self, items: Sequence[MaskedInput]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Padded ids, attention mask, batch rows and [MASK] positions, on the model's device."""
        width = max(len(x.input_ids) for x in items)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(items), width), pad, dtype=torch.long)
        attn = torch.zeros((len(items), width), dtype=torch.long)
        for i, x in enumerate(items):
            ids[i, : len(x.input_ids)] = torch.tensor(x.input_ids)
            attn[i, : len(x.input_ids)] = 1
        rows = torch.arange(len(items))
        mask_pos = torch.tensor([x.mask_pos for x in items])
        non_blocking = self.device.type == "cuda"
        if non_blocking:  # pinned host memory makes the copies asynchronous
            ids, attn = ids.pin_memory(), attn.pin_memory()
        return (
            ids.to(self.device, non_blocking=non_blocking),
            attn.to(self.device, non_blocking=non_blocking),
            rows.to(self.device),
            mask_pos.to(self.device),
        )

    # ---- forward ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, items: Sequence[MaskedInput], *, with_mlm: bool = False) -> EncoderOutput:
        """One forward pass over a batch: [MASK] embeddings at ``self.layer`` and, optionally, log p_MLM there."""
        if not items:
            return EncoderOutput(np.zeros((0, self.hidden_size), np.float32), None)
        ids, attn, rows, mask_pos = self._tensors(items)
        if with_mlm and self._traced is not None:
            emb, log_probs = self._traced(ids, attn, rows, mask_pos)
            return EncoderOutput(emb.float().cpu().numpy(), log_probs.cpu())
        need_all = with_mlm and self.head is None
        if need_all:
            out = self.model(input_ids=ids, attention_mask=attn, output_hidden_states=True)
            hidden = out.hidden_states
        else:
            out = self.base(input_ids=ids, attention_mask=attn, output_hidden_states=True)
            hidden = out.hidden_states
        emb = hidden[self.layer][rows, mask_pos]
        log_probs = None
        if with_mlm:
            if need_all:
                logits = out.logits[rows, mask_pos]
            else:
                assert self.head is not None
                logits = self.head(hidden[-1][rows, mask_pos])
            log_probs = torch.log_softmax(logits.float(), dim=-1).cpu()
        return EncoderOutput(emb.float().cpu().numpy(), log_probs)
