"""The README's picture of the playground: headless Chromium (Debian's package) on a running service's /ui::

    python scripts/playground_screenshot.py "http://127.0.0.1:8000/ui?text=...&subject=..." docs/img/playground.png
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path


def main(url: str, out: Path) -> int:
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    chromium, driver_bin = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_bin is None:
        print("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)", file=sys.stderr)
        return 2
    opts = Options()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1000,860", "--hide-scrollbars"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_bin), options=opts)
    try:
        driver.get(url)
        WebDriverWait(driver, 60).until(ec.visibility_of_element_located((By.CSS_SELECTOR, "#answers .answer")))
        time.sleep(0.3)
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
    finally:
        driver.quit()
    print(out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        raise SystemExit(2)
    raise SystemExit(main(sys.argv[1], Path(sys.argv[2])))
