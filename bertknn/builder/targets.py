"""Which token occurrences become datastore entries, and their masked contexts (tokenised once)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

from transformers import PreTrainedTokenizerBase

from bertknn.core.text import is_punctuation
from bertknn.core.words import MAX_WORD_PIECES

# single-piece: the paper's rule, a whole word that is exactly one wordpiece. whole-word: every whole word of at
# most MAX_WORD_PIECES wordpieces; all its pieces are replaced by ONE [MASK] (as in a query, which has one).
TargetMode = Literal["single-piece", "whole-word"]
TARGET_MODES: tuple[str, ...] = ("single-piece", "whole-word")


def load_stopwords(path: Path | str | None = None) -> frozenset[str]:
    """The stopword list: a file with one word per line (``#`` comments); the bundled English list if None."""
    text = (
        Path(path).read_text(encoding="utf-8")
        if path is not None
        else resources.files("bertknn.builder").joinpath("stopwords_en.txt").read_text(encoding="utf-8")
    )
    return frozenset(w.strip().lower() for w in text.splitlines() if w.strip() and not w.startswith("#"))


def stopwords_sha256(words: frozenset[str]) -> str:
    return hashlib.sha256("\n".join(sorted(words)).encode()).hexdigest()


@dataclass(frozen=True)
class Target:
    """One whole word: the token index of its (first) wordpiece, that piece's id and the word's character span.

    ``pieces`` holds every wordpiece id of the word in whole-word mode (one entry for a one-piece word) and is
    empty in single-piece mode.
    """

    token_index: int
    token_id: int
    char_start: int
    char_end: int
    pieces: tuple[int, ...] = ()

    @property
    def num_pieces(self) -> int:
        return max(1, len(self.pieces))


@dataclass(frozen=True)
class TokenizedSentence:
    text: str
    ids: tuple[int, ...]  # without special tokens
    targets: tuple[Target, ...]


class TargetSelector:
    """Finds every whole word of a sentence that is exactly one wordpiece (``whole-word``: of any number of
    wordpieces up to MAX_WORD_PIECES), minus stopwords and punctuation."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stopwords: frozenset[str], mode: TargetMode = "single-piece"
    ):
        if mode not in TARGET_MODES:
            raise ValueError(f"target mode {mode!r}: choose one of {', '.join(TARGET_MODES)}")
        self.tokenizer = tokenizer
        self.stopwords = stopwords
        self.mode = mode
        self.special_ids = set(tokenizer.all_special_ids)
        self._lower = bool(getattr(tokenizer, "do_lower_case", False)) or "uncased" in str(
            getattr(tokenizer, "name_or_path", "")
        )

    def select(self, sentences: Sequence[str]) -> list[TokenizedSentence]:
        """Tokenise a batch of sentences once (fast tokenizer, word alignment) and list their targets."""
        if not sentences:
            return []
        # split_special_tokens: a literal "[MASK]" or "[CLS]" in corpus text is text, not a second mask.
        enc = self.tokenizer(
            list(sentences),
            add_special_tokens=False,
            return_offsets_mapping=True,
            return_attention_mask=False,
            split_special_tokens=True,
        )
        out = []
        for b, text in enumerate(sentences):
            ids = enc["input_ids"][b]
            offsets = enc["offset_mapping"][b]
            word_ids = enc.word_ids(b)
            if self.mode == "whole-word":
                targets = self._whole_words(text, ids, offsets, word_ids)
                out.append(TokenizedSentence(text, tuple(int(t) for t in ids), tuple(targets)))
                continue
            counts: dict[int, int] = {}
            for w in word_ids:
                if w is not None:
                    counts[w] = counts.get(w, 0) + 1
            targets = []
            for i, (tok, w) in enumerate(zip(ids, word_ids, strict=True)):
                if w is None or counts[w] != 1 or tok in self.special_ids:
                    continue
                start, end = offsets[i]
                word = text[start:end]
                if is_punctuation(word) or word.lower() in self.stopwords:
                    continue
                targets.append(Target(i, int(tok), int(start), int(end)))
            out.append(TokenizedSentence(text, tuple(int(t) for t in ids), tuple(targets)))
        return out

    def _whole_words(
        self, text: str, ids: Sequence[int], offsets: Sequence[tuple[int, int]], word_ids: Sequence[int | None]
    ) -> list[Target]:
        spans: dict[int, list[int]] = {}  # word -> its token indices (contiguous)
        for i, w in enumerate(word_ids):
            if w is not None:
                spans.setdefault(w, []).append(i)
        targets = []
        for idx in spans.values():
            if len(idx) > MAX_WORD_PIECES or any(ids[i] in self.special_ids for i in idx):
                continue
            start, end = offsets[idx[0]][0], offsets[idx[-1]][1]
            word = text[start:end]
            if is_punctuation(word) or word.lower() in self.stopwords:
                continue
            pieces = tuple(int(ids[i]) for i in idx)
            targets.append(Target(idx[0], pieces[0], int(start), int(end), pieces))
        return targets


def masked_ids(sentence: TokenizedSentence, target: Target, mask_id: int) -> tuple[list[int], int]:
    """The sentence's token ids with the target's wordpieces replaced by ONE mask id: no re-tokenisation."""
    ids = list(sentence.ids)
    ids[target.token_index : target.token_index + target.num_pieces] = [mask_id]
    return ids, target.token_index
