"""Which token occurrences become datastore entries, and their masked contexts (tokenised once)."""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Literal

from transformers import PreTrainedTokenizerBase

from bertknn.core.languages import rules_for
from bertknn.core.text import is_punctuation, is_word_break
from bertknn.core.wordmodel import Tokenized, WordModel
from bertknn.core.words import MAX_WORD_PIECES

# an entity link's anchor of more wordpieces than this is left out (titles of works, long names)
MAX_ANCHOR_PIECES = 16
SentenceLink = tuple[int, int, int]  # (start, end) characters in the sentence, and the caller's entity index

# single-piece: the paper's rule, a whole word that is exactly one wordpiece. whole-word: every whole word of at
# most MAX_WORD_PIECES wordpieces; all its pieces are replaced by ONE [MASK] (as in a query, which has one).
TargetMode = Literal["single-piece", "whole-word"]
TARGET_MODES: tuple[str, ...] = ("single-piece", "whole-word")


def load_stopwords(path: Path | str | None = None, language: str = "en") -> frozenset[str]:
    """The stopword list: a file with one word per line (``#`` comments); if None, the language's: the bundled
    English list for ``en``, else the Stopwords ISO list (the ``stopwordsiso`` package), else none."""
    if path is None and language != "en":
        import stopwordsiso

        base = language.split("-", 1)[0]
        words = set(stopwordsiso.stopwords(base) if stopwordsiso.has_lang(base) else ()) | rules_for(language).stopwords
        return frozenset(unicodedata.normalize("NFC", w).strip().lower() for w in words if w.strip())
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
    """One whole word: the index of its first token, its label and its character span.

    ``token_id`` is the label of a single-piece target (the token word it spells, `WordModel.token_word`: one
    id for ``Paris`` and ``ĠParis``). ``pieces`` holds the word's token ids in whole-word mode (one entry for a
    one-piece word) and is empty in single-piece mode. ``width``: the tokens the mask replaces (a one-piece word
    may carry SentencePiece's lone "▁" before it).
    """

    token_index: int
    token_id: int  # -1: an entity link's anchor that is no word target (its label is "no word")
    char_start: int
    char_end: int
    pieces: tuple[int, ...] = ()
    entity: int = -1  # the link this occurrence is the anchor of (an index the caller gave), or -1
    width: int = 0  # tokens replaced by the mask; 0: one per piece (at least one)

    @property
    def num_pieces(self) -> int:
        return self.width or max(1, len(self.pieces))


@dataclass(frozen=True)
class TokenizedSentence:
    text: str
    ids: tuple[int, ...]  # without special tokens
    targets: tuple[Target, ...]
    words: int = 0  # its words that are neither stopwords nor punctuation: those that could be targets

    @property
    def word_targets(self) -> int:
        """Its targets that are words (not an entity link's anchor alone): of ``words``, those kept."""
        return sum(t.token_id >= 0 for t in self.targets)


