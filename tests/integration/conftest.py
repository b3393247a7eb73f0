"""Fixtures that several integration modules share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.browser import chromium


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium driven by Selenium (`tests.support.browser`)."""
    yield from chromium()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT that knows the live update's words too (several processes serve it: test_workers,
    test_split_layout)."""
    from tests.conftest import TINY_ARTICLES, corpus_words, make_tiny_bert
    from tests.integration.test_live_update import UPDATE

    return make_tiny_bert(tmp_path_factory.mktemp("workers-bert"), corpus_words(TINY_ARTICLES + UPDATE))


@pytest.fixture
def ds(tmp_path: Path, model: Path) -> Path:
    """A datastore of the tiny articles, built for each test (a test may add to it)."""
    from tests.conftest import TINY_ARTICLES, build_tiny, write_jsonl

    return build_tiny(tmp_path / "ds", [write_jsonl(tmp_path / "base.jsonl", TINY_ARTICLES)], model)
