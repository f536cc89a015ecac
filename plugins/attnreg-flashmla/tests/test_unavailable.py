"""Without a GPU or without `flash_mla` the backend is unavailable with the reason, never a crash."""

from __future__ import annotations

import importlib.util
import json

import pytest
from attnreg import BackendUnavailableError

from attnreg_flashmla.declaration import BACKEND_NAME, FLASH_MLA

HAS_FLASH_MLA = importlib.util.find_spec("flash_mla") is not None
#: Simulated environments: the versions attnreg sees, independent of this machine.
WITH_LIBRARY = {"sgl-flash-mla": "1.0.0", "torch": "2.11.0"}
WITHOUT_LIBRARY = {"sgl-flash-mla": None, "torch": "2.11.0"}


def test_available_on_sm90_with_the_library(registry):
    avail = registry.availability(BACKEND_NAME, "cuda:sm90", WITH_LIBRARY)
    assert avail.available, avail.reason


def test_without_the_library_the_reason_is_an_install_hint(registry):
    avail = registry.availability(BACKEND_NAME, "cuda:sm90", WITHOUT_LIBRARY)
    assert not avail.available
    assert avail.reason == ("sgl-flash-mla not installed: "
                            "pip install --no-deps 'sgl-flash-mla>=1.0.0'")
    assert FLASH_MLA.install_hint() in avail.reason


def test_an_older_library_is_not_enough(registry):
    avail = registry.availability(BACKEND_NAME, "cuda:sm90",
                                  {"sgl-flash-mla": "0.9.0", "torch": "2.11.0"})
    assert not avail.available and FLASH_MLA.install_hint() in avail.reason


def test_without_a_gpu_the_platform_reason_comes_first(registry):
    avail = registry.availability(BACKEND_NAME, "cpu", WITHOUT_LIBRARY)
    assert not avail.available
    assert avail.reason.startswith("FlashMLA is a CUDA library")
    assert avail.reason.endswith(FLASH_MLA.install_hint())


def test_creating_it_on_cpu_raises_unavailable_before_importing_anything(registry):
    from attnreg.runtime import MLAConfig

    with pytest.raises(BackendUnavailableError, match="FlashMLA is a CUDA library"):
        registry.create(BACKEND_NAME, MLAConfig(num_heads=16, page_size=64), platform="cpu")


@pytest.mark.skipif(HAS_FLASH_MLA, reason="flash_mla is installed here")
def test_backends_command_gives_the_hint_on_this_machine(cli):
    # the detected platform: an explicit one would assume the libraries installed
    proc = cli("backends", "--json")
    assert proc.returncode == 0, proc.stderr
    (entry,) = [b for b in json.loads(proc.stdout)["backends"] if b["name"] == BACKEND_NAME]
    assert entry["available"] is False
    assert f"sgl-flash-mla not installed: {FLASH_MLA.install_hint()}" in entry["unavailable_reason"]
