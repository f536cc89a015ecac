"""Plugin loading: order, blocks, allowlist, entry points, and every broken-plugin kind."""

from __future__ import annotations

import pytest

import attnreg
from attnreg.backends.declarations import reference
from attnreg.registry import (
    BackendSpec,
    BackendUnavailableError,
    PluginError,
    UnknownBackendError,
    load_registry,
)


def _errors_by_plugin(reg):
    return {e.plugin: e for e in reg.errors}


def test_autoload_off_loads_only_builtins(fake_site):
    reg = load_registry(autoload=False)
    assert [p.name for p in reg.plugins] == ["attnreg.builtin"]
    assert "demo_mla" not in reg.names()


def test_entry_point_plugin_appears_with_its_distribution(fake_site):
    reg = load_registry(allow=["demo"])
    spec = reg.get("demo_mla")
    assert (spec.plugin, spec.distribution, spec.distribution_version) == \
        ("demo", "attnreg_demo_plugin", "1.2.3")
    info = {p.name: p for p in reg.plugins}["demo"]
    assert info.module == "attnreg_demo_plugin" and not info.builtin
    assert info.hooks == ("attnreg_register_backends",)


def test_loading_order_is_builtins_then_entry_points(fake_site):
    reg = load_registry(allow=["demo", "attnreg_dup_plugin"])
    names = [p.name for p in reg.plugins]
    assert names[0] == "attnreg.builtin"
    assert set(names[1:]) == {"demo", "dup_plugin"}


def test_allowlist_by_distribution_name_and_empty_allowlist(fake_site, monkeypatch):
    assert "demo_mla" in load_registry(allow=["attnreg_demo_plugin"]).names()
    monkeypatch.setenv("ATTNREG_PLUGINS", "")
    reg = load_registry()
    assert [p.name for p in reg.plugins] == ["attnreg.builtin"]


