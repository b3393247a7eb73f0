"""`to_half`: numpy's float16 bits, for float32 and float64 input, ties and subnormals included."""

from __future__ import annotations

import warnings

import numpy as np

from bertknn.core.half import to_half


def _numpy_half(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return x.astype(np.float16)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """The same float16 bits; a NaN only as a NaN of the same sign (torch quiets a signalling NaN)."""
    if not a.dtype == b.dtype == np.float16 or a.shape != b.shape:
        return False
    nan = np.isnan(b)
    same_nan = np.array_equal(np.isnan(a), nan) and np.array_equal(np.signbit(a[nan]), np.signbit(b[nan]))
    return same_nan and np.array_equal(a[~nan].view(np.uint16), b[~nan].view(np.uint16))


def _ties() -> np.ndarray:
    """Every midpoint between neighbouring finite float16 values of either sign (float64, exact)."""
    pos = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    mid = (pos[:-1] + pos[1:]) / 2
    return np.concatenate([mid, -mid])


def test_float32_gives_numpy_s_bits_everywhere():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 2**32, 2_000_000, dtype=np.uint64).astype(np.uint32).view(np.float32)  # any float32
    ties = _ties().astype(np.float32)  # exact in float32
    near = [(ties.view(np.uint32).astype(np.int64) + d).astype(np.uint32).view(np.float32) for d in (-1, 1)]
    specials = np.array([np.nan, np.inf, -np.inf, 65504, 65519.99, 65520, 1e30, -0.0, 0.0, 1e-45, 2.98e-8, 3e-8,
                         5.96e-8, 6.1e-5, -3e-5], np.float32)  # fmt: skip
    for arr in (x, ties, *near, specials):
        assert _same_bits(to_half(arr), _numpy_half(arr))


def test_float64_is_rounded_once_as_numpy_rounds_it():
    """A float64 just beside a float16 tie rounds to the tie in float32, and a second rounding to nearest then
    goes the wrong way half the time: `to_half` rounds to odd first, so it agrees with numpy's one rounding."""
    ties = _ties()
    nudged = np.concatenate([np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf), ties * (1 + 2**-40)])
    twice = _numpy_half(nudged.astype(np.float32))
    assert not _same_bits(twice, _numpy_half(nudged)), "no case here that double rounding gets wrong"
    assert _same_bits(to_half(nudged), _numpy_half(nudged))

    rng = np.random.default_rng(1)
    probs = np.exp(rng.uniform(-40, 0, 1_000_000))  # a p_MLM head's range, most of it subnormal in float16
    wide = rng.integers(0, 2**64, 1_000_000, dtype=np.uint64).view(np.float64)  # any float64
    specials = np.array([np.nan, np.inf, -np.inf, 1e300, -1e300, 1e-300, -1e-320, 0.0, -0.0, 65520.0, 3.4e38])
    for arr in (probs, wide, specials):
        assert _same_bits(to_half(arr), _numpy_half(arr))


def test_other_inputs():
    """float16 passes through; read-only, strided and 2-D arrays convert without torch's warning; integers too."""
    halves = np.array([1.5, 6e-8], np.float16)
    assert to_half(halves) is halves
    frozen = np.linspace(0, 1e-4, 7)
    frozen.flags.writeable = False
    strided = np.linspace(0, 1e-4, 14, dtype=np.float32)[::2]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for arr in (frozen, strided, np.arange(5), np.array([[1e-6, 2.0]], np.float32)):
            assert _same_bits(to_half(arr), _numpy_half(arr))
