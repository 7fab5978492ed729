"""Areas of the suite that need something a machine may lack: Debian's chromium (the browser
tests), root and ``ip netns`` (the namespace and relay beds), the SmolLM2 GGUF (the real-model
tests). Their tests skip through ``skip_area``, so that a run can say which areas it did
not cover: tests/conftest.py prints one loud line per run for them, and with
MESHNET_REQUIRE_ALL_AREAS=1 (set by .ci/run) the run fails, so that CI never passes on a
machine that quietly ran a part of the suite."""
from __future__ import annotations

import re

import pytest

REQUIRE_ENV = "MESHNET_REQUIRE_ALL_AREAS"  # "1": a skipped area fails the run
_TAG = re.compile(r"\[area ([\w-]+)\] ")


def area_reason(area: str, why: str) -> str:
    """A skip reason that names its area (what ``skipped_areas`` reads back)."""
    return f"[area {area}] {why}"


def skip_area(area: str, why: str, module: bool = False) -> None:
    """Skip this test (or, with ``module``, the module being collected) as part of ``area``."""
    pytest.skip(area_reason(area, why), allow_module_level=module)


def skipped_areas(reports) -> dict[str, str]:
    """area -> the first reason it was skipped for, from pytest's skipped reports."""
    areas: dict[str, str] = {}
    for report in reports:
        longrepr = getattr(report, "longrepr", None)
        text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
        if match := _TAG.search(text):
            areas.setdefault(match.group(1), text[match.end():])
    return areas
