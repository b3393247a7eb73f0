"""Token ids -> model inputs around one mask: the one path datastore contexts and queries take to the model."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from bertknn.core.inputs import MaskedInput
from bertknn.core.wordmodel import WordModel


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
        query whose [MASK] was placed the same way, `WordModel.query_ids`), so both embed identically. The input's
        ``cut`` counts the tokens left out.
        """
        budget = self.max_seq_len - 2
        cut = max(0, len(ids) - budget)
        if cut:
            start = min(max(0, mask_pos - budget // 2), len(ids) - budget)
            ids = ids[start : start + budget]
            mask_pos -= start
        cls_id, sep_id = self.tokenizer.cls_token_id, self.tokenizer.sep_token_id
        if cls_id is None or sep_id is None:
            full = self.tokenizer.build_inputs_with_special_tokens(list(ids))
            return MaskedInput(tuple(full), full.index(self.mask_id), cut)
        return MaskedInput((cls_id, *ids, sep_id), mask_pos + 1, cut)

    def query_input(self, text: str) -> MaskedInput:
        """A cloze question -> model input; `QueryError` says what is wrong with the text."""
        ids, pos = self.words.query_ids(text)
        return self.masked_input(ids, pos)
