"""Each query's distance scale (`neighbour_scale`) is np.median of its neighbours' distances, exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from bertknn.core.calibration import neighbour_scale

distances = st.sampled_from([np.float32, np.float64]).flatmap(
    lambda dtype: arrays(dtype, st.integers(1, 300), elements=st.floats(0, 1e4, width=32))
)


@given(distances)
def test_the_scale_is_the_median_to_the_bit(d: np.ndarray) -> None:
    before = d.copy()
    assert neighbour_scale(d) == float(np.median(d))
    assert np.array_equal(d, before)  # the caller's distances are left in their order (nearest first)


def test_no_neighbours_have_no_scale() -> None:
    assert neighbour_scale(np.zeros(0, np.float32)) == 0.0
    assert neighbour_scale(np.array([2.0, 4.0], np.float32)) == 3.0
    assert neighbour_scale(np.array([9.0, 1.0, 5.0], np.float32)) == 5.0