class TargetSelector:
    """Finds every whole word of a sentence that is exactly one token (``whole-word``: of any number of tokens
    up to MAX_WORD_PIECES), minus stopwords and punctuation. Words are the tokenizer's (`WordModel.words`)."""

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stopwords: frozenset[str], mode: TargetMode = "single-piece",
        words: WordModel | None = None,
    ):  # fmt: skip
        if mode not in TARGET_MODES:
            raise ValueError(f"target mode {mode!r}: choose one of {', '.join(TARGET_MODES)}")
        self.tokenizer = tokenizer
        self.words = words if words is not None else WordModel(tokenizer)
        self.stopwords = stopwords
        self.mode = mode
        self.special_ids = self.words.special_ids
        self.unk_id = tokenizer.unk_token_id  # (None: a byte-level tokenizer, which spells every word)

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
        out = []
        for b, tok in enumerate(self.words.tokenize(sentences)):
            targets = []
            seen = 0
            for w in self.words.words(tok):
                word = tok.text[w.start : w.end]
                if is_punctuation(word) or word.lower() in self.stopwords or _cut_punctuation(word):
                    continue
                seen += 1
                content = self.words.content(tok, w)
                if self.mode == "whole-word":
                    if len(content) <= MAX_WORD_PIECES:
                        pieces = tuple(tok.ids[i] for i in content)
                        targets.append(Target(w.first, pieces[0], w.start, w.end, pieces, width=w.num_tokens))
                    continue
                label = self.words.token_word(tok.ids[content[0]]) if len(content) == 1 else -1
                if label >= 0:
                    targets.append(Target(w.first, label, w.start, w.end, width=w.num_tokens))
            if links is not None and links[b]:
                targets = self._link_targets(tok.text, tok.ids, tok.offsets, targets, links[b])
            out.append(TokenizedSentence(tok.text, tok.ids, tuple(targets), seen + self._unknown_words(tok)))
        return out

    def _unknown_words(self, tok: Tokenized) -> int:
        """The words the tokenizer could not spell (its unknown token): no word span holds them, so no target,
        but they are words a tokenizer that knew the language would keep (`StageTimes.count_words`)."""
        if self.unk_id is None:
            return 0
        unknown = {w for i, (t, w) in enumerate(zip(tok.ids, tok.word_ids, strict=True))
                   if t == self.unk_id and w is not None and not is_punctuation(tok.text[slice(*tok.offsets[i])])}  # fmt: skip
        return len(unknown)

    def _link_targets(
        self,
        text: str,
        ids: Sequence[int],
        offsets: Sequence[tuple[int, int]],
        targets: list[Target],
        links: Sequence[SentenceLink],
    ) -> list[Target]:
        by_span = {(t.char_start, t.char_end): i for i, t in enumerate(targets)}
        starts = {int(o[0]): i for i, o in reversed(list(enumerate(offsets))) if o[1] > o[0]}
        ends = {int(o[1]): i for i, o in enumerate(offsets) if o[1] > o[0]}
        out = list(targets)
        taken: set[int] = set()
        extra: list[Target] = []
        for start, end, entity in links:
            first, last = starts.get(start), ends.get(end)
            if first is None or last is None or last < first or last - first + 1 > MAX_ANCHOR_PIECES:
                continue  # the anchor cuts a token (``un[[happy]]``), or is too long to be one answer
            word = by_span.get((start, end))
            if word is not None:
                if word not in taken:
                    taken.add(word)
                    out[word] = replace(out[word], entity=entity)
                continue
            while first > 0 and offsets[first - 1][0] == offsets[first - 1][1] == offsets[first][0]:
                first -= 1  # SentencePiece's lone "▁" before the anchor goes under the mask with it
            pieces = tuple(int(ids[i]) for i in range(first, last + 1))
            if any(p in self.special_ids for p in pieces) or not _content(text[start:end], self.stopwords):
                continue
            extra.append(Target(first, -1, start, end, pieces, entity))
        return sorted(out + extra, key=lambda t: (t.token_index, t.num_pieces))


def _cut_punctuation(word: str) -> bool:
    """A word whose token carries punctuation at an edge (SentencePiece's ``(до`` or ``また、``): no answer."""
    return is_word_break(word[0]) or is_word_break(word[-1])


def _content(anchor: str, stopwords: frozenset[str]) -> bool:
    """Whether an anchor holds a word that is neither a stopword nor punctuation."""
    return any(not is_punctuation(w) and w.lower() not in stopwords for w in anchor.split())


def masked_ids(sentence: TokenizedSentence, target: Target, mask_id: int) -> tuple[list[int], int]:
    """The sentence's token ids with the target's wordpieces replaced by ONE mask id: no re-tokenisation."""
    ids = list(sentence.ids)
    ids[target.token_index : target.token_index + target.num_pieces] = [mask_id]
    return ids, target.token_index
