"""The lab on kvledger's dashboard: a picture of ``/ui`` (the lab's own ``serve`` from its
database) once the page has drawn, taken in Debian's chromium as the dashboard's browser
test drives it (tests/helpers/browser.py). Where no browser is installed (scripts/browser
installs one), the lab says so and goes on: the picture is a record, not a measurement.
"""

from __future__ import annotations

import time
from pathlib import Path

from tests.helpers.browser import chromium, missing

DRAWN_S = 30.0  # the page's first draw, at most


def screenshot(url: str, path: Path) -> str | None:
    """Save the dashboard at ``url`` (its last hour) to ``path``; None once saved, else why
    not."""
    if (why := missing()) is not None:
        return why
    with chromium() as driver:
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
