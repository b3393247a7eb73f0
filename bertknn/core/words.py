"""Whole-word targets: the per-shard word table (``words.json``) that a whole-word datastore's labels index.

In a datastore built with ``--targets whole-word`` every row's label is an id into its own shard's word table,
not a token id. Entry ``i`` of ``words.json`` is ``[text, [piece ids]]``: the word as the tokenizer normalises
it (its wordpieces joined back, e.g. ``"kelvadorn"`` for ``kel ##va ##dorn``) and the wordpieces the model saw
in the first stored context of that word. A shard's table lists the shard's words in first-occurrence order,
each text once, so a shard is self-contained: a resumed build, a merge of slices (hard links) or a shard added
later needs no relabelling of any other shard. Readers key words by their text (the same text in two shards is
the same word).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bertknn.core.wordmodel import WordModel

# Words of more wordpieces are not targets: the service scores a word by one forward pass per piece.
MAX_WORD_PIECES = 8


@dataclass(frozen=True)
class WordEntry:
    text: str
    pieces: tuple[int, ...]

    @property
    def multi_piece(self) -> bool:
        return len(self.pieces) > 1


class WordTable:
    """One shard's words: label id -> (text, pieces)."""

    def __init__(self, entries: Sequence[WordEntry]):
        self.entries = list(entries)

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, label: int) -> WordEntry:
        return self.entries[label]

    def to_json(self) -> bytes:
        rows = [[e.text, list(e.pieces)] for e in self.entries]
        return json.dumps(rows, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes) -> WordTable:
        """Parse ``words.json``; ValueError says what is malformed."""
        try:
            rows = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not valid JSON ({exc})") from exc
        if not isinstance(rows, list):
            raise ValueError("expected a JSON list of [text, [piece ids]] entries")
        entries = []
        for i, row in enumerate(rows):
            ok = (
                isinstance(row, list)
                and len(row) == 2
                and isinstance(row[0], str)
                and row[0]
                and isinstance(row[1], list)
                and 1 <= len(row[1]) <= MAX_WORD_PIECES
                and all(isinstance(p, int) and not isinstance(p, bool) for p in row[1])
            )
            if not ok:
                raise ValueError(
                    f"entry {i} is not [non-empty text, [1..{MAX_WORD_PIECES} integer piece ids]]"
                )
            entries.append(WordEntry(row[0], tuple(row[1])))
        return cls(entries)


def read_word_table(path: Path) -> WordTable:
    return WordTable.from_json(Path(path).read_bytes())


def check_word_table(table: WordTable, vocab_size: int) -> str | None:
    """The first problem with a table's content (piece ids outside the vocabulary, a text listed twice), or None."""
    seen: set[str] = set()
    for i, e in enumerate(table.entries):
        if any(p < 0 or p >= vocab_size for p in e.pieces):
            return f"entry {i} ({e.text!r}) has a piece id outside the vocabulary [0, {vocab_size})"
        if e.text in seen:
            return f"entry {i}: the word {e.text!r} is listed twice"
        seen.add(e.text)
    return None


class WordTableBuilder:
    """Assigns shard-local word ids in first-occurrence order while a shard is prepared.

    A word is keyed by its text (`WordModel.decode_word`: ``ĠPar is`` and a text-initial ``Par is`` are one
    word); its stored pieces are its running-text tokens (`WordModel.pieces_of`), the form a query's mask in the
    middle of a sentence is scored with."""

    def __init__(self, words: WordModel):
        self.words = words
        self._by_pieces: dict[tuple[int, ...], int] = {}
        self._by_text: dict[str, int] = {}
        self.entries: list[WordEntry] = []

    def add(self, pieces: tuple[int, ...]) -> int:
        """The label of the word made of ``pieces`` (a new id when its text is new to this shard)."""
        label = self._by_pieces.get(pieces)
        if label is not None:
            return label
        text = self.words.decode_word(pieces)
        label = self._by_text.get(text)
        if label is None:
            label = len(self.entries)
            self._by_text[text] = label
            running = self.words.pieces_of(text)
            self.entries.append(WordEntry(text, running if 1 <= len(running) <= MAX_WORD_PIECES else pieces))
        self._by_pieces[pieces] = label
        return label

    def table(self) -> WordTable:
        return WordTable(self.entries)
