"""bench.quality's --prior-sweep: its argument and its table in quality.md."""

from __future__ import annotations

import argparse

import pytest

from bench.quality.__main__ import _md_prior_sweep, _priors, build_parser


def _macro(bert_knn: tuple[float, float], knn: tuple[float, float]) -> dict:
    return {"macro": {"bert_knn": {"p@1": bert_knn[0], "p@10": bert_knn[1]}, "knn": {"p@1": knn[0], "p@10": knn[1]}}}


def test_prior_sweep_takes_zero_and_refuses_negatives() -> None:
    assert _priors("0, 0.15,0.5") == [0.0, 0.15, 0.5]
    assert _priors("") == []
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0"):
        _priors("0.1,-0.2")
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
        _priors("0.1;0.2")
    assert build_parser().parse_args([]).prior_sweep[:2] == [0.0, 0.05]


def test_prior_sweep_table_has_one_row_per_value_from_its_own_runs() -> None:
    runs = {
        "prior_0_full": _macro((40.71, 79.93), (40.3, 84.4)),
        "prior_0_common": _macro((44.1, 82.6), (44.4, 88.6)),
        "prior_0.15_full": _macro((41.73, 79.66), (43.6, 85.9)),
        "prior_0.15_common": _macro((42.9, 81.3), (44.6, 88.5)),
    }
    sweep = [{"mlm_prior": b, "runs": {v: f"prior_{b:g}_{v}" for v in ("full", "common")}} for b in (0.0, 0.15)]
    lines = _md_prior_sweep(runs, {"prior_sweep": sweep})
    rows = [line for line in lines if line.startswith("| 0")]
    assert rows == [
        "| 0 | 40.7 / 79.9 | 40.3 / 84.4 | 44.1 / 82.6 | 44.4 / 88.6 |",
        "| 0.15 | 41.7 / 79.7 | 43.6 / 85.9 | 42.9 / 81.3 | 44.6 / 88.5 |",
    ]
    assert _md_prior_sweep(runs, {"prior_sweep": []}) == []
