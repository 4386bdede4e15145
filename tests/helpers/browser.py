"""Debian's chromium, driven by Selenium through its chromedriver (scripts/browser installs
them; a browser build of a test tool's own cannot be downloaded here): the dashboard's
browser test drives it, and the lab takes its pictures of the dashboard with it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def missing() -> str | None:
    """Why no browser can be driven here (None: chromium and its chromedriver are here)."""
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        return "no chromium/chromedriver here (scripts/browser installs them)"
    return None


@contextmanager
def chromium() -> Iterator[Any]:
    """A headless chromium (1400 x 2200, its console's messages kept), quit on exit."""
    chromium_path, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium_path is None or driver_path is None:
        raise RuntimeError(missing())
    os.environ["SE_OFFLINE"] = "true"  # never let Selenium fetch a browser or driver
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium_path
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,2200"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()
