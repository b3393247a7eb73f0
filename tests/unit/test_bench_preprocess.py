"""``python -m bench.preprocess``: the rates per core from a build's closing summary."""

from __future__ import annotations

import bench.preprocess as preprocess


def test_rates_per_core_come_from_the_stage_times() -> None:
    stages = {"decompress": {"seconds": 0.5, "bytes": 10_000_000}, "parse": {"seconds": 0.1, "pages": 50},
              "markup": {"seconds": 4.0, "articles": 8}, "split": {"seconds": 2.0, "sentences": 900},
              "targets": {"seconds": 2.0, "contexts": 20_000}, "write": {"seconds": 0.2, "contexts": 20_000}}  # fmt: skip
    summary = {"stages": stages, "articles": 8, "sentences": 900, "contexts": 20_000, "bytes_per_context": 1_500.0}
    out = preprocess.per_core(summary)
    assert out["per_core"] == {
        "decompress_bytes_per_s": 20_000_000.0, "parse_bytes_per_s": 100_000_000.0, "markup_bytes_per_s": 2_500_000.0,
        "markup_articles_per_s": 2.0, "split_contexts_per_s": 10_000.0, "targets_contexts_per_s": 10_000.0,
        "write_bytes_per_s": 150_000_000.0,
    }  # fmt: skip
    assert out["xml_mb_per_s"] == {"decompress": 20.0, "parse": 100.0, "markup": 2.5}
    # the workers' stages: 8 s for 20,000 contexts; markup half of it
    assert out["workers_contexts_per_s"] == 2_500.0
    assert out["workers_share"] == {"markup": 0.5, "split": 0.25, "targets": 0.25}
    assert out["contexts_per_xml_byte"] == 0.002
