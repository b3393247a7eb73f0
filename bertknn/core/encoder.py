"""Masked contexts -> [MASK] embeddings at one hidden layer (and, for the service, the MLM distribution).

`MaskedLMEncoder.encode` is the single function that embeds both datastore contexts and queries; a mismatch
between the two would silently ruin the kNN search, so there is no second code path. Its parts live beside it:
the inputs (`bertknn.core.context_tokenizer`), the model files (`bertknn.core.model_files`), the head and the
forward module (`bertknn.core.heads`), its cheaper cuts (`bertknn.core.truncate`) and the ONNX backend
(`bertknn.core.onnx_forward`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from bertknn.core.backend import CompiledBackend
from bertknn.core.context_tokenizer import ContextTokenizer
from bertknn.core.eager import EagerForward
from bertknn.core.hashing import weights_sha256
from bertknn.core.heads import mlm_head
from bertknn.core.inputs import MaskedInput, PackedInputs
from bertknn.core.model_files import (
    MlmHeadPolicy,
    check_model,
    from_pretrained,
    refuse_headless,
    stored_layer,
)
from bertknn.core.onnx_cache import OnnxCache
from bertknn.core.runtime import (
    DeviceName,
    DeviceWait,
    DtypeName,
    attention_without_cudnn,
    resolve_device,
    resolve_dtype,
)
from bertknn.core.topk import top_entries, top_set_torch
from bertknn.core.width_groups import call_positions, in_groups, width_groups

logger = logging.getLogger(__name__)

BackendName = Literal["auto", "eager", "onnx"]


@dataclass(frozen=True)
class EncoderOutput:
    embeddings: np.ndarray  # float32 [n, hidden]
    mlm_log_probs: torch.Tensor | None  # float32 [n, vocab], log-softmax at the [MASK] position
    # with ``encode(..., mlm_top=t)``: the t largest log p_MLM of each row, most probable first (ties: smaller id
    # first), as (values float32 [n, t], token ids int64 [n, t])
    mlm_top: tuple[np.ndarray, np.ndarray] | None = None


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
        truncate: bool = True,
    ):
        """``truncate``: the forwards run cut where the cut gives the same rows (`EagerForward.cut_forwards`);
        False keeps the full forward (a reference to compare against)."""
        check_model(tokenizer, model.config, name, max_seq_len)
        self.name, self.tokenizer, self.max_seq_len = name, tokenizer, max_seq_len
        self.config = config = cast(Any, model.config)
        self.num_layers = int(config.num_hidden_layers)
        self.layer = stored_layer(layer, self.num_layers, name)
        self.weights_sha256 = weights_hash or weights_sha256(model)
        self.device, self.dtype = device or torch.device("cpu"), dtype
        if self.device.type == "cuda":  # every batch shape new to cuDNN's attention costs a graph build
            attention_without_cudnn()
        self.model = model.to(self.device, dtype).eval()
        self.wait = DeviceWait(self.device)  # how a forward's results are waited for (`DeviceWait.blocking`)
        self.head: torch.nn.Module | None = mlm_head(self.model)  # None: no single head module (`EagerForward`)
        self.vocab_size, self.hidden_size = int(config.vocab_size), int(config.hidden_size)
        self.inputs = ContextTokenizer(tokenizer, max_seq_len, self.vocab_size)
        self.words = self.inputs.words
        self.eager = EagerForward(self.model, self.head, self.layer, tokenizer.pad_token_id or 0, self.device, dtype)
        if truncate:
            self.eager.cut_forwards(self.query_input, tokenizer.mask_token, self.num_layers, name)
        self.has_mlm = True  # False: no trained MLM head (`load`'s knn-only); p_MLM is then uniform
        self.compiled = CompiledBackend(self.eager, self.query_input, tokenizer.mask_token, name, self.weights_sha256)

    @classmethod
    def load(
        cls,
        name_or_path: str,
        *,
        layer: int | None = None,
        device: DeviceName | str = "auto",
        dtype: DtypeName | str = "auto",
        max_seq_len: int = 128,
        mlm_head: MlmHeadPolicy = "required",
        truncate: bool = True,
    ) -> MaskedLMEncoder:
        """Load any Hugging Face masked LM by hub name or local directory (safetensors preferred).

        ``mlm_head``: ``required`` refuses a checkpoint whose MLM head weights are missing (a random head would
        serve garbage p_MLM); ``ignored`` loads it for its embeddings only (the builder), ``knn-only`` serves it
        with a uniform p_MLM, so the answers are the neighbours' alone.
        """
        dev = resolve_device(device)
        tokenizer, model, missing = from_pretrained(name_or_path)
        refuse_headless(name_or_path, missing, mlm_head)
        encoder = cls(model, tokenizer, name=name_or_path, layer=layer, device=dev, dtype=resolve_dtype(dtype, dev),
                      max_seq_len=max_seq_len, truncate=truncate)  # fmt: skip
        if mlm_head == "knn-only" or (missing and mlm_head == "ignored"):
            encoder.has_mlm = False
            if mlm_head == "knn-only":
                logger.warning("%s: served kNN-only: p_MLM is uniform, the answers are the neighbours'", name_or_path)
        return encoder

    # ---- inputs (delegated, so worker processes can tokenise without the model) ---------------------------

    def masked_input(self, ids: Sequence[int], mask_pos: int) -> MaskedInput:
        return self.inputs.masked_input(ids, mask_pos)

    def query_input(self, text: str) -> MaskedInput:
        return self.inputs.query_input(text)

    @property
    def backend(self) -> str:
        """The forward `encode` runs: eager, or onnx (`set_backend`)."""
        return self.compiled.name

    @property
    def numerics(self) -> str:
        """What the forward's numbers depend on besides the weights: dtype and backend (``float32/onnx``). Part of
        every cache key, so that replicas of other numerics sharing one cache never serve each other's values."""
        return f"{str(self.dtype).removeprefix('torch.')}/{self.compiled.name}"

    # ---- backend ------------------------------------------------------------------------------------------

    def set_backend(
        self, backend: BackendName | str, *, with_mlm: bool = True, onnx_cache: OnnxCache | None = None
    ) -> str:
        """How ``encode(..., with_mlm=...)`` runs the model: eagerly, or in ONNX Runtime.

        ``with_mlm``: the call the compiled forward serves, with p_MLM (the service) or embeddings only (the
        builder); the other call stays eager.

        The same modules either way (`MaskCore`: the [MASK] row at ``layer``, the head on that row only).
        ``onnx`` runs the whole forward outside Python with fused CPU kernels (docs/decisions/onnx-runtime-on-cpu.md);
        ``auto``: onnx on the CPU, eager on a GPU. A backend is used only after its outputs matched the eager
        forward on padded batches of other shapes than the one it was built from; one that cannot be built, or
        differs, falls back (logged). Returns the backend in use. Asking again for the compiled backend in use (same
        ``backend`` and ``with_mlm``) keeps it: an ONNX export of a base-sized model takes seconds, which a builder
        handed a ready encoder should not pay twice. ``onnx_cache``: where exported graphs are kept across processes
        (`bertknn.core.onnx_cache`); None exports each time.
        """
        return self.compiled.set(backend, with_mlm, onnx_cache)

    @torch.inference_mode()
    def log_probs_at(self, sequences: Sequence[Sequence[int]], reads: Sequence[tuple[int, int]]) -> torch.Tensor:
        """log p_MLM at several positions of each sequence from one forward pass: row i of the result is read at
        ``reads[i]`` = (sequence index, position). (Several masks of one sequence, as the one-pass fill reads
        them, cost one row of the batch, not one each.)"""
        if not reads:
            return torch.zeros((0, self.vocab_size))
        if not self.has_mlm:
            return torch.full((len(reads), self.vocab_size), -float(np.log(self.vocab_size)))
        ids, attn, _, _ = self.eager.arrays([MaskedInput(tuple(x), 0) for x in sequences])
        rows = np.fromiter((r for r, _ in reads), np.int64, len(reads))
        pos = np.fromiter((p for _, p in reads), np.int64, len(reads))
        if self.compiled.fast is not None and self.compiled.with_mlm:
            log_p = self.compiled.fast(ids, attn, rows, pos)[1]
            assert log_p is not None
        else:
            log_p = self.eager.log_probs_at(ids, attn, rows, pos)
        return self.words.vocab.merge_log_probs(log_p) if self.words.vocab.merge_layers else log_p

    # ---- forward ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, items: Sequence[MaskedInput], *, with_mlm: bool = False, mlm_top: int = 0) -> EncoderOutput:
        """One forward pass over a batch: [MASK] embeddings at ``self.layer`` and, optionally, log p_MLM there.

        ``mlm_top`` > 0 (with ``with_mlm``): also the ``mlm_top`` most probable entries of each row
        (`EncoderOutput.mlm_top`, `top_entries`).
        """
        if mlm_top < 0 or (mlm_top and not with_mlm):
            raise ValueError("mlm_top must be >= 0, and only applies with with_mlm=True")
        out = self._forward(items, with_mlm and self.has_mlm)
        if with_mlm and not self.has_mlm:  # kNN-only: every token equally likely
            uniform = torch.full((len(items), self.vocab_size), -float(np.log(self.vocab_size)))
            out = EncoderOutput(out.embeddings, uniform)
        elif out.mlm_log_probs is not None and self.words.vocab.merge_layers:
            # one word, one entry: a bare form's mass (``Paris`` at a text's start) goes to ``ĠParis``
            out = EncoderOutput(out.embeddings, self.words.vocab.merge_log_probs(out.mlm_log_probs))
        if not mlm_top or out.mlm_log_probs is None:
            return out
        return _with_top(out, min(mlm_top, self.vocab_size))

    @torch.inference_mode()
    def encode_async(self, items: Sequence[MaskedInput]) -> Callable[[], np.ndarray]:
        """Start embedding a batch ([MASK] embeddings only, as the builder stores them); the returned call gives
        them, float16 [n, hidden]. With the eager forward on a GPU it returns once the forward and a copy into
        pinned host memory are queued, so the caller can prepare and start the next batch while this one runs
        (the call then waits for the copy alone); elsewhere the batch is embedded before it returns."""
        if self.device.type != "cuda" or self.compiled.fast is not None or not items:
            emb = self.encode(items).embeddings.astype(np.float16)
            return lambda: emb
        on_device, _ = self.eager.run(items, with_mlm=False)
        host = torch.empty(tuple(on_device.shape), dtype=torch.float16, pin_memory=True)
        host.copy_(on_device.to(torch.float16), non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()

        def result() -> np.ndarray:
            copied.synchronize()
            return host.numpy()

        return result

    @property
    def heads_on_device(self) -> bool:
        """Whether `encode_heads` picks the top of p_MLM where the forward ran (the eager forward on a GPU), so
        that only the picked entries cross to the host."""
        return self.device.type == "cuda" and self.compiled.fast is None and self.has_mlm

    @torch.inference_mode()
    def encode_heads(self, items: Sequence[MaskedInput], n_top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[MASK] embeddings and each row's ``n_top`` largest log p_MLM, picked where the eager forward ran
        (`top_set_torch`: the same entries as `top_set` on the host), so that on a GPU the whole distribution never
        leaves it: (embeddings [n, hidden], values [n, n_top], ids [n, n_top] ascending per row). The service takes
        this path where `heads_on_device` says so."""
        emb, log_p = self.eager.run(items, with_mlm=True)
        assert log_p is not None
        if self.words.vocab.merge_layers:
            log_p = self.words.vocab.merge_log_probs(log_p)
        values, ids = top_set_torch(log_p, n_top)
        self.wait()
        return emb.float().cpu().numpy(), values.float().cpu().numpy(), ids.cpu().numpy()

    def _forward(self, items: Sequence[MaskedInput], with_mlm: bool) -> EncoderOutput:
        if not items:
            return EncoderOutput(
                np.zeros((0, self.hidden_size), np.float32), torch.zeros((0, self.vocab_size)) if with_mlm else None
            )
        return EncoderOutput(*_grouped_forward(self, items, with_mlm))


def _grouped_forward(
    enc: MaskedLMEncoder, items: Sequence[MaskedInput], with_mlm: bool
) -> tuple[np.ndarray, torch.Tensor | None]:
    """`MaskedLMEncoder._forward`'s padded forwards: on a CPU, a service's batch of mixed lengths in groups of
    similar width (`width_groups`); the builder's batches (`PackedInputs`) come sorted by length and run whole, as
    does every batch on a GPU (whose CUDA graphs pad to buckets anyway)."""
    compiled = enc.compiled.fast is not None and with_mlm == enc.compiled.with_mlm

    def padded(part: Sequence[MaskedInput]) -> tuple[np.ndarray, torch.Tensor | None]:
        if compiled:
            return enc.compiled.fast(*enc.eager.arrays(part))  # type: ignore[misc]
        emb, log_p = enc.eager.run(part, with_mlm)
        enc.wait()
        return emb.float().cpu().numpy(), log_p.cpu() if log_p is not None else None

    if enc.device.type == "cuda" or isinstance(items, PackedInputs):
        return padded(items)
    per_call = call_positions(enc.config, "onnx" if compiled else "eager")
    return in_groups(padded, items, width_groups([len(x.input_ids) for x in items], per_call))


def _with_top(out: EncoderOutput, k: int) -> EncoderOutput:
    """``out`` with each row's ``k`` most probable entries of p_MLM (`EncoderOutput.mlm_top`, `top_entries`)."""
    assert out.mlm_log_probs is not None
    rows = out.mlm_log_probs.numpy()
    values = np.empty((len(rows), k), np.float32)
    ids = np.empty((len(rows), k), np.int64)
    for i, row in enumerate(rows):
        values[i], ids[i] = top_entries(row, k)
    return EncoderOutput(out.embeddings, out.mlm_log_probs, (values, ids))
