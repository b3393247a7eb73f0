"""bench.realtext's paired comparison of two votes on the same facts."""

from __future__ import annotations

import pytest

from bench.realtext import paired_interval


def test_the_difference_is_the_macro_average_per_relation() -> None:
    rels = ["P1", "P1", "P1", "P1", "P2"]
    a = [0, 0, 1, 1, 0]  # P1 50 %, P2 0 %: macro 25
    b = [1, 0, 1, 1, 1]  # P1 75 %, P2 100 %: macro 87.5
    diff, low, high = paired_interval(rels, a, b)
    assert diff == pytest.approx(62.5)
    assert low <= diff <= high


def test_identical_votes_differ_by_nothing_and_a_flip_everywhere_is_certain() -> None:
    rels = ["P1"] * 10 + ["P2"] * 10
    same = [1, 0] * 10
    assert paired_interval(rels, same, same) == (0.0, 0.0, 0.0)
    assert paired_interval(rels, [0] * 20, [1] * 20) == (100.0, 100.0, 100.0)


def test_the_interval_widens_with_disagreement_and_is_reproducible() -> None:
    rels = ["P1"] * 20
    a = [0] * 20
    b = [1] * 10 + [0] * 10  # half the facts flip: +50, with sampling noise
    diff, low, high = paired_interval(rels, a, b)
    assert diff == 50.0 and low < 50.0 < high
    assert paired_interval(rels, a, b) == (diff, low, high)  # a fixed seed
