"""Fixtures that several integration modules share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.browser import chromium


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium driven by Selenium (`tests.support.browser`)."""
    yield from chromium()
