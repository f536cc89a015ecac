"""Fixtures for registry tests: a fake site dir holding installed plugin distributions."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FAKE_SITE = Path(__file__).parent / "fake_site"


@pytest.fixture
def fake_site(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Put the test plugin distributions on sys.path (entry points become visible)."""
    monkeypatch.syspath_prepend(str(FAKE_SITE))
    monkeypatch.delenv("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("ATTNREG_PLUGINS", raising=False)
    monkeypatch.delenv("ATTNREG_DISABLE", raising=False)
    yield FAKE_SITE
    for name in list(sys.modules):
        if name.startswith("attnreg_"):
            del sys.modules[name]
