"""Fixtures for the sglang bridge tests (run by `make test-sglang`).

Without sglang installed every test module here is skipped with the reason
(``pytest.importorskip`` with :data:`SKIP_REASON`); with
it, the torchvision schemas are declared and sglang's argument modules
imported before any test simulates a GPU (see ``_sglang_env``).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
SKIP_REASON = "sglang is not installed: `make test-sglang` installs it in its own venv"

if HAS_SGLANG:
    from . import _sglang_env

    _sglang_env.prepare_imports()


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Model directories (config.json only) for the scenarios."""
    return _sglang_env.write_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def plugin_on() -> None:
    """attnreg's plugin loaded by sglang's own ``load_plugins()`` with the switch on.

    Once per session: sglang applies hooks once per process, as in a server.
    """
    from sglang.srt import plugins

    os.environ["ATTNREG_SGLANG"] = "1"
    plugins._plugins_loaded = False  # this process may have loaded plugins with it off
    plugins.load_plugins()
