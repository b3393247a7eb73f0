"""Model inputs around one mask: one (`MaskedInput`), or many packed into three arrays (`PackedInputs`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import overload

import numpy as np


@dataclass(frozen=True)
class MaskedInput:
    """Token ids with special tokens added, and the position of the single [MASK]; ``cut``: how many of the text's
    tokens were left out of the model's window (`ContextTokenizer.masked_input`), which the input's identity does
    not include."""

    input_ids: tuple[int, ...]
    mask_pos: int
    cut: int = field(default=0, compare=False)


@dataclass(frozen=True)
class PackedInputs(Sequence[MaskedInput]):
    """Many masked inputs as three arrays: the builder's worker processes hand a shard's contexts to the model's
    process this way (a pickle of three arrays, not of one object per context), and a batch is padded from them
    in a few array operations (`padded`)."""

    ids: np.ndarray  # int32 [total tokens]: every input's ids, one input after the other
    offsets: np.ndarray  # int64 [n + 1]: input i is ids[offsets[i]:offsets[i + 1]]
    mask_pos: np.ndarray  # int32 [n]

    @classmethod
    def of(cls, items: Sequence[MaskedInput]) -> PackedInputs:
        lengths = np.fromiter((len(x.input_ids) for x in items), np.int64, len(items))
        offsets = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        ids = np.fromiter((t for x in items for t in x.input_ids), np.int32, int(offsets[-1]))
        return cls(ids, offsets, np.fromiter((x.mask_pos for x in items), np.int32, len(items)))

    @classmethod
    def concat(cls, parts: Sequence[PackedInputs]) -> PackedInputs:
        if not parts:
            return cls.of([])
        shifts = np.cumsum([0] + [int(p.offsets[-1]) for p in parts[:-1]])
        offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, shifts, strict=True)])
        return cls(
            np.concatenate([p.ids for p in parts]).astype(np.int32, copy=False),
            offsets.astype(np.int64, copy=False),
            np.concatenate([p.mask_pos for p in parts]).astype(np.int32, copy=False),
        )

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.mask_pos)

    @overload
    def __getitem__(self, i: int) -> MaskedInput: ...

    @overload
    def __getitem__(self, i: slice) -> PackedInputs: ...

    def __getitem__(self, i: int | slice) -> MaskedInput | PackedInputs:
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                raise ValueError("PackedInputs slices are contiguous")
            b = max(a, b)
            lo, hi = int(self.offsets[a]), int(self.offsets[b])
            return PackedInputs(self.ids[lo:hi], self.offsets[a : b + 1] - lo, self.mask_pos[a:b])
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return MaskedInput(tuple(self.ids[self.offsets[i] : self.offsets[i + 1]].tolist()), int(self.mask_pos[i]))

    def __iter__(self) -> Iterator[MaskedInput]:
        return (self[i] for i in range(len(self)))

    def take(self, rows: Sequence[int] | np.ndarray) -> PackedInputs:
        """The inputs at ``rows``, in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        starts, lengths = self.offsets[rows], self.lengths[rows]
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]), dtype=np.int64)
        return PackedInputs(self.ids[gather], offsets, self.mask_pos[rows])

    def padded(self, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Padded ids, attention mask, batch rows and [MASK] positions (host int64 arrays), as the encoder's
        forward takes them."""
        n, lengths = len(self), self.lengths
        width = int(lengths.max()) if n else 0
        attn = (np.arange(width, dtype=np.int64)[None, :] < lengths[:, None]).astype(np.int64)
        ids = np.full((n, width), pad_id, dtype=np.int64)
        ids[attn.astype(bool)] = self.ids  # row by row, each input's ids then its padding
        return ids, attn, np.arange(n, dtype=np.int64), self.mask_pos.astype(np.int64)


def padded_arrays(items: Sequence[MaskedInput], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Padded ids, attention mask, batch rows and [MASK] positions of a batch: host int64 arrays.

    numpy, not torch: on the service's path (batches of one or a few) building them as tensors costs several times more.
    """
    if isinstance(items, PackedInputs):  # the builder's batches: padded from the packed arrays at once
        return items.padded(pad_id)
    n = len(items)
    width = max(len(x.input_ids) for x in items)
    ids = np.full((n, width), pad_id, dtype=np.int64)
    attn = np.zeros((n, width), dtype=np.int64)
    for i, x in enumerate(items):
        ids[i, : len(x.input_ids)] = x.input_ids
        attn[i, : len(x.input_ids)] = 1
    return ids, attn, np.arange(n, dtype=np.int64), np.fromiter((x.mask_pos for x in items), np.int64, n)
