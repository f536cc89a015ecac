"""Fixtures for the vLLM bridge tests (run by `make test-vllm`).

Without vLLM installed the modules that need it are skipped with the reason
(:data:`SKIP_REASON`); the name, table and switch tests run everywhere (the
FlashMLA plugin, ``plugins/attnreg-flashmla``, installed as both venvs do).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = "vLLM is not installed: `make test-vllm` installs it in its own venv"


@pytest.fixture(scope="package", autouse=True)
def _flashmla_plugin() -> Iterator[None]:
    """Load the attnreg-flashmla plugin (vLLM's FLASHMLA maps to it) and no other:
    the project's conftest turns plugin autoload off for every test."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "0")
        mp.setenv("ATTNREG_PLUGINS", "flashmla")
        yield


@pytest.fixture
def bridge_on() -> Iterator[None]:
    """attnreg's wrappers installed for one test, vLLM's originals back after it."""
    from attnreg.integrations.vllm import hooks

    hooks.install()
    try:
        yield
    finally:
        hooks.uninstall()
