"""A real browser for the playground's tests: headless Chromium (Debian's package) driven by Selenium; screenshots
kept in ``runs/test-artifacts`` (``BERT_KNN_TEST_ARTIFACTS``)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("BERT_KNN_TEST_ARTIFACTS", REPO / "runs" / "test-artifacts"))


def chromium() -> Iterator[Any]:
    """The driver (the ``browser`` fixture's body); the test fails, saying why, where there is no browser."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_bin = shutil.which("chromedriver")
    if chromium is None or driver_bin is None:
        pytest.fail(
            "the playground test needs a real browser: Debian's chromium and chromium-driver packages "
            "(scripts/bootstrap.sh installs them with apt where it can); neither may be skipped"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    opts = Options()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1100,1300"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_bin), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def wait(driver: Any, css: str, timeout: float = 30) -> list[Any]:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(ec.visibility_of_element_located((By.CSS_SELECTOR, css)))
    return driver.find_elements(By.CSS_SELECTOR, css)


def shot(driver: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    assert driver.save_screenshot(str(path)) and path.stat().st_size > 10_000
    return path
