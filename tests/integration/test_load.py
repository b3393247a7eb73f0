"""The bounded load test (bench/load.py): a short run in the suite, the 64-client 60-second run behind `slow`."""

from __future__ import annotations

import pytest

from bench.load import run_load
from tests.conftest import TINY_ARTICLES
from tests.integration.test_limits import build_linked


def _tiny_lama(tmp_path, articles=TINY_ARTICLES, name="lama"):
    """A LAMA-shaped directory whose facts are the corpus's (the tiny one by default), so the queries make sense to
    the tiny model."""
    import json

    lama = tmp_path / name
    (lama / "TREx").mkdir(parents=True)
    (lama / "relations.jsonl").write_text(json.dumps({"relation": "P19", "template": "[X] was born in [Y] ."}) + "\n")
    facts = [{"sub_label": a["title"], "obj_label": "x"} for a in articles]
    (lama / "TREx" / "P19.jsonl").write_text("".join(json.dumps(f) + "\n" for f in facts))
    return lama


def _check(r):
    assert r["errors"] == 0 and r["mismatches"] == 0
    assert r["ok"] > 0 and r["ok"] + r["overloaded_503"] == r["requests"]


def test_short_load_no_errors_same_answers(tiny_datastore, tmp_path):
    r = run_load(tiny_datastore, clients=16, duration=6, n_queries=6, max_queue=8, lama=_tiny_lama(tmp_path))
    _check(r)


@pytest.mark.slow
def test_long_load_64_clients_60s_memory_flat(tiny_datastore, tmp_path):
    r = run_load(tiny_datastore, clients=64, duration=60, n_queries=6, max_queue=32, lama=_tiny_lama(tmp_path))
    _check(r)
    assert r["rss_growth"] < 0.05


def test_an_abusive_client_gets_refusals_while_the_others_get_answers(tmp_path):
    """bench.load --abuse in short: one client sending only the costliest requests beside four ordinary ones (the
    tiny model on a linked datastore; the p99 ratio is the benchmark's figure, docs/performance.md)."""
    from bench.abuse import run_abuse
    from tests.integration.test_entities import ARTICLES

    lama = _tiny_lama(tmp_path, ARTICLES, "lama-linked")
    r = run_abuse(build_linked(tmp_path / "linked"), clients=4, duration=4, lama=lama)
    abuser = r["with_abuser"]["codes"]["abuser"]
    assert r["ordinary_errors"] == 0 and r["responses_5xx"] == 0 and r["lost"] == 0, r
    assert abuser.get("422", 0) > 0 and abuser.get("200", 0) > 0, abuser  # over the caps refused, within run
    assert r["alone"]["ordinary_ok"] > 0 and r["with_abuser"]["ordinary_ok"] > 0

