"""bench.defaults: the settings it scores and the bar each must meet on a benchmark."""

from __future__ import annotations

import argparse

import pytest

from bench.defaults import PAPER, SHIPPED, Setting, meets, parse_settings


def test_the_paper_s_vote_and_the_shipped_defaults_come_first() -> None:
    got = parse_settings("high=0.8/0.15/10")
    assert got[:2] == [PAPER, SHIPPED] and got[2] == Setting("high", 0.8, 0.15, 10.0)
    assert got[2].knobs() == {"lambda_": 0.8, "mlm_prior": 0.15, "article_sharpness": 10.0}


@pytest.mark.parametrize("text", ["x=0.5/0.1", "x=1.5/0/0", "x=0.5/-1/0", "paper=0.3/0/0", "=0.3/0/0", "x=a/b/c"])
def test_bad_settings_are_refused_with_the_form_to_write(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="LAMBDA|lambda in"):
        parse_settings(text)


def test_the_bar_is_knn_alone_and_the_paper_s_vote_less_half_a_point_on_every_row() -> None:
    paper = {"dev": {"bert_knn": 40.0, "knn": 38.0}, "test": {"bert_knn": 30.0, "knn": 29.0}}
    assert meets({"dev": {"bert_knn": 39.5, "knn": 39.5}, "test": {"bert_knn": 31.0, "knn": 30.0}}, paper)
    assert not meets({"dev": {"bert_knn": 39.4, "knn": 39.0}, "test": {"bert_knn": 31.0, "knn": 30.0}}, paper)
    assert not meets({"dev": {"bert_knn": 41.0, "knn": 41.1}, "test": {"bert_knn": 31.0, "knn": 30.0}}, paper)
    assert not meets({"dev": {"bert_knn": 41.0, "knn": 40.0}, "test": {"bert_knn": 29.4, "knn": 29.0}}, paper)
