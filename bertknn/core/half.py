"""Float16 conversion with numpy's rounding, without numpy's slow path for results below float16's normal range.

numpy converts to float16 in software and, for every result that is subnormal or rounds to zero, raises the
floating-point underflow flag by an arithmetic operation on denormals: for a cached p_MLM head, whose entries are
mostly below float16's smallest normal value, that cost more than the rest of the encoding
(docs/decisions/float16-cast.md). torch's conversion gives the same bits without it.
"""

from __future__ import annotations

import numpy as np
import torch


def _round_to_odd_float32(x: np.ndarray) -> np.ndarray:
    """``x`` (float64) as float32, rounded to odd: truncated, and the last bit set when that was inexact.

    Rounding that to float16 (to nearest, ties to even) gives what rounding ``x`` itself would, since float32 keeps
    more than two bits beyond float16's; rounding to nearest twice would not, near a float16 tie."""
    with np.errstate(over="ignore", invalid="ignore"):  # beyond float32: inf, stepped back to its largest below
        near = x.astype(np.float32)
    back = near.astype(np.float64)
    bits = near.view(np.uint32).copy()
    bits -= (np.abs(back) > np.abs(x)).astype(np.uint32)  # rounded away from zero: one step back toward it
    bits |= (back != x).astype(np.uint32)  # inexact: the sticky bit
    return bits.view(np.float32)


def to_half(x: np.ndarray) -> np.ndarray:
    """``x`` as float16, bit for bit as ``x.astype(np.float16)`` (to nearest, ties to even; overflow to inf), but for
    a NaN: a NaN of the same sign, quiet (numpy keeps a signalling NaN's payload bits)."""
    arr = np.asarray(x)
    if arr.dtype == np.float16:
        return arr
    if arr.dtype == np.float64:
        arr = _round_to_odd_float32(arr)
    elif arr.dtype != np.float32:
        return arr.astype(np.float16)
    if not (arr.flags.c_contiguous and arr.flags.writeable):  # what torch.from_numpy takes without a warning
        arr = arr.copy()
    return torch.from_numpy(arr).to(torch.float16).numpy()
