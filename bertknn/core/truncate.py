"""The encoder cut at the layer the datastore stores: the builder's forward runs no layer above it.

A datastore keeps ``hidden_states[layer]`` (bert-base-uncased: 11 of 12); the layers above it and the LM head are
work the builder throws away. `truncated_base` returns the base model with its layer list cut after ``layer``
(the same parameter tensors: no copy of the weights), for the families whose layers sit in one ``ModuleList``
(BERT, RoBERTa, XLM-R, DeBERTa-v2/v3, ELECTRA: ``encoder.layer``; DistilBERT: ``transformer.layer``; ModernBERT:
``layers``). `TruncatedCore` reads the cut model's output where it equals the full model's ``hidden_states[layer]``;
`MaskedLMEncoder` uses it only after checking exactly that on padded inputs, and keeps the full forward otherwise.

`MaskRowCore` goes one step further for the families whose layers are BERT's (BERT, RoBERTa, XLM-R, ELECTRA):
the stored layer itself runs at the [MASK] rows only. Its keys and values still come from every position of the
layer below, but its query, attention output and feed-forward block are one row per context instead of one per
token (docs/decisions/mask-row-layer.md).
"""

from __future__ import annotations

import copy
import logging
from typing import Any, cast

import torch

from bertknn.core.heads import additive_mask

logger = logging.getLogger(__name__)

LAYER_LISTS = ("encoder.layer", "transformer.layer", "layers", "encoder.layers")


def truncated_base(base: torch.nn.Module, num_layers: int, layer: int) -> torch.nn.Module | None:
    """``base`` with only its first ``layer`` layers (shared parameters), or None: no known layer list, or
    nothing to cut."""
    if not 0 < layer < num_layers:
        return None
    return _cut(base, num_layers, layer)


def _cut(base: torch.nn.Module, num_layers: int, keep: int) -> torch.nn.Module | None:
    """``base`` with its first ``keep`` layers (0: the embeddings alone), or None: no known layer list."""
    found = _layer_list(base, num_layers)
    if found is None:
        return None
    parent_path, parent, attr, layers = found
    cut = torch.nn.ModuleList(list(layers)[:keep])
    new_base = _shallow(base)
    if parent_path:
        new_parent = _shallow(parent)
        new_parent._modules[attr] = cut
        new_base._modules[parent_path] = new_parent
    else:
        new_base._modules[attr] = cut
    return new_base


def _layer_list(
    base: torch.nn.Module, num_layers: int
) -> tuple[str, torch.nn.Module, str, torch.nn.ModuleList] | None:
    """The model's layer list (its parent's path, the parent, the attribute, the list), or None: none known."""
    for path in LAYER_LISTS:
        parent_path, _, attr = path.rpartition(".")
        try:
            parent = base.get_submodule(parent_path) if parent_path else base
        except AttributeError:
            continue
        layers = parent._modules.get(attr)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) == num_layers:
            return parent_path, parent, attr, layers
    return None


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A copy whose submodule table is its own (replacing an entry leaves ``module`` untouched)."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    return twin


