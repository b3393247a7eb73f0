"""Which token occurrences become datastore entries, and their masked contexts (tokenised once)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Literal

from transformers import PreTrainedTokenizerBase

from bertknn.core.text import is_punctuation
from bertknn.core.words import MAX_WORD_PIECES

# an entity link's anchor of more wordpieces than this is left out (titles of works, long names)
MAX_ANCHOR_PIECES = 16
SentenceLink = tuple[int, int, int]  # (start, end) characters in the sentence, and the caller's entity index

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
    token_id: int  # -1: an entity link's anchor that is no word target (its label is "no word")
    char_start: int
    char_end: int
    pieces: tuple[int, ...] = ()
    entity: int = -1  # the link this occurrence is the anchor of (an index the caller gave), or -1

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

    def select(
        self, sentences: Sequence[str], links: Sequence[Sequence[SentenceLink]] | None = None
    ) -> list[TokenizedSentence]:
        """Tokenise a batch of sentences once (fast tokenizer, word alignment) and list their targets.

        ``links``: per sentence, its entity links (character spans into the sentence). A link whose anchor is
        exactly one word target labels that target with its entity; any other anchor of whole tokens (several
        words, or a word of too many wordpieces, up to `MAX_ANCHOR_PIECES`) becomes a target of its own, all its
        wordpieces replaced by one [MASK], with no word label. Anchors that cut a token, or hold only stopwords
        and punctuation, are left out."""
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
                if links is not None and links[b]:
                    targets = self._link_targets(text, ids, offsets, targets, links[b])
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
            if links is not None and links[b]:
                targets = self._link_targets(text, ids, offsets, targets, links[b])
            out.append(TokenizedSentence(text, tuple(int(t) for t in ids), tuple(targets)))
        return out

    def _link_targets(
        self,
        text: str,
        ids: Sequence[int],
        offsets: Sequence[tuple[int, int]],
        targets: list[Target],
        links: Sequence[SentenceLink],
    ) -> list[Target]:
        by_span = {(t.char_start, t.char_end): i for i, t in enumerate(targets)}
        starts = {int(o[0]): i for i, o in enumerate(offsets) if o[1] > o[0]}
        ends = {int(o[1]): i for i, o in enumerate(offsets) if o[1] > o[0]}
        out = list(targets)
        taken: set[int] = set()
        extra: list[Target] = []
        for start, end, entity in links:
            first, last = starts.get(start), ends.get(end)
            if first is None or last is None or last < first or last - first + 1 > MAX_ANCHOR_PIECES:
                continue  # the anchor cuts a token (``[[Paris]]ian``), or is too long to be one answer
            word = by_span.get((start, end))
            if word is not None:
                if word not in taken:
                    taken.add(word)
                    out[word] = replace(out[word], entity=entity)
                continue
            pieces = tuple(int(ids[i]) for i in range(first, last + 1))
            if any(p in self.special_ids for p in pieces) or not _content(text[start:end], self.stopwords):
                continue
            extra.append(Target(first, -1, start, end, pieces, entity))
        return sorted(out + extra, key=lambda t: (t.token_index, t.num_pieces))

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


def _content(anchor: str, stopwords: frozenset[str]) -> bool:
    """Whether an anchor holds a word that is neither a stopword nor punctuation."""
    return any(not is_punctuation(w) and w.lower() not in stopwords for w in anchor.split())


def masked_ids(sentence: TokenizedSentence, target: Target, mask_id: int) -> tuple[list[int], int]:
    """The sentence's token ids with the target's wordpieces replaced by ONE mask id: no re-tokenisation."""
    ids = list(sentence.ids)
    ids[target.token_index : target.token_index + target.num_pieces] = [mask_id]
    return ids, target.token_index
