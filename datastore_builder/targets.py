"""Which token occurrences become datastore entries, and their masked contexts (tokenised once)."""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from transformers import PreTrainedTokenizerBase


def load_stopwords(path: Path | str | None = None) -> frozenset[str]:
    """The stopword list: a file with one word per line (``#`` comments); the bundled English list if None."""
    text = (
        Path(path).read_text(encoding="utf-8")
        if path is not None
        else resources.files("datastore_builder").joinpath("stopwords_en.txt").read_text(encoding="utf-8")
    )
    return frozenset(w.strip().lower() for w in text.splitlines() if w.strip() and not w.startswith("#"))


def stopwords_sha256(words: frozenset[str]) -> str:
    return hashlib.sha256("\n".join(sorted(words)).encode()).hexdigest()


def is_punctuation(word: str) -> bool:
    """True when a word has no letter or digit (``"."``, ``"--"``, ``"%"``)."""
    return not any(unicodedata.category(ch)[0] in "LN" for ch in word)


@dataclass(frozen=True)
class Target:
    """One whole word that is a single wordpiece: its token index in the sentence, id and character span."""

    token_index: int
    token_id: int
    char_start: int
    char_end: int


@dataclass(frozen=True)
class TokenizedSentence:
    text: str
    ids: tuple[int, ...]  # without special tokens
    targets: tuple[Target, ...]


class TargetSelector:
    """Finds every whole word of a sentence that is exactly one wordpiece, minus stopwords and punctuation."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stopwords: frozenset[str]):
        self.tokenizer = tokenizer
        self.stopwords = stopwords
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


def masked_ids(sentence: TokenizedSentence, target: Target, mask_id: int) -> tuple[list[int], int]:
    """The sentence's token ids with the target replaced by the mask id: no re-tokenisation."""
    ids = list(sentence.ids)
    ids[target.token_index] = mask_id
    return ids, target.token_index
