"""What the service asks of a masked LM: the `MaskedLMEncoder` that runs it here, or the model process's proxy
(`bertknn.service.model_client.RemoteEncoder`) that has another process run it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from bertknn.core.context_tokenizer import ContextTokenizer
from bertknn.core.encoder import EncoderOutput
from bertknn.core.inputs import MaskedInput
from bertknn.core.topk import top_set
from bertknn.core.wordmodel import WordModel


class QueryModel(Protocol):
    """A masked LM as the service's pipeline uses it: inputs made here, forward passes wherever the model runs."""

    name: str
    tokenizer: Any  # a fast Hugging Face tokenizer
    inputs: ContextTokenizer
    words: WordModel
    layer: int
    num_layers: int
    weights_sha256: str
    vocab_size: int
    hidden_size: int
    max_seq_len: int
    device: torch.device
    has_mlm: bool

    @property
    def numerics(self) -> str: ...

    @property
    def backend(self) -> str: ...

    @property
    def heads_on_device(self) -> bool: ...

    def query_input(self, text: str) -> MaskedInput: ...

    def masked_input(self, ids: Sequence[int], mask_pos: int) -> MaskedInput: ...

    def encode(self, items: Sequence[MaskedInput], *, with_mlm: bool = False) -> EncoderOutput: ...

    def encode_heads(self, items: Sequence[MaskedInput], n_top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...

    def log_probs_at(self, sequences: Sequence[Sequence[int]], reads: Sequence[tuple[int, int]]) -> torch.Tensor: ...


Heads = tuple[np.ndarray, np.ndarray, np.ndarray]  # embeddings [n, hidden], top values [n, t], their ids [n, t]


def heads(model: QueryModel, inputs: Sequence[MaskedInput], n_top: int) -> Heads:
    """Each input's [MASK] embedding and the ``n_top`` entries of p_MLM the service keeps (`top_set`): picked
    where the forward ran when the model does that (`heads_on_device`), else here from the whole distribution."""
    if model.heads_on_device:
        return model.encode_heads(inputs, n_top)
    out = model.encode(inputs, with_mlm=True)
    assert out.mlm_log_probs is not None
    rows = out.mlm_log_probs.numpy()
    n = min(n_top, rows.shape[1])
    values, ids = np.empty((len(rows), n), np.float32), np.empty((len(rows), n), np.int64)
    for j, row in enumerate(rows):
        values[j], ids[j] = top_set(row, n)
    return out.embeddings, values, ids
