"""A masked LM's head found per family, and the forward as one module: the [MASK] row at the stored layer and
log p_MLM at that row only (`MaskCore`), which the eager forward runs and the ONNX backend exports."""

from __future__ import annotations

from typing import Any, cast

import torch


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


def additive_mask(attn: torch.Tensor, like: torch.nn.Module) -> torch.Tensor:
    """A 2D padding mask as the 4D additive mask attention adds ([rows, 1, 1, width]: 0 where kept, the model's
    dtype's minimum at padding, as the stock attention builds it). A model given it uses it as it is, with no look
    at its values on the host, which a CUDA graph cannot capture (`bertknn.core.graphs`)."""
    dtype = next(like.parameters()).dtype
    return (1.0 - attn[:, None, None, :].to(dtype)) * torch.finfo(dtype).min


class MaskCore(torch.nn.Module):
    """The forward as one module: the mask's row at ``layer`` and, with a head, log p_MLM there (that row only).

    The head reads the base model's last hidden state (after a final norm where the family has one, as
    ModernBERT). Eager `encode` runs it as it is; the ONNX backend exports it. Without a head (the builder's
    embeddings) no LM head runs at all.
    """

    def __init__(self, base: torch.nn.Module, head: torch.nn.Module | None, layer: int):
        super().__init__()
        self.base, self.head, self.layer = base, head, layer
        self.mask_4d = False  # the base model given `additive_mask` instead of the 2D mask (`bertknn.core.graphs`)

    def forward(
        self, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        mask = additive_mask(attn, self.base) if self.mask_4d else attn
        out = self.base(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        emb = out.hidden_states[self.layer][rows, pos]
        if self.head is None:
            return (emb,)
        return emb, torch.log_softmax(self.head(out.last_hidden_state[rows, pos]).float(), dim=-1)
