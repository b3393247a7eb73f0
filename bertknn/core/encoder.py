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

from bertknn.core.context_tokenizer import ContextTokenizer
from bertknn.core.hashing import weights_sha256
from bertknn.core.heads import MaskCore, mlm_head
from bertknn.core.inputs import MaskedInput, padded_arrays
from bertknn.core.model_files import (
    MlmHeadPolicy,
    check_model,
    from_pretrained,
    refuse_headless,
    stored_layer,
)
from bertknn.core.onnx_forward import FastForward, build_onnx, check_fast
from bertknn.core.runtime import DeviceName, DtypeName, attention_without_cudnn, resolve_device, resolve_dtype
from bertknn.core.topk import top_entries, top_set_torch
from bertknn.core.truncate import embedding_core, service_core

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
        """``truncate``: the forwards run cut where the cut gives the same rows (`_cut_forwards`); False keeps the
        full forward (a reference to compare against)."""
        check_model(tokenizer, model.config, name, max_seq_len)
        self.name, self.tokenizer, self.max_seq_len = name, tokenizer, max_seq_len
        config: Any = model.config
        self.config = config
        self.num_layers = int(config.num_hidden_layers)
        self.layer = stored_layer(layer, self.num_layers, name)
        self.weights_sha256 = weights_hash or weights_sha256(model)
        self.device, self.dtype = device or torch.device("cpu"), dtype
        if self.device.type == "cuda":  # every batch shape new to cuDNN's attention costs a graph build
            attention_without_cudnn()
        self.model = model.to(self.device, dtype).eval()
        self.base: torch.nn.Module = cast(torch.nn.Module, self.model.base_model)
        # the family's LM head, applied at the mask's row only; None: the full forward's logits (unknown family)
        self.head: torch.nn.Module | None = mlm_head(self.model)
        self.vocab_size, self.hidden_size = int(config.vocab_size), int(config.hidden_size)
        self.inputs = ContextTokenizer(tokenizer, max_seq_len, self.vocab_size)
        self.words = self.inputs.words
        # the forward, with p_MLM (the service) and embeddings only (the builder); the one place it is written
        self._cores: dict[bool, torch.nn.Module] = {
            with_mlm: MaskCore(self.base, self.head if with_mlm else None, self.layer).eval() for with_mlm in (True, False)
        }
        self.cut = "none"  # how the embeddings-only forward is cut: none, layers, or mask rows
        self.truncated = self.last_layer_at_mask = False
        if truncate:
            self._cut_forwards()
        self.has_mlm = True  # False: no trained MLM head (`load`'s knn-only); p_MLM is then uniform
        self.backend: str = "eager"
        self._fast: FastForward | None = None
        self._fast_with_mlm = True  # which encode() call the compiled forward serves
        self._fast_asked: tuple[str, bool] | None = None  # the set_backend call that built ``_fast``

    def _cut_forwards(self) -> None:
        """Swap each forward for a cheaper one with the same outputs on padded inputs (`bertknn.core.truncate`):
        the builder's runs no layer above the stored one, the service's runs its last layer at the [MASK] rows."""
        mask = self.tokenizer.mask_token
        check = self._tensors([self.query_input(t) for t in (f"{mask} x y .", f"a b c d e f {mask} g h i j k l .")])
        tol = 1e-4 if self.dtype == torch.float32 else 1e-2
        found = embedding_core(self.base, self.num_layers, self.layer, self._cores[False], check, tol, self.name)
        if found is not None:
            self._cores[False], self.cut = found
            self.truncated = True
        core = service_core(self.base, self.num_layers, self.layer, self.head, self._cores[True], check, tol)
        if core is not None:
            self._cores[True], self.last_layer_at_mask = core, True

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
    def numerics(self) -> str:
        """What the forward's numbers depend on besides the weights: dtype and backend (``float32/onnx``). Part of
        every cache key, so that replicas of other numerics sharing one cache never serve each other's values."""
        return f"{str(self.dtype).removeprefix('torch.')}/{self.backend}"

    # ---- backend ------------------------------------------------------------------------------------------

    def set_backend(self, backend: BackendName | str, *, with_mlm: bool = True) -> str:
        """How ``encode(..., with_mlm=...)`` runs the model: eagerly, or in ONNX Runtime.

        ``with_mlm``: the call the compiled forward serves, with p_MLM (the service) or embeddings only (the
        builder); the other call stays eager.

        The same modules either way (`MaskCore`: the [MASK] row at ``layer``, the head on that row only).
        ``onnx`` runs the whole forward outside Python with fused CPU kernels (docs/decisions/onnx-runtime-on-cpu.md).
        ``auto``: onnx on the CPU, eager on a GPU. A backend is used only after its outputs
        matched the eager forward on padded batches of other shapes than the one it was built from; one that
        cannot be built, or differs, falls back (logged). Returns the backend in use.

        Asking again for the compiled backend already in use (same ``backend`` and ``with_mlm``) keeps it: an
        ONNX export of a base-sized model takes seconds, which a builder handed a ready encoder should not pay twice.
        """
        if backend not in ("auto", "eager", "onnx"):
            raise ValueError(f"backend must be auto, eager or onnx, not {backend!r}")
        if self._fast is not None and self._fast_asked == (backend, with_mlm):
            return self.backend
        if backend == "auto":
            order = ["onnx"] if self.device.type == "cpu" else []
        else:
            order = [] if backend == "eager" else [backend]
        self._fast, self.backend, self._fast_with_mlm, self._fast_asked = None, "eager", with_mlm, None
        if order and with_mlm and self.head is None:
            logger.warning("%s: no single LM head module; the eager backend stays in use", self.name)
            return self.backend
        for want in order:
            try:
                fast = self._build_onnx()
                self._check_against_eager(fast, want)
            except Exception as exc:  # noqa: BLE001 - any failure to build or match falls back
                logger.warning("%s: %s backend not used (%s)", self.name, want, exc)
                continue
            self._fast, self.backend, self._fast_asked = fast, want, (backend, with_mlm)
            break
        return self.backend

    def _core_and_example(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        mask = self.tokenizer.mask_token
        # padded (two lengths), so that the attention mask is part of the traced or exported graph
        example = [self.query_input(f"the {mask} ."), self.query_input(f"a b c d e f g h {mask} i j .")]
        return self._cores[self._fast_with_mlm], self._tensors(example)

    def _build_onnx(self) -> FastForward:
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise RuntimeError("the onnx backend runs float32 on the CPU")
        return build_onnx(*self._core_and_example())

    def _check_against_eager(self, fast: FastForward, name: str) -> None:
        mask = self.tokenizer.mask_token
        texts = (f"{mask} x y z w .", f"p q {mask} .", f"one two three four five {mask} six seven eight nine ten .")
        check = [self.query_input(t) for t in texts]
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        batches = [(self._tensors(b), self._arrays(b)) for b in (check[:1], check)]
        check_fast(fast, self._core_and_example()[0], batches, tol, name)

    @torch.inference_mode()
    def log_probs_at(self, sequences: Sequence[Sequence[int]], reads: Sequence[tuple[int, int]]) -> torch.Tensor:
        """log p_MLM at several positions of each sequence from one forward pass: row i of the result is read at
        ``reads[i]`` = (sequence index, position). (Several masks of one sequence, as the one-pass fill reads
        them, cost one row of the batch, not one each.)"""
        if not reads:
            return torch.zeros((0, self.vocab_size))
        if not self.has_mlm:
            return torch.full((len(reads), self.vocab_size), -float(np.log(self.vocab_size)))
        ids, attn, _, _ = self._arrays([MaskedInput(tuple(x), 0) for x in sequences])
        rows = np.fromiter((r for r, _ in reads), np.int64, len(reads))
        pos = np.fromiter((p for _, p in reads), np.int64, len(reads))
        if self._fast is not None and self._fast_with_mlm:
            log_p = self._fast(ids, attn, rows, pos)[1]
        elif self.head is None:
            t_ids, t_attn, t_rows, t_pos = self._to_device([ids, attn, rows, pos])
            logits = self.model(input_ids=t_ids, attention_mask=t_attn).logits[t_rows, t_pos]
            log_p = torch.log_softmax(logits.float(), dim=-1).cpu()
        else:
            log_p = self._cores[True](*self._to_device([ids, attn, rows, pos]))[1].cpu()
        assert log_p is not None
        return self.words.vocab.merge_log_probs(log_p) if self.words.vocab.merge_layers else log_p

    def _arrays(self, items: Sequence[MaskedInput]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return padded_arrays(items, self.tokenizer.pad_token_id or 0)

    def _to_device(self, arrays: Sequence[np.ndarray]) -> tuple[torch.Tensor, ...]:
        host = [torch.from_numpy(a) for a in arrays]
        if self.device.type != "cuda":
            return tuple(host)
        # pinned host memory makes the copies of the (large) ids and mask asynchronous
        return tuple((t.pin_memory() if t.dim() == 2 else t).to(self.device, non_blocking=True) for t in host)

    def _tensors(self, items: Sequence[MaskedInput]) -> tuple[torch.Tensor, ...]:
        """`_arrays` as tensors on the model's device."""
        return self._to_device(self._arrays(items))

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
        k = min(mlm_top, self.vocab_size)
        values = np.empty((len(items), k), np.float32)
        ids = np.empty((len(items), k), np.int64)
        for i, row in enumerate(out.mlm_log_probs.numpy()):
            values[i], ids[i] = top_entries(row, k)
        return EncoderOutput(out.embeddings, out.mlm_log_probs, (values, ids))

    @torch.inference_mode()
    def encode_async(self, items: Sequence[MaskedInput]) -> Callable[[], np.ndarray]:
        """Start embedding a batch ([MASK] embeddings only, as the builder stores them); the returned call gives
        them, float16 [n, hidden]. With the eager forward on a GPU it returns once the forward and a copy into
        pinned host memory are queued, so the caller can prepare and start the next batch while this one runs
        (the call then waits for the copy alone); elsewhere the batch is embedded before it returns."""
        if self.device.type != "cuda" or self._fast is not None or not items:
            emb = self.encode(items).embeddings.astype(np.float16)
            return lambda: emb
        on_device, _ = self._eager_forward(items, with_mlm=False)
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
        return self.device.type == "cuda" and self._fast is None and self.has_mlm

    @torch.inference_mode()
    def encode_heads(self, items: Sequence[MaskedInput], n_top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """[MASK] embeddings and each row's ``n_top`` largest log p_MLM, picked where the eager forward ran
        (`top_set_torch`: the same entries as `top_set` on the host), so that on a GPU the whole distribution never
        leaves it: (embeddings [n, hidden], values [n, n_top], ids [n, n_top] ascending per row). The service takes
        this path where `heads_on_device` says so."""
        emb, log_p = self._eager_forward(items, with_mlm=True)
        assert log_p is not None
        if self.words.vocab.merge_layers:
            log_p = self.words.vocab.merge_log_probs(log_p)
        values, ids = top_set_torch(log_p, n_top)
        return emb.float().cpu().numpy(), values.float().cpu().numpy(), ids.cpu().numpy()

    def _forward(self, items: Sequence[MaskedInput], with_mlm: bool) -> EncoderOutput:
        if not items:
            return EncoderOutput(
                np.zeros((0, self.hidden_size), np.float32), torch.zeros((0, self.vocab_size)) if with_mlm else None
            )
        if self._fast is not None and with_mlm == self._fast_with_mlm:
            return EncoderOutput(*self._fast(*self._arrays(items)))
        emb, log_p = self._eager_forward(items, with_mlm)
        return EncoderOutput(emb.float().cpu().numpy(), log_p.cpu() if log_p is not None else None)

    def _eager_forward(self, items: Sequence[MaskedInput], with_mlm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The eager forward's [MASK] embeddings and log p_MLM, left on the model's device."""
        ids, attn, rows, mask_pos = self._tensors(items)
        if with_mlm and self.head is None:  # no single head module: the full model's logits, at the mask rows
            out = self.model(input_ids=ids, attention_mask=attn, output_hidden_states=True)
            emb, logits = out.hidden_states[self.layer][rows, mask_pos], out.logits[rows, mask_pos]
            return emb, torch.log_softmax(logits.float(), dim=-1)
        out = self._cores[with_mlm](ids, attn, rows, mask_pos)
        return out[0], out[1] if with_mlm else None
