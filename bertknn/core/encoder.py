"""Masked contexts -> [MASK] embeddings at one hidden layer (and, for the service, the MLM distribution).

`MaskedLMEncoder.encode` is the single function that embeds both datastore contexts and queries; a mismatch
between the two would silently ruin the kNN search, so there is no second code path.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
from transformers import AutoModelForMaskedLM, AutoTokenizer, PreTrainedTokenizerBase

from bertknn.core.errors import ModelLoadError
from bertknn.core.hashing import weights_sha256
from bertknn.core.inputs import MaskedInput, PackedInputs
from bertknn.core.runtime import DeviceName, DtypeName, attention_without_cudnn, resolve_device, resolve_dtype
from bertknn.core.topk import top_entries, top_set_torch
from bertknn.core.truncate import TruncatedCore, mask_row_core, truncated_base
from bertknn.core.wordmodel import WordModel

logger = logging.getLogger(__name__)





@dataclass(frozen=True)
class EncoderOutput:
    embeddings: np.ndarray  # float32 [n, hidden]
    mlm_log_probs: torch.Tensor | None  # float32 [n, vocab], log-softmax at the [MASK] position
    # with ``encode(..., mlm_top=t)``: the t largest log p_MLM of each row, most probable first (ties: smaller id
    # first), as (values float32 [n, t], token ids int64 [n, t])
    mlm_top: tuple[np.ndarray, np.ndarray] | None = None


class ContextTokenizer:
    """Token ids -> model inputs around one mask; the shared path for datastore contexts and queries.

    The word logic (which tokens make a word, where a query's mask goes) is the tokenizer's `WordModel`."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_seq_len: int, vocab_size: int | None = None):
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.words = WordModel(tokenizer, vocab_size)
        self.mask_id = self.words.mask_id

    def masked_input(self, ids: Sequence[int], mask_pos: int) -> MaskedInput:
        """Special tokens around ``ids`` (which hold the mask at ``mask_pos``), windowed to ``max_seq_len``.

        Shared by the builder (a sentence with one target's tokens replaced by the mask id) and the service (a
        query whose [MASK] was placed the same way, `WordModel.query_ids`), so both embed identically.
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

    def query_input(self, text: str) -> MaskedInput:
        """A cloze question -> model input; `QueryError` says what is wrong with the text."""
        ids, pos = self.words.query_ids(text)
        return self.masked_input(ids, pos)


BackendName = Literal["auto", "eager", "onnx"]
MlmHeadPolicy = Literal["required", "ignored", "knn-only"]
# (input_ids, attention_mask, rows, mask_pos as host int64 arrays, `_arrays`) -> ([MASK] embeddings float32,
# log p_MLM at [MASK])
_FastForward = Callable[..., tuple[np.ndarray, torch.Tensor | None]]


class _Chain(torch.nn.Module):
    """A masked LM's head as its modules in order (DistilBERT's transform, activation, norm and projection)."""

    def __init__(self, *modules: torch.nn.Module):
        super().__init__()
        self.parts = torch.nn.ModuleList(modules)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            hidden = part(hidden)
        return hidden


class _TiedHead(torch.nn.Module):
    """DeBERTa-v2/v3's head (not legacy): it takes the word embeddings as a second argument."""

    def __init__(self, head: torch.nn.Module, embeddings: torch.nn.Module):
        super().__init__()
        self.head, self.embeddings = head, embeddings

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.head(hidden, self.embeddings))


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def mlm_head(model: Any) -> torch.nn.Module | None:
    """The module that turns a masked LM's last hidden state into vocabulary logits, for the families whose
    heads are known (BERT, RoBERTa/XLM-R, DistilBERT, ModernBERT, DeBERTa-v2/v3, ALBERT); otherwise a single
    head module when the model has exactly one; None when it cannot be told (the full forward's logits are used).
    """
    kind = str(getattr(model.config, "model_type", ""))
    if kind == "distilbert":
        return _Chain(model.vocab_transform, model.activation, model.vocab_layer_norm, model.vocab_projector)
    if kind == "modernbert":
        return _Chain(model.head, model.decoder)
    if kind == "deberta-v2" and hasattr(model, "lm_predictions"):
        return _TiedHead(model.lm_predictions, model.deberta.embeddings.word_embeddings)
    named = {"bert": "cls", "roberta": "lm_head", "xlm-roberta": "lm_head", "camembert": "lm_head",
             "deberta-v2": "cls", "albert": "predictions"}  # fmt: skip
    if kind in named and hasattr(model, named[kind]):
        return cast(torch.nn.Module, getattr(model, named[kind]))
    heads = [m for n, m in model.named_children() if n != model.base_model_prefix]
    return heads[0] if len(heads) == 1 else None


