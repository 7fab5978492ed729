"""Where the browser tests find Debian's chromium and how they start it; the ``browser``
fixture in tests/conftest.py and the ``area`` check (tests/support/areas.py) share these."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here (None: they can)."""
    if importlib.util.find_spec("playwright") is None:
        return "Playwright for Python is not installed (pip install playwright; never run `playwright install`)"
    if not (Path(CHROMIUM).is_file() and os.access(CHROMIUM, os.X_OK)):
        return (f"Debian's chromium is not installed at {CHROMIUM} "
                "(apt-get install -y chromium; scripts/install.sh --test does it)")
    return None
