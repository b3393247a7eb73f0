"""The word model of a tokenizer: which tokens are words, how pieces make a word, how a word is shown and keyed.

Everything here is read off the fast tokenizer itself (its offsets, word ids, ``decode`` and a round trip through
its own encoder), never from ``##``, ``Ġ`` or ``▁`` literals, so one rule covers WordPiece (BERT, DistilBERT),
byte-level BPE (RoBERTa, ModernBERT) and SentencePiece/Unigram (XLM-R, DeBERTa-v2/v3, ALBERT):

- **Words of a sentence** (`WordModel.words`): the tokenizer's own word ids, split further where a token is only
  punctuation (`is_word_break`; SentencePiece pre-tokenises on spaces alone, so ``Paris.`` is one of its "words").
- **The masked sequence** (`WordModel.masked`): a word's tokens replaced by ONE mask id. A query's ``[MASK]`` is
  first replaced by an ordinary word and that word's tokens are masked, so a query and a stored context of the
  same text give the same ids whatever the tokenizer does with the space before its mask token.
- **Token words** (`VocabWords`): the word a single token stands for, as an id. A token is a word when its text,
  encoded as a word in running text, gives back exactly one token: that token is the word's label, and the
  token itself maps to it. Byte-level BPE spells a word at the start of a text without its space (``Paris`` vs
  ``ĠParis``) and SentencePiece after punctuation; such bare forms map to the running-text token of the same text,
  so a word's mass never splits between its forms. WordPiece's inner pieces (``##s``) never start a word and
  map to nothing.
- **Case**: one rule (`lowercases`): the tokenizer's normaliser lower-cases text, or it does not.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any

import numpy as np

from bertknn.core.errors import QueryError
from bertknn.core.languages import has_unspaced, word_boundaries
from bertknn.core.text import MASK_RE, is_punctuation, is_word_break

# words a query's [MASK] may be replaced by before tokenising (its tokens then become the one mask): the first
# that the tokenizer knows (no unknown or special token) and whose tokens keep apart from the text around it
_STAND_INS = ("something", "the", "and", "of", "a", "x", "e", "i", "o")
# tried first where the mask touches its neighbours without a space ("18[MASK]中葉", "東京は[MASK]の"): a word of
# an unspaced script keeps apart from digits and Latin letters, which the tokenizer would glue to a Latin stand-in.
# Han characters first: WordPiece puts a break on both sides of each (bert-base-uncased knows 人 but not 何), so
# the kana around the mask keep their word-initial tokens, as beside a stored Han word; kana would be glued to them.
_UNSPACED_STAND_INS = ("何", "某", "誰", "人", "それ", "อะไร")


def lowercases(tokenizer: Any) -> bool:
    """Whether the tokenizer lower-cases its input (bert-base-uncased and the like): the one rule for "uncased"."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizer = getattr(backend, "normalizer", None)
    if normalizer is not None:
        probe = "Paris Zebra QUANTUM"
        return bool(normalizer.normalize_str(probe) == normalizer.normalize_str(probe.lower()))
    return False


@dataclass(frozen=True)
class WordSpan:
    """One word of a tokenised text: its tokens ``[first, last]`` and its characters ``[start, end)``."""

    first: int
    last: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.last - self.first + 1


@dataclass(frozen=True)
class Tokenized:
    """A text's token ids (no special tokens), their character offsets and the tokenizer's word ids."""

    text: str
    ids: tuple[int, ...]
    offsets: tuple[tuple[int, int], ...]  # without surrounding whitespace; a space-only token is empty (e, e)
    word_ids: tuple[int | None, ...]


# log p of a token whose mass moved to its word's running-text token: zero probability, finite in float16
MERGED_LOG_PROB = -1.0e4


class VocabWords:
    """Per token id (the model's vocabulary rows): its shown text, and the token word it stands for (or -1)."""

    def __init__(self, texts: list[str], word_of: np.ndarray):
        self.texts = texts  # a word's shown text; other tokens as the tokenizer spells them ("" past its end)
        self.word_of = word_of  # int64: the label id of the one-token word each id spells, -1 when none

    def merge_log_probs(self, log_probs: Any) -> Any:
        """log p_MLM over tokens -> over words: each bare form's mass added to its word's running-text token
        (a torch tensor ``[n, vocab]``, changed in place and returned; untouched when nothing merges)."""
        import torch

        for src, dst in self.merge_layers:
            s, d = torch.from_numpy(src), torch.from_numpy(dst)
            log_probs[:, d] = torch.logaddexp(log_probs[:, d], log_probs[:, s])
            log_probs[:, s] = MERGED_LOG_PROB
        return log_probs

    @cached_property
    def merge_layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """`merges` in layers whose targets are distinct (so one vectorised step per layer adds them all)."""
        src, dst = self.merges
        layers: list[tuple[np.ndarray, np.ndarray]] = []
        left = np.arange(len(src))
        while len(left):
            _, first = np.unique(dst[left], return_index=True)
            take = left[np.sort(first)]
            layers.append((src[take], dst[take]))
            left = np.setdiff1d(left, take)
        return layers

    @cached_property
    def non_words(self) -> np.ndarray:
        """Ids that are never a cloze answer: special tokens, inner pieces, punctuation, unused rows."""
        return np.asarray(self.word_of < 0)

    @cached_property
    def merges(self) -> tuple[np.ndarray, np.ndarray]:
        """(source ids, target ids) of the tokens whose mass belongs to another id's word (bare forms)."""
        ids = np.arange(len(self.word_of))
        src = ids[(self.word_of >= 0) & (self.word_of != ids)]
        return src, self.word_of[src]


