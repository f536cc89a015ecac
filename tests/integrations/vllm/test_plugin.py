"""The entry point through vLLM's own plugin loader, the switch and the release check."""

from __future__ import annotations

import logging

import pytest

from .conftest import HAS_VLLM, SKIP_REASON

if not HAS_VLLM:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from attnreg.integrations.vllm import hooks, plugin


def test_vllms_loader_finds_the_entry_point() -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    assert DEFAULT_PLUGINS_GROUP == "vllm.general_plugins"
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP)["attnreg"] is plugin.register


def test_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ATTNREG_VLLM", raising=False)
    plugin.register()
    assert not hooks.installed()


def test_on_installs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTNREG_VLLM", "1")
    try:
        plugin.register()
        assert hooks.installed()
    finally:
        hooks.uninstall()


def test_an_untested_release_stands_aside(monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    import vllm

    monkeypatch.setenv("ATTNREG_VLLM", "1")
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with caplog.at_level(logging.WARNING, logger="vllm.attnreg"):
        plugin.register()
    assert not hooks.installed()
    assert "NOT installed: vLLM 0.34.0" in caplog.text
