"""The lab on kvledger's dashboard: a picture of ``/ui`` (the lab's own ``serve`` from its
database) once the page has drawn, taken in Debian's chromium through Selenium, as the
dashboard's browser test drives it. Where no browser is installed (scripts/browser installs
one), the lab says so and goes on: the picture is a record, not a measurement.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

DRAWN_S = 30.0  # the page's first draw, at most


def screenshot(url: str, path: Path) -> str | None:
    """Save the dashboard at ``url`` (its last hour) to ``path``; None once saved, else why
    not."""
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        return "no chromium/chromedriver here (scripts/browser installs them)"
    os.environ["SE_OFFLINE"] = "true"  # never let Selenium fetch a browser or driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,2200"):  # fmt: skip
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        driver.get(f"{url}/ui")
        deadline = time.monotonic() + DRAWN_S
        drawn = "return !!(window.kvledgerDashboard && window.kvledgerDashboard.state.last)"
        while not driver.execute_script(drawn):
            if time.monotonic() > deadline:
                return f"the dashboard did not draw within {DRAWN_S:.0f} s"
            time.sleep(0.2)
        time.sleep(1.0)  # the charts' entry animation
        path.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(path))
        return None
    finally:
        driver.quit()