class WordModel:
    """A fast tokenizer's word logic (see the module docstring); one per tokenizer, shared by every side."""

    def __init__(self, tokenizer: Any, vocab_size: int | None = None):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast (Rust) tokenizer is required for word alignment")
        if tokenizer.mask_token_id is None:
            raise ValueError("the tokenizer has no mask token; a masked LM is required")
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size if vocab_size is not None else len(tokenizer))
        self.mask_id = int(tokenizer.mask_token_id)
        self.special_ids = frozenset(int(i) for i in tokenizer.all_special_ids)
        self.lowercase = lowercases(tokenizer)
        self._mask_re = re.compile(f"{MASK_RE.pattern}|{re.escape(str(tokenizer.mask_token))}", re.IGNORECASE)

    # ---- text ---------------------------------------------------------------------------------------------

    def key(self, text: str) -> str:
        """A word's identity: NFC, lower-cased for an uncased model (the case a cased model keeps)."""
        text = unicodedata.normalize("NFC", text.strip())
        return text.lower() if self.lowercase else text

    def shown(self, text: str) -> str:
        """How an answer is shown: the same as its key (an uncased model's answers are lower-case)."""
        return self.key(text)

    def decode_word(self, pieces: Sequence[int]) -> str:
        """The text of a word from its tokens (``kel ##va ##dorn`` and ``ĠPar is`` alike)."""
        text = self.tokenizer.decode(
            list(pieces), skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return self.key(str(text))

    # ---- sentences ----------------------------------------------------------------------------------------

    def tokenize(self, texts: Sequence[str]) -> list[Tokenized]:
        """Token ids, offsets and word ids of each text: one batched call; special-token text is plain text."""
        enc = self.tokenizer(
            list(texts), add_special_tokens=False, return_offsets_mapping=True, return_attention_mask=False,
            split_special_tokens=True,
        )  # fmt: skip
        return [
            Tokenized(
                text,
                tuple(int(t) for t in enc["input_ids"][b]),
                _space_tokens_empty([_trim(text, int(s), int(e)) for s, e in enc["offset_mapping"][b]]),
                tuple(enc.word_ids(b)),
            )
            for b, text in enumerate(texts)
        ]

    def words(self, tok: Tokenized) -> list[WordSpan]:
        """The words of a tokenised text: word-id groups split at punctuation-only tokens; no special token."""
        out: list[WordSpan] = []
        run: list[int] = []

        def close() -> None:
            if run:
                start, end = tok.offsets[run[0]][0], tok.offsets[run[-1]][1]
                if end > start:
                    out.append(WordSpan(run[0], run[-1], start, end))
                run.clear()

        previous: int | None = None
        for i, (tid, w) in enumerate(zip(tok.ids, tok.word_ids, strict=True)):
            s, e = tok.offsets[i]
            piece = tok.text[s:e]
            # a space-only token (SentencePiece's lone "▁") belongs to the word after it
            breaks, unspaced = _piece_kind(piece)
            if w is None or tid in self.special_ids or breaks:
                close()
                previous = None
                continue
            if w != previous:
                close()
            if unspaced:
                # a script without spaces (Japanese, Chinese, Thai): the tokenizer's pre-tokenizer sees a whole
                # clause as one "word"; each of its tokens is a word (with a lone "▁" before it, if any)
                if any(tok.offsets[j][1] > tok.offsets[j][0] for j in run):
                    close()
                run.append(i)
                close()
                previous = None
                continue
            run.append(i)
            previous = w
        close()
        return _join_unspaced(tok.text, out)

    def content(self, tok: Tokenized, word: WordSpan) -> list[int]:
        """The word's token indices that hold characters (not SentencePiece's lone "▁")."""
        return [i for i in range(word.first, word.last + 1) if tok.offsets[i][1] > tok.offsets[i][0]]

    def masked(self, tok: Tokenized, word: WordSpan) -> tuple[list[int], int]:
        """The text's ids with the word's tokens replaced by ONE mask id, and the mask's index (no re-tokenising)."""
        ids = list(tok.ids)
        ids[word.first : word.last + 1] = [self.mask_id]
        return ids, word.first

    def query_ids(self, text: str) -> tuple[list[int], int]:
        """A cloze question's ids around its one mask, built exactly as a stored context's (`masked`).

        ``[MASK]`` in any case or spacing, or the model's own mask token (``<mask>``), marks the place.
        `QueryError` says what is wrong with the text."""
        marks = list(self._mask_re.finditer(text))
        if len(marks) != 1:
            raise QueryError(f"the text must contain exactly one [MASK]; found {len(marks)}")
        mark = marks[0]
        head, tail = text[: mark.start()], text[mark.end() :]
        if not (head + tail).strip():
            raise QueryError("the text has nothing but [MASK]; give the words around it")
        if _unspaced(head.rstrip()[-1:]) and _unspaced(tail.lstrip()[:1]):
            head, tail = head.rstrip(), tail.lstrip()  # unspaced text has no spaces: "は [MASK] の" as "は[MASK]の"
        fallback: tuple[Tokenized, WordSpan] | None = None
        for stand_in in self._stand_ins_for(head, tail):
            tok = self.tokenize([f"{head}{stand_in}{tail}"])[0]
            start, end = len(head), len(head) + len(stand_in)
            inside = [w for w in self.words(tok) if w.start < end and w.end > start]
            if not inside:
                continue
            span = WordSpan(inside[0].first, inside[-1].last, start, end)
            if inside[0].start == start and inside[-1].end == end:  # no token glued it to its neighbours
                return self.masked(tok, span)
            fallback = fallback or (tok, span)
        if fallback is None:
            raise QueryError("the text must tokenise to exactly one [MASK]; found 0")
        return self.masked(*fallback)

    def _stand_ins_for(self, head: str, tail: str) -> list[str]:
        """The stand-ins to try, in order: an unspaced script's first where the mask touches its neighbours
        without a space (a Latin stand-in would be glued to digits or letters there)."""
        touching = any(ch.strip() and not is_word_break(ch) for ch in (head[-1:], tail[:1]))
        spaced, unspaced = self._known_stand_ins
        return unspaced + spaced if touching else spaced + unspaced

    @cached_property
    def _known_stand_ins(self) -> tuple[list[str], list[str]]:
        """The spaced and the unspaced stand-ins that the tokenizer knows (no unknown or special token)."""
        spaced, unspaced = (
            [w for w in words if (ids := self.pieces_of(w)) and not self.special_ids.intersection(ids)]
            for words in (_STAND_INS, _UNSPACED_STAND_INS)
        )
        if not spaced:  # a tokenizer of a script without Latin letters (one trained on Hindi text alone)
            spaced = self._vocabulary_stand_ins()
        if not spaced:
            raise ValueError("the tokenizer knows none of the plain words a query's mask is placed with")
        return spaced, unspaced

    def _vocabulary_stand_ins(self, n: int = 3) -> list[str]:
        """The first ``n`` words of the tokenizer's own vocabulary that are one token of letters in running text:
        the stand-ins where it knows none of `_STAND_INS`."""
        out: list[str] = []
        for token_id in range(self.vocab_size):
            text = self.token_text(token_id)
            if self.token_word(token_id) >= 0 and text.isalpha() and self.pieces_of(text) == (token_id,):
                out.append(text)
                if len(out) == n:
                    break
        return out

    # ---- the vocabulary -----------------------------------------------------------------------------------

    def running_text_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each word's tokens as it is written in running text (after a space): `tokenize`'s ids, without the
        offsets and word ids it also reads."""
        enc = self.tokenizer(
            [f" {w}" for w in words], add_special_tokens=False, return_attention_mask=False, split_special_tokens=True
        )
        return [[int(t) for t in ids] for ids in enc["input_ids"]]

    def pieces_of(self, word: str) -> tuple[int, ...]:
        """A word's tokens in running text (how a mask in the middle of a sentence would spell it)."""
        return tuple(self.running_text_ids([word])[0])

    @cached_property
    def vocab(self) -> VocabWords:
        """Every vocabulary row's shown text and token word (computed once, on first use: `read_vocab_words`)."""
        return read_vocab_words(self)

    def token_word(self, token_id: int) -> int:
        """The label id of the one-token word ``token_id`` spells, or -1 (inner pieces, specials, punctuation)."""
        return int(self.vocab.word_of[token_id]) if 0 <= token_id < self.vocab_size else -1

    def token_text(self, token_id: int) -> str:
        return self.vocab.texts[token_id] if 0 <= token_id < self.vocab_size else ""


def read_vocab_words(model: WordModel) -> VocabWords:
    """Every vocabulary row's shown text and the one-token word it stands for (`VocabWords`): one decode of
    every row after a word, then each candidate word tokenised back as running text."""
    tok = model.tokenizer
    n_tok = min(len(tok), model.vocab_size)
    # A token's text as it reads after a word: decode(word, token) minus decode(word). A word-initial token
    # reads " Paris", an inner piece "s"; the space is what tells them apart.
    anchor = tok(" a", add_special_tokens=False)["input_ids"] or [0]
    base = str(tok.decode(anchor, clean_up_tokenization_spaces=False))
    pairs = [[*anchor, i] for i in range(n_tok)]
    decoded = tok.batch_decode(pairs, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    after = [str(d)[len(base) :] if str(d).startswith(base) else str(d) for d in decoded]
    raw = tok.convert_ids_to_tokens(list(range(n_tok)))
    texts = [str(t) if t is not None else "" for t in raw] + [""] * (model.vocab_size - n_tok)
    word_of = np.full(model.vocab_size, -1, dtype=np.int64)
    candidates = []
    for i in range(n_tok):
        text = after[i].strip()
        if i in model.special_ids or not text or is_punctuation(text) or "\ufffd" in text:
            continue
        if is_word_break(text[0]) or is_word_break(text[-1]):
            continue  # punctuation glued to a word (SentencePiece's "(the", "Paris."): no answer
        texts[i] = model.key(text)
        candidates.append(i)
    back = model.running_text_ids([after[i].strip() for i in candidates])
    bare_starts = _bare_forms_start_words(model)
    for i, ids in zip(candidates, back, strict=True):
        if bare_starts and not after[i][:1].isspace() and _unspaced(after[i]):
            # unspaced text, where a word starts without a space (SentencePiece; never WordPiece's "##の"):
            # each of its tokens can be a word (`words`)
            word_of[i] = i
            continue
        if len(ids) != 1 or ids[0] >= model.vocab_size:
            continue
        own = ids[0]
        if own == i:
            word_of[i] = i
        elif bare_starts and not after[i][:1].isspace() and texts[own] == texts[i]:
            word_of[i] = own  # a bare form (``Paris`` at a text's start) of the running-text word
    return VocabWords(texts, word_of)


def _bare_forms_start_words(model: WordModel) -> bool:
    """Whether a word can start with a token other than its running-text form: byte-level BPE at a text's
    start, SentencePiece after punctuation; never WordPiece, whose inner pieces stay inside words."""
    for probe in ("the", "(the", "paris", "(paris", "new", "(new"):
        tok = model.tokenize([probe])[0]
        for w in model.words(tok):
            ref = model.pieces_of(tok.text[w.start : w.end])
            if tuple(tok.ids[w.first : w.last + 1]) != ref:
                return True
    return False


def _join_unspaced(text: str, words: list[WordSpan]) -> list[WordSpan]:
    """One-token words of unspaced text joined into the words ICU's word breaker finds (``東`` + ``京`` ->
    ``東京``): adjacent ones merge where ICU puts no boundary between them. Unchanged without ICU or such text."""
    if not has_unspaced(text):
        return words
    bounds = word_boundaries(text)
    if bounds is None:
        return words
    out: list[WordSpan] = []
    for w in words:
        prev = out[-1] if out else None
        if (
            prev is not None and prev.end == w.start and prev.last + 1 == w.first and w.start not in bounds
            and _unspaced(text[prev.end - 1]) and _unspaced(text[w.start])
        ):  # fmt: skip
            out[-1] = WordSpan(prev.first, w.last, prev.start, w.end)
        else:
            out.append(w)
    return out


@lru_cache(maxsize=65536)
def _piece_kind(piece: str) -> tuple[bool, bool]:
    """(a word break: punctuation only, without its spaces; of an unspaced script) of a token's text, for `words`:
    texts repeat (a vocabulary's few thousand common pieces), and each test is a loop over characters."""
    return is_word_break(piece.strip()), _unspaced(piece)


def _unspaced(piece: str) -> bool:
    """A token (or character) of a script written without spaces between words."""
    return has_unspaced(piece)


def _space_tokens_empty(offsets: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """A token that starts where the next one starts holds no character of its own: SentencePiece's lone "▁" at a
    text's start is reported over the first character (``(0, 1)`` beside ``(0, 3)``); it is made empty."""
    for i in range(len(offsets) - 1):
        (s, e), (s2, e2) = offsets[i], offsets[i + 1]
        if s == s2 and e > s and e2 > s2:
            offsets[i] = (s, s)
    return tuple(offsets)


def _trim(text: str, start: int, end: int) -> tuple[int, int]:
    """A token's span without the whitespace a byte-level or Metaspace token's offsets may include."""
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end
