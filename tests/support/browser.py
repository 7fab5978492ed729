"""Where the browser tests find Debian's chromium and how they start it; the ``browser``
fixture in tests/conftest.py and tests/test_dashboard_browser.py share these."""
from __future__ import annotations

import importlib.util
import shutil

CHROMIUM = shutil.which("chromium")  # Debian's, /usr/bin/chromium; None where no chromium is on PATH
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    if importlib.util.find_spec("playwright") is None:
        return "Playwright for Python is not installed (pip install playwright; never run `playwright install`)"
    if CHROMIUM is None:
        return "no chromium on PATH (apt-get install -y chromium; scripts/install.sh --test does it)"
    return None