class _MaskCore(torch.nn.Module):
    """The forward as one module: the mask's row at ``layer`` and, with a head, log p_MLM there (that row only).

    The head reads the base model's last hidden state (after a final norm where the family has one, as
    ModernBERT). Eager `encode` runs it as it is; the ONNX backend exports it. Without a head (the builder's
    embeddings) no LM head runs at all.
    """

    def __init__(self, base: torch.nn.Module, head: torch.nn.Module | None, layer: int):
        super().__init__()
        self.base, self.head, self.layer = base, head, layer

    def forward(
        self, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        out = self.base(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        emb = out.hidden_states[self.layer][rows, pos]
        if self.head is None:
            return (emb,)
        return emb, torch.log_softmax(self.head(out.last_hidden_state[rows, pos]).float(), dim=-1)


def _check_model(tokenizer: PreTrainedTokenizerBase, config: Any, name: str, max_seq_len: int) -> None:
    """What every masked LM here needs: a mask token, a fast tokenizer, a sequence length it takes."""
    if tokenizer.mask_token_id is None:
        raise ModelLoadError(f"{name}: the tokenizer has no mask token; a masked LM is required")
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(f"{name}: a fast (Rust) tokenizer is required for word alignment")
    limit = int(getattr(config, "max_position_embeddings", 512))
    if max_seq_len > limit or max_seq_len < 8:
        raise ModelLoadError(f"max_seq_len={max_seq_len} must be between 8 and the model's limit {limit}")


def _stored_layer(layer: int | None, num_layers: int, name: str) -> int:
    """The hidden_states index kept: ``layer`` (negative counts from the end), by default the second-to-last."""
    index = num_layers - 1 if layer is None else (layer if layer >= 0 else num_layers + 1 + layer)
    if not 0 <= index <= num_layers:
        raise ModelLoadError(f"{name}: layer {layer} is out of range; the model has hidden_states[0..{num_layers}]")
    return index


def _from_pretrained(name_or_path: str) -> tuple[Any, Any, list[str]]:
    """The tokenizer and masked LM of a hub name or local directory (float32, safetensors preferred), and the
    head's weights the checkpoint lacks (sorted; none for a full masked LM)."""
    where = Path(name_or_path).expanduser()
    if (name_or_path.startswith((".", "/", "~")) or where.exists()) and not where.is_dir():
        raise ModelLoadError(f"the model directory {name_or_path} does not exist; pass a masked LM's directory "
                             "or its Hugging Face hub name")  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, use_fast=True)
            model, info = AutoModelForMaskedLM.from_pretrained(
                name_or_path, dtype=torch.float32, use_safetensors=None, output_loading_info=True
            )
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load the masked LM {name_or_path!r}: {_first_line(exc)}. Pass a local model directory "
            "(--model /path or BERTKNN_MODEL) where the Hugging Face hub is unreachable."
        ) from exc
    prefix = f"{model.base_model_prefix}."
    return tokenizer, model, sorted(k for k in info.get("missing_keys", ()) if not k.startswith(prefix))


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
        """``truncate``: the embeddings-only forward runs the model cut at ``layer`` (`_truncate`); False keeps
        the full forward (a benchmark's "before")."""
        _check_model(tokenizer, model.config, name, max_seq_len)
        self.name = name
        self.tokenizer = tokenizer
        config: Any = model.config
        self.config = config
        self.num_layers = int(config.num_hidden_layers)
        self.layer = _stored_layer(layer, self.num_layers, name)
        self.max_seq_len = max_seq_len
        self.weights_sha256 = weights_hash or weights_sha256(model)
        self.device = device or torch.device("cpu")
        self.dtype = dtype
        if self.device.type == "cuda":  # every batch shape new to cuDNN's attention costs a graph build
            attention_without_cudnn()
        model = model.to(self.device, dtype).eval()
        self.model = model
        self.base: torch.nn.Module = cast(torch.nn.Module, model.base_model)
        # the family's LM head, applied at the mask's row only; None: the full forward's logits (unknown family)
        self.head: torch.nn.Module | None = mlm_head(model)
        self.vocab_size = int(config.vocab_size)
        self.inputs = ContextTokenizer(tokenizer, max_seq_len, self.vocab_size)
        self.words = self.inputs.words
        self.hidden_size = int(config.hidden_size)
        # the forward, with p_MLM (the service) and embeddings only (the builder); the one place it is written
        self._cores: dict[bool, torch.nn.Module] = {
            with_mlm: _MaskCore(self.base, self.head if with_mlm else None, self.layer).eval()
            for with_mlm in (True, False)
        }
        # embeddings only (the builder): no layer above ``layer`` runs, where the cut model gives the same rows
        self.cut = "none"  # how the embeddings-only forward is cut: none, layers, or mask rows
        self.truncated = self._truncate() if truncate else False
        # the service's forward: the last layer at the mask rows only, where the layers are BERT's
        self.last_layer_at_mask = self._last_layer_at_mask() if truncate else False
        self.has_mlm = True  # False: no trained MLM head (`load`'s knn-only); p_MLM is then uniform
        self.backend: str = "eager"
        self._fast: _FastForward | None = None
        self._fast_with_mlm = True  # which encode() call the compiled forward serves
        self._fast_asked: tuple[str, bool] | None = None  # the set_backend call that built ``_fast``

    @torch.inference_mode()
    def _truncate(self) -> bool:
        """Swap the embeddings-only forward for a cheaper one with the same rows (`bertknn.core.truncate`): the
        stored layer at the [MASK] rows only (BERT-shaped layers), else the model cut at ``layer``; each only
        after its rows matched the full forward's on padded inputs. False (the full forward stays): no known
        layer list, nothing to cut, or rows that differ. `cut` says which one runs."""
        base = truncated_base(self.base, self.num_layers, self.layer)
        mask_rows = mask_row_core(self.base, self.num_layers, self.layer)
        candidates: list[torch.nn.Module] = [mask_rows] if mask_rows is not None else []
        if base is not None:
            candidates += [TruncatedCore(base, self.layer, True), TruncatedCore(base, self.layer, False)]
        for core in candidates:
            if self._same_rows(core, self._cores[False]):
                self._cores[False] = core
                self.cut = "mask rows" if core is mask_rows else "layers"
                return True
        if candidates:
            logger.info("%s: the model cut at layer %d differs from the full forward; it runs in full", self.name, self.layer)
        return False

    @torch.inference_mode()
    def _last_layer_at_mask(self) -> bool:
        """Swap the service's forward (embeddings and log p_MLM) for one whose last layer runs at the [MASK] rows
        only (BERT-shaped layers; `MaskRowCore`), once both its outputs matched the full forward's."""
        core = mask_row_core(self.base, self.num_layers, self.layer, self.head) if self.head is not None else None
        if core is None or not self._same_rows(core, self._cores[True]):
            return False
        self._cores[True] = core
        return True

    def _same_rows(self, core: torch.nn.Module, reference: torch.nn.Module) -> bool:
        """Whether ``core`` runs and gives ``reference``'s outputs on padded inputs (float32: within 1e-4 of their
        scale)."""
        mask = self.tokenizer.mask_token
        check = [self.query_input(t) for t in (f"{mask} x y .", f"a b c d e f {mask} g h i j k l .")]
        tensors = self._tensors(check)
        tol = 1e-4 if self.dtype == torch.float32 else 1e-2
        try:
            got = core.eval()(*tensors)
        except Exception as exc:  # noqa: BLE001 - a family whose forward this cut does not fit: keep the other
            logger.debug("%s: %s does not run (%s)", self.name, type(core).__name__, exc)
            return False
        for g, w in zip(got, reference(*tensors), strict=True):
            g, w = g.float(), w.float()
            if g.shape != w.shape or not float((g - w).abs().max()) <= tol * max(1.0, float(w.abs().max())):
                return False
        return True

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
        tokenizer, model, missing = _from_pretrained(name_or_path)
        if missing and mlm_head == "required":
            raise ModelLoadError(
                f"{name_or_path}: the checkpoint has no MLM head ({len(missing)} head weights missing, e.g. "
                f"{missing[0]}); p_MLM would be random. Use a checkpoint with its MLM head, or serve it kNN-only "
                "(--model-knn-only / BERTKNN_MODEL__KNN_ONLY=true)"
            )
        encoder = cls(
            model,
            tokenizer,
            name=name_or_path,
            layer=layer,
            device=dev,
            dtype=resolve_dtype(dtype, dev),
            max_seq_len=max_seq_len,
            truncate=truncate,
        )
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

        The same modules either way (`_MaskCore`: the [MASK] row at ``layer``, the head on that row only).
        ``onnx`` runs the whole forward outside Python with fused CPU kernels (docs/decisions/onnx-runtime-on-cpu.md).
        ``auto``: onnx on the CPU, eager on a GPU. A backend is used only after its outputs
        matched the eager forward on padded batches of other shapes than the one it was built from; one that
        cannot be built, or differs, falls back (logged). Returns the backend in use.

        Asking again for the compiled backend already in use (same ``backend`` and ``with_mlm``) keeps it: an
        ONNX export of bert-base takes about 5 s, which a builder handed a ready encoder should not pay twice.
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

    def _build_onnx(self) -> _FastForward:
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise RuntimeError("the onnx backend runs float32 on the CPU")
        import onnxruntime as ort

        core, example = self._core_and_example()
        names = ["input_ids", "attention_mask", "rows", "mask_pos"]
        with tempfile.TemporaryDirectory(prefix="bertknn-onnx-") as tmp, warnings.catch_warnings(), torch.inference_mode():
            warnings.simplefilter("ignore")
            path = Path(tmp) / "mask_core.onnx"
            torch.onnx.export(
                core, example, path, input_names=names,
                output_names=["embedding", "log_probs"] if getattr(core, "head", None) is not None else ["embedding"],
                # rows/mask_pos: the positions read, which may be more than the sequences (`log_probs_at`)
                dynamic_axes={"input_ids": {0: "batch", 1: "width"}, "attention_mask": {0: "batch", 1: "width"},
                              "rows": {0: "reads"}, "mask_pos": {0: "reads"}},
                dynamo=False, opset_version=17,
            )  # fmt: skip
            model_bytes = path.read_bytes()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = torch.get_num_threads()  # the thread setting the process chose for torch
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        session = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])

        def run(*arrays: np.ndarray) -> tuple[np.ndarray, torch.Tensor | None]:
            out = session.run(None, dict(zip(names, arrays, strict=True)))
            return out[0], torch.from_numpy(out[1]) if len(out) > 1 else None

        return run

    @torch.inference_mode()
    def _check_against_eager(self, fast: _FastForward, name: str) -> None:
        mask = self.tokenizer.mask_token
        texts = (f"{mask} x y z w .", f"p q {mask} .", f"one two three four five {mask} six seven eight nine ten .")
        check = [self.query_input(t) for t in texts]
        core, _ = self._core_and_example()
        tol = 1e-3 if self.dtype == torch.float32 else 5e-2
        for batch in (check[:1], check):
            want = core(*self._tensors(batch))
            got_emb, got_lp = fast(*self._arrays(batch))
            err = float(np.abs(want[0].float().cpu().numpy() - got_emb).max())
            if len(want) > 1:
                assert got_lp is not None
                err = max(err, float((want[1].cpu() - got_lp).abs().max()))
            if not err <= tol:
                raise RuntimeError(f"{name} differs from the eager forward by {err:.3g} (tolerance {tol})")

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
        """Padded ids, attention mask, batch rows and [MASK] positions: host int64 arrays.

        numpy, not torch: on the service's path (batches of one or a few) building them as tensors cost 7x more.
        """
        if isinstance(items, PackedInputs):  # the builder's batches: padded from the packed arrays at once
            return items.padded(self.tokenizer.pad_token_id or 0)
        n = len(items)
        width = max(len(x.input_ids) for x in items)
        ids = np.full((n, width), self.tokenizer.pad_token_id or 0, dtype=np.int64)
        attn = np.zeros((n, width), dtype=np.int64)
        for i, x in enumerate(items):
            ids[i, : len(x.input_ids)] = x.input_ids
            attn[i, : len(x.input_ids)] = 1
        return ids, attn, np.arange(n, dtype=np.int64), np.fromiter((x.mask_pos for x in items), np.int64, n)

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