def test_env_disables_autoload(fake_site, monkeypatch):
    monkeypatch.setenv("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "demo_mla" not in load_registry().names()


def test_block_by_plugin_name_skips_import(fake_site):
    reg = load_registry(disable=["broken_import"], allow=["broken_import", "demo"])
    assert "broken_import" not in _errors_by_plugin(reg)
    assert "demo_mla" in reg.names()


def test_block_by_backend_name(fake_site, monkeypatch):
    monkeypatch.setenv("ATTNREG_DISABLE", "trtllm_mla")
    reg = load_registry(autoload=False)
    assert "trtllm_mla" not in reg.names()
    with pytest.raises(BackendUnavailableError, match="disabled"):
        reg.get("trtllm_mla")


@pytest.mark.parametrize("plugin,kind,needle", [
    ("broken_import", "import error", "this_module_does_not_exist_anywhere"),
    ("raising_hook", "hook error", "boom from raising_hook"),
    ("bad_decl", "invalid declaration", "absorbed MLA is (576, 512)"),
    ("unknown_hook", "unknown hook", "attnreg_register_backend"),
    ("dup_plugin", "duplicate", "'reference' is already registered by plugin 'attnreg.builtin'"),
])
def test_each_broken_plugin_kind_is_reported_and_listing_continues(fake_site, plugin, kind,
                                                                     needle):
    reg = load_registry(allow=[plugin, "demo"])
    err = _errors_by_plugin(reg)[plugin]
    assert err.kind == kind
    assert needle in str(err)
    assert plugin in str(err) and "--disable" in str(err)
    # listing continues: built-ins and the healthy plugin are all there
    assert {"reference", "triton", "demo_mla"} <= set(reg.names())


def test_duplicate_names_both_plugins_and_keeps_the_first(fake_site):
    reg = load_registry(allow=["dup_plugin"])
    err = _errors_by_plugin(reg)["dup_plugin"]
    assert "attnreg.builtin" in str(err) and "dup_plugin" in str(err)
    assert reg.get("reference").plugin == "attnreg.builtin"


def test_asking_for_a_broken_backend_by_name_raises_its_error(fake_site):
    reg = load_registry(allow=["bad_decl"])
    with pytest.raises(PluginError, match="bad_decl"):
        reg.get("bad_decl_mla")


def test_unknown_name_suggests_the_closest():
    reg = load_registry(autoload=False)
    with pytest.raises(UnknownBackendError) as exc:
        reg.get("flashinfer_mal")
    assert exc.value.suggestions[0] == "flashinfer_mla"
    assert "Did you mean: flashinfer_mla" in str(exc.value)


def test_extra_plugins_register_through_the_same_hook():
    class Plugin:
        @attnreg.hookimpl
        def attnreg_register_backends(self, register):
            register(BackendSpec(name="ref_copy", summary="copy",
                                 capabilities=lambda ctx: reference.capabilities(ctx).__class__(
                                     **{**reference.capabilities(ctx).__dict__,
                                        "backend": "ref_copy"}),
                                 runtime="attnreg.backends.reference:ReferenceBackend"))

    reg = load_registry(autoload=False, extra_plugins=[("mine", Plugin())])
    assert reg.get("ref_copy").plugin == "mine"
    assert reg.availability("ref_copy", "cpu").available


def test_register_rejects_non_specs_with_a_reason():
    class Plugin:
        @attnreg.hookimpl
        def attnreg_register_backends(self, register):
            register({"name": "dict_backend"})
            register(BackendSpec(name="Bad Name", summary="", capabilities=None,  # type: ignore
                                 runtime="nomodule"))

    reg = load_registry(autoload=False, extra_plugins=[("sloppy", Plugin())])
    causes = " ".join(e.cause for e in reg.errors)
    assert "takes a BackendSpec" in causes
    assert "must match" in causes and "'package.module:ClassName'" in causes


def test_a_capability_function_that_raises_is_a_plugin_error():
    def explode(ctx):
        raise ZeroDivisionError("declared badly")

    class Plugin:
        @attnreg.hookimpl
        def attnreg_register_backends(self, register):
            register(BackendSpec(name="exploder", summary="x", capabilities=explode,
                                 runtime="a.b:C"))

    reg = load_registry(autoload=False, extra_plugins=[("exploding", Plugin())])
    err = _errors_by_plugin(reg)["exploding"]
    assert "ZeroDivisionError: declared badly" in err.cause


def test_missing_runtime_module_is_unavailable_not_a_crash():
    def caps(ctx):
        import dataclasses
        return dataclasses.replace(reference.capabilities(ctx), backend="ghost")

    class Plugin:
        @attnreg.hookimpl
        def attnreg_register_backends(self, register):
            register(BackendSpec(name="ghost", summary="no runtime", capabilities=caps,
                                 runtime="attnreg_no_such_module:Backend"))

    reg = load_registry(autoload=False, extra_plugins=[("ghostly", Plugin())])
    assert not reg.availability("ghost", "cpu").available
    with pytest.raises(BackendUnavailableError,
                       match="does not resolve .no module named 'attnreg_no_such_module'"):
        reg.load("ghost", "cpu")


def test_a_runtime_that_fails_at_import_is_reported_by_load(fake_site):
    # The module exists (so startup says it resolves) but importing it fails.
    def caps(ctx):
        import dataclasses
        return dataclasses.replace(reference.capabilities(ctx), backend="fragile")

    class Plugin:
        @attnreg.hookimpl
        def attnreg_register_backends(self, register):
            register(BackendSpec(name="fragile", summary="runtime raises at import",
                                 capabilities=caps,
                                 runtime="attnreg_fragile_runtime:Backend"))

    reg = load_registry(autoload=False, extra_plugins=[("fragile_plugin", Plugin())])
    with pytest.raises(BackendUnavailableError, match="could not be imported"):
        reg.load("fragile", "cpu")


def _spec_requiring(distribution: str, import_name: str, min_version: str | None = None):
    from attnreg.registry import Requirement

    return BackendSpec(name="needy", summary="needs a library", capabilities=reference.capabilities,
                       runtime="attnreg.backends.reference:ReferenceBackend",
                       requires=(Requirement(import_name, distribution, min_version),))


def test_a_given_version_overrides_what_is_importable_here():
    from attnreg.registry import DeclarationContext, Platform

    # "json" is always importable; an explicit None in versions still means "not installed".
    spec = _spec_requiring("attnreg-no-such-dist", "json")
    assert spec.missing_requirements(DeclarationContext(Platform.parse("cpu"))) == []
    simulated = DeclarationContext(Platform.parse("cpu"), {"attnreg-no-such-dist": None})
    assert [r.distribution for r in spec.missing_requirements(simulated)] == [
        "attnreg-no-such-dist"]


def test_a_version_below_the_minimum_is_missing():
    from attnreg.registry import DeclarationContext, Platform

    spec = _spec_requiring("somelib", "json", min_version="1.2")
    old = DeclarationContext(Platform.parse("cpu"), {"somelib": "1.1.9"})
    new = DeclarationContext(Platform.parse("cpu"), {"somelib": "1.10.0"})
    assert spec.missing_requirements(old) == list(spec.requires)
    assert spec.missing_requirements(new) == []