class TruncatedCore(torch.nn.Module):
    """The builder's forward on the cut model: the [MASK] rows of its last hidden state (``from_last``), or of
    its ``hidden_states[layer]`` where the family normalises its last one."""

    def __init__(self, base: torch.nn.Module, layer: int, from_last: bool):
        super().__init__()
        self.base, self.layer, self.from_last = base, layer, from_last

    def forward(
        self, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        if self.from_last:
            return (self.base(input_ids=ids, attention_mask=attn).last_hidden_state[rows, pos],)
        return (self.base(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states[self.layer][rows, pos],)


def mask_row_core(
    base: torch.nn.Module, num_layers: int, layer: int, head: torch.nn.Module | None = None
) -> MaskRowCore | None:
    """The forward with a layer run at the [MASK] rows only, for BERT-shaped layers (attention.self's query, key
    and value, attention.output, intermediate, output); None: another layout, or nothing to gain.

    Without ``head`` (the builder): layer ``layer`` itself, its rows the result. With ``head`` (the service): the
    model's last layer, under the LM head; the rows at ``layer`` come from the layers below it. The caller checks
    the rows against the full forward before using it."""
    found = _layer_list(base, num_layers)
    top_index = layer if head is None else num_layers
    if found is None or not 0 < top_index <= num_layers or (head is not None and layer >= num_layers):
        return None
    top = found[3][top_index - 1]
    attention = getattr(top, "attention", None)
    parts = (getattr(attention, "self", None), getattr(attention, "output", None),
             getattr(top, "intermediate", None), getattr(top, "output", None))  # fmt: skip
    if any(p is None for p in parts) or not all(
        isinstance(getattr(parts[0], name, None), torch.nn.Linear) for name in ("query", "key", "value")
    ):
        return None
    below = _cut(base, num_layers, top_index - 1)
    assert below is not None
    return MaskRowCore(below, top_index - 1, top, head, layer)


class MaskRowCore(torch.nn.Module):
    """A forward whose top layer runs at the [MASK] rows only: the model cut below that layer runs in full, then
    the layer attends from each read position (``rows``, ``pos``) over its sequence's unpadded positions, and its
    attention output and feed-forward block run on those rows alone. The same arithmetic as the layer applied to
    every position and read at the mask (an unmasked softmax over the key positions, the padding at the dtype's
    minimum, as the stock attention does).

    Without a head (the builder) it returns the top layer's rows; with one (the service) the rows at ``layer``
    (below the top) and log p_MLM from the top layer's rows, as `MaskCore` does."""

    def __init__(self, below: torch.nn.Module, below_layers: int, top: Any, head: torch.nn.Module | None, layer: int):
        super().__init__()
        self.below, self.top, self.head, self.layer = below, top, head, layer
        self.below_layers = below_layers  # how many layers ``below`` runs
        attention = top.attention.self
        self.heads, self.head_size = int(attention.num_attention_heads), int(attention.attention_head_size)
        self.mask_4d = False  # ``below`` given `additive_mask` instead of the 2D mask (`bertknn.core.graphs`)

    def forward(
        self, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        mask = additive_mask(attn, self.below) if self.mask_4d else attn
        if self.head is None:
            # hidden_states[layer - 1] (the embeddings' output when layer is 1: no layer below runs)
            hidden = self.below(input_ids=ids, attention_mask=mask).last_hidden_state
            return (self._top_at(hidden, attn, rows, pos),)
        # the stored layer is the last one below the top (the default: no hidden states kept) or a lower one
        below_top = self.layer == self.below_layers
        out = self.below(input_ids=ids, attention_mask=mask, output_hidden_states=not below_top)
        stored = out.last_hidden_state if below_top else out.hidden_states[self.layer]
        last = self._top_at(out.last_hidden_state, attn, rows, pos)
        return stored[rows, pos], torch.log_softmax(self.head(last).float(), dim=-1)

    def _top_at(self, hidden: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        top: Any = self.top  # a BERT-shaped layer (`mask_row_core` checked its parts)
        attention = top.attention.self
        reads, width = rows.shape[0], hidden.shape[1]
        at_mask = hidden[rows, pos]  # [reads, hidden]
        query = attention.query(at_mask).view(reads, self.heads, 1, self.head_size)
        key = attention.key(hidden)[rows].view(reads, width, self.heads, self.head_size).transpose(1, 2)
        value = attention.value(hidden)[rows].view(reads, width, self.heads, self.head_size).transpose(1, 2)
        scores = torch.matmul(query, key.transpose(-1, -2)) * (self.head_size**-0.5)  # [reads, heads, 1, width]
        keep = attn[rows].bool()[:, None, None, :]
        scores = torch.where(keep, scores, torch.finfo(scores.dtype).min)
        context = torch.matmul(torch.softmax(scores, dim=-1), value).reshape(reads, self.heads * self.head_size)
        attended = top.attention.output(context, at_mask)
        return cast(torch.Tensor, top.output(top.intermediate(attended), attended))


def same_rows(core: torch.nn.Module, reference: torch.nn.Module, tensors: tuple[torch.Tensor, ...], tol: float) -> bool:
    """Whether ``core`` runs and gives ``reference``'s outputs on ``tensors`` (padded inputs), within ``tol`` of
    their scale."""
    try:
        got = core.eval()(*tensors)
    except Exception as exc:  # noqa: BLE001 - a family whose forward this cut does not fit: keep the other
        logger.debug("%s does not run (%s)", type(core).__name__, exc)
        return False
    return outputs_close(got, reference(*tensors), tol)


def outputs_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], tol: float) -> bool:
    """Whether each output has the reference's shape and lies within ``tol`` of its scale."""
    for g, w in zip(got, want, strict=True):
        g, w = g.detach().float(), w.detach().float()  # (outputs of a forward made outside inference mode)
        if g.shape != w.shape or not float((g - w).abs().max()) <= tol * max(1.0, float(w.abs().max())):
            return False
    return True


@torch.inference_mode()
def embedding_core(
    base: torch.nn.Module, num_layers: int, layer: int, reference: torch.nn.Module, tensors: tuple[torch.Tensor, ...],
    tol: float, name: str = "model",
) -> tuple[torch.nn.Module, str] | None:
    """A cheaper embeddings-only forward with ``reference``'s rows, and how it is cut ("mask rows": the stored
    layer at the [MASK] rows, BERT-shaped layers; "layers": the model cut at ``layer``); None: no known layer list,
    nothing to cut, or rows that differ."""
    base_cut = truncated_base(base, num_layers, layer)
    mask_rows = mask_row_core(base, num_layers, layer)
    candidates: list[tuple[torch.nn.Module, str]] = [(mask_rows, "mask rows")] if mask_rows is not None else []
    if base_cut is not None:
        candidates += [(TruncatedCore(base_cut, layer, True), "layers"), (TruncatedCore(base_cut, layer, False), "layers")]
    for core, cut in candidates:
        if same_rows(core, reference, tensors, tol):
            return core, cut
    if candidates:
        logger.info("%s: the model cut at layer %d differs from the full forward; it runs in full", name, layer)
    return None


@torch.inference_mode()
def service_core(
    base: torch.nn.Module, num_layers: int, layer: int, head: torch.nn.Module | None, reference: torch.nn.Module,
    tensors: tuple[torch.Tensor, ...], tol: float,
) -> torch.nn.Module | None:
    """The service's forward (embeddings and log p_MLM) with its last layer at the [MASK] rows only (BERT-shaped
    layers; `MaskRowCore`), once both outputs matched ``reference``'s; None otherwise."""
    core = mask_row_core(base, num_layers, layer, head) if head is not None else None
    return core if core is not None and same_rows(core, reference, tensors, tol) else None
