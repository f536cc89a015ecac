"""Without their kernel library the three backends are listed as unavailable with an
install hint, their runtime modules still import, and building one raises a
:class:`BackendUnavailableError` that says what to install -- never a raw traceback."""

from __future__ import annotations

import importlib
import sys

import pytest

from attnreg.registry import BackendUnavailableError, load_registry
from attnreg.runtime import MLAConfig

LIBS = {
    # backend: (runtime module, class, modules to hide, install hint)
    "flashinfer_mla": ("attnreg.backends.flashinfer_mla", "FlashInferMLABackend",
                       ("flashinfer",), "install attnreg[flashinfer]"),
    "trtllm_mla": ("attnreg.backends.trtllm_mla", "TRTLLMMLABackend",
                   ("flashinfer",), "install attnreg[flashinfer]"),
    "flash_attn_cute": ("attnreg.backends.flash_attn_cute", "FlashAttnCuteBackend",
                        ("flash_attn", "flash_attn.cute"), "install attnreg[flash-attn-cute]"),
}
PLATFORM = {"flashinfer_mla": "cuda:sm90", "trtllm_mla": "cuda:sm100",
            "flash_attn_cute": "cuda:sm90"}


@pytest.fixture(scope="module")
def reg():
    return load_registry(autoload=False)


def _hide(monkeypatch: pytest.MonkeyPatch, modules: tuple[str, ...]) -> None:
    # a None entry in sys.modules makes `import name` raise ImportError
    for name in modules:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("name", sorted(LIBS))
def test_listed_unavailable_with_install_hint(reg, name: str) -> None:
    dist = {"flashinfer_mla": "flashinfer-python", "trtllm_mla": "flashinfer-python",
            "flash_attn_cute": "flash-attn-4"}[name]
    a = reg.availability(name, PLATFORM[name], versions={dist: None})
    if a.available:
        pytest.skip(f"{dist} is installed here")
    assert not a.available
    assert LIBS[name][3] in a.reason
    assert a.capabilities is not None and a.capabilities.kernels  # the declaration still reads


@pytest.mark.parametrize("name", sorted(LIBS))
def test_runtime_module_imports_without_the_library(monkeypatch, name: str) -> None:
    module, cls, hidden, _ = LIBS[name]
    _hide(monkeypatch, hidden)
    monkeypatch.delitem(sys.modules, module, raising=False)
    mod = importlib.import_module(module)
    assert hasattr(mod, cls)


@pytest.mark.parametrize("name", sorted(LIBS))
def test_building_without_the_library_says_what_to_install(reg, monkeypatch, name: str) -> None:
    module, cls, hidden, hint = LIBS[name]
    _hide(monkeypatch, hidden)
    runtime = getattr(importlib.import_module(module), cls)
    cfg = MLAConfig(num_heads=16, page_size=32)
    with pytest.raises(BackendUnavailableError) as err:
        runtime(cfg, capabilities=reg.declaration(name, PLATFORM[name]))
    assert hint in str(err.value) and err.value.name == name


@pytest.mark.parametrize("name", sorted(LIBS))
def test_registry_create_raises_unavailable_not_a_traceback(reg, monkeypatch, name: str) -> None:
    _hide(monkeypatch, LIBS[name][2])
    cfg = MLAConfig(num_heads=16, page_size=32)
    with pytest.raises(BackendUnavailableError) as err:
        reg.create(name, cfg, platform=PLATFORM[name])
    assert LIBS[name][3] in str(err.value)
