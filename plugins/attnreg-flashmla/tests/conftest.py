"""Shared fixtures of the plugin's tests.

The tests load the plugin through its entry point, as attnreg does in
production, so the package must be installed (``make test`` installs it with
``pip install --no-deps -e plugins/attnreg-flashmla``).  ``sgl-flash-mla`` is
not needed: it does not install on a CPU machine, and the CPU tests never
import it.  GPU tests (marker ``gpu``) skip without an sm90 device and
``flash_mla``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys

import pytest

PLUGIN = "flashmla"
DISTRIBUTION = "attnreg-flashmla"

# Other plugins installed on this machine must not change what these tests see.
os.environ.setdefault("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "1")


def _installed() -> bool:
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _sm90_with_flash_mla() -> str:
    """'' when the GPU tests can run here, else why not."""
    if importlib.util.find_spec("flash_mla") is None:
        return "flash_mla is not importable (install sgl-flash-mla)"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (none detected)"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"needs sm90; this GPU is sm{''.join(map(str, torch.cuda.get_device_capability()))}"
    return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    why = _sm90_with_flash_mla() if any("gpu" in i.keywords for i in items) else ""
    for item in items:
        if "gpu" in item.keywords and why:
            item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture(scope="session")
def registry():
    """attnreg's registry with the built-ins and only this plugin autoloaded."""
    if not _installed():
        pytest.fail(f"{DISTRIBUTION} is not installed in this environment: run "
                    "`pip install --no-deps -e plugins/attnreg-flashmla` (make test does)",
                    pytrace=False)
    from attnreg import load_registry

    return load_registry(autoload=True, allow=[PLUGIN])


def _run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items()
            if k not in ("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "ATTNREG_DISABLE",
                         "ATTNREG_PLUGINS", "ATTNREG_PLATFORM")}
    full.update({"ATTNREG_PLUGINS": PLUGIN, "COLUMNS": "200"}, **env)
    return subprocess.run([sys.executable, "-m", "attnreg", *args], capture_output=True,
                          text=True, env=full, check=False)


@pytest.fixture(scope="session")
def cli(registry):
    """``cli(*args, **env)``: ``attnreg ARGS`` in a subprocess with only this plugin autoloaded."""
    return _run_cli
