"""The encoder cut at the layer the datastore stores: the builder's forward runs no layer above it.

A datastore keeps ``hidden_states[layer]`` (bert-base-uncased: 11 of 12); the layers above it and the LM head are
work the builder throws away. `truncated_base` returns the base model with its layer list cut after ``layer``
(the same parameter tensors: no copy of the weights), for the families whose layers sit in one ``ModuleList``
(BERT, RoBERTa, XLM-R, DeBERTa-v2/v3, ELECTRA: ``encoder.layer``; DistilBERT: ``transformer.layer``; ModernBERT:
``layers``). `TruncatedCore` reads the cut model's output where it equals the full model's ``hidden_states[layer]``;
`MaskedLMEncoder` uses it only after checking exactly that on padded inputs, and keeps the full forward otherwise.
"""

from __future__ import annotations

import copy

import torch

LAYER_LISTS = ("encoder.layer", "transformer.layer", "layers", "encoder.layers")


def truncated_base(base: torch.nn.Module, num_layers: int, layer: int) -> torch.nn.Module | None:
    """``base`` with only its first ``layer`` layers (shared parameters), or None: no known layer list, or
    nothing to cut."""
    if not 0 < layer < num_layers:
        return None
    for path in LAYER_LISTS:
        parent_path, _, attr = path.rpartition(".")
        try:
            parent = base.get_submodule(parent_path) if parent_path else base
        except AttributeError:
            continue
        layers = parent._modules.get(attr)
        if not isinstance(layers, torch.nn.ModuleList) or len(layers) != num_layers:
            continue
        cut = torch.nn.ModuleList(list(layers)[:layer])
        new_base = _shallow(base)
        if parent_path:
            new_parent = _shallow(parent)
            new_parent._modules[attr] = cut
            new_base._modules[parent_path] = new_parent
        else:
            new_base._modules[attr] = cut
        return new_base
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
