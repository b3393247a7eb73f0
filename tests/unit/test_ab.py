"""bench.ab's statistics and its argument checks (the A/B run itself starts two services: see the README)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.ab import main, paired_summary


def test_paired_summary_finds_a_shift_hidden_in_drift() -> None:
    rng = np.random.default_rng(1)
    drift = rng.uniform(10, 20, 400)  # the host's speed moves both sides of each pair together
    a = drift + 0.3 + rng.normal(0, 0.05, 400)
    b = drift + rng.normal(0, 0.05, 400)
    s = paired_summary(list(a), list(b))
    assert s["median_a_minus_b_ms"] == pytest.approx(0.3, abs=0.02)
    assert s["ci95_low_ms"] < 0.3 < s["ci95_high_ms"] and s["ci95_high_ms"] - s["ci95_low_ms"] < 0.05
    assert abs(s["a_p50_ms"] - s["b_p50_ms"]) < 1.5 and s["n"] == 400
    same = paired_summary(list(b), list(b))
    assert same["median_a_minus_b_ms"] == 0.0 and same["ci95_low_ms"] == same["ci95_high_ms"] == 0.0
    with pytest.raises(ValueError, match="same"):
        paired_summary([1.0, 2.0], [1.0])


def test_ab_refuses_a_directory_that_is_not_a_checkout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--a", str(tmp_path)])
    assert exc.value.code == 2 and "not a checkout of this project" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--a", str(Path(__file__).resolve().parents[2]), "--queries", "3"])
    assert exc.value.code == 2 and "--queries must be at least 20" in capsys.readouterr().err
