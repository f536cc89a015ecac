"""One test per malformed-plugin kind, pinning the exact message a user reads.

Every message names the plugin (entry-point name), its distribution and
version, the kind, the cause (with the platform when only some platforms
are affected) and how to skip the plugin; every case leaves the built-ins
and the healthy ``demo`` plugin listed.
"""

from __future__ import annotations

import pytest

import attnreg
from attnreg.registry import BackendSpec, PluginError, load_registry

SKIP = "Fix or upgrade the plugin, or skip it with `--disable {p}` / ATTNREG_DISABLE={p}."


def _only_error(reg, plugin: str, backend: str | None = None) -> PluginError:
    found = [e for e in reg.errors if e.plugin == plugin and
             (backend is None or e.backend == backend)]
    assert len(found) == 1, [str(e) for e in reg.errors]
    return found[0]


def _load(plugin: str):
    reg = load_registry(allow=[plugin, "demo"])
    assert {"reference", "trtllm_mla", "demo_mla"} <= set(reg.names())
    return reg


@pytest.mark.parametrize("plugin,dist,kind,cause", [
    ("broken_import", "attnreg_broken_import 0.0.1", "import error",
     "importing attnreg_broken_import raised ModuleNotFoundError: No module named "
     "'this_module_does_not_exist_anywhere'"),
    ("exit_import", "attnreg_exit_import 0.0.1", "import error",
     "importing attnreg_exit_import called sys.exit('attnreg_exit_import refuses to load') "
     "(SystemExit)"),
    ("exit_zero", "attnreg_exit_zero 0.0.1", "import error",
     "importing attnreg_exit_zero called sys.exit(0) (SystemExit)"),
    ("bad_hook_args", "attnreg_bad_hook_args 0.0.1", "invalid hook",
     "hookimpl definition: attnreg_register_backends(regster); Argument(s) {'regster'} are "
     "declared in the hookimpl but can not be found in the hookspec (the hookspec is "
     "attnreg_register_backends(register))"),
    ("unknown_hook", "attnreg_unknown_hook 0.0.1", "unknown hook",
     "implements attnreg_register_backend, which is not an attnreg hook (did you mean "
     "attnreg_register_backends?); the hooks are: attnreg_register_backends"),
    ("raising_hook", "attnreg_raising_hook 0.0.1", "hook error",
     "attnreg_register_backends raised RuntimeError: boom from raising_hook"),
    ("exit_hook", "attnreg_exit_hook 0.0.1", "hook error",
     "attnreg_register_backends called sys.exit(3) (SystemExit)"),
])
def test_plugin_level_failures(fake_site, plugin, dist, kind, cause):
    err = _only_error(_load(plugin), plugin)
    assert str(err) == f"plugin {plugin!r} ({dist}): {kind}: {cause}. " + SKIP.format(p=plugin)
    assert (err.distribution, err.version) == tuple(dist.split(" "))


def test_a_plugin_that_fails_to_import_is_still_listed_with_its_distribution(fake_site):
    reg = _load("exit_import")
    info = reg.plugin("exit_import")
    assert info is not None and not info.loaded
    assert (info.distribution, info.version, info.module) == \
        ("attnreg_exit_import", "0.0.1", "attnreg_exit_import")


@pytest.mark.parametrize("backend,kind,cause", [
    ("rocm_arch_bug", "declaration error",
     "on rocm:gfx942, the capability function raised ValueError: invalid literal for int() "
     "with base 10: 'gfx942'"),
    ("npu_page_bug", "invalid declaration",
     "on npu: kernel torch.float32: page size 3 is not a positive power of two"),
    ("fallback_pins_mha", "invalid declaration",
     "on cpu: prefill/breakable pins mha but no mha kernel serves prefill"),
    ("fallback_ghost", "invalid declaration",
     "on cpu: prefill/breakable falls back to 'flashinfer_mlaa', which no loaded plugin "
     "registers; name a registered backend, or install the plugin that provides it"),
    ("fallback_chain", "invalid declaration",
     "on cuda: prefill/breakable falls back to 'trtllm_mla', which declares prefill/breakable "
     "FALLBACK, not NATIVE (a fallback target must run the mode itself: no chains, no cycles)"),
])
def test_declaration_level_failures(fake_site, backend, kind, cause):
    reg = _load("quirks")
    err = _only_error(reg, "quirks", backend)
    assert str(err) == (f"backend {backend!r} from plugin 'quirks' (attnreg_quirks 0.3.0): "
                        f"{kind}: {cause}. " + SKIP.format(p="quirks"))
    assert backend not in reg.names()
    with pytest.raises(PluginError) as exc:
        reg.get(backend)
    assert exc.value is err


def test_duplicate(fake_site):
    err = _only_error(_load("dup_plugin"), "dup_plugin")
    assert str(err) == (
        "backend 'reference' from plugin 'dup_plugin' (attnreg_dup_plugin 0.0.1): duplicate: "
        "backend name 'reference' is already registered by plugin 'attnreg.builtin' "
        f"(attnreg {attnreg.__version__}); names must be unique (rename one, or disable one of "
        "'attnreg.builtin' and 'dup_plugin'). " + SKIP.format(p="dup_plugin"))


def test_invalid_backend_spec_from_a_plugin_without_a_distribution():
    class Plugin:
        @attnreg.hookimpl
        def attnreg_register_backends(self, register):
            register(BackendSpec(name="Bad Name", summary="x", capabilities=len,
                                 runtime="nomodule"))

    reg = load_registry(autoload=False, extra_plugins=[("sloppy", Plugin())])
    err = _only_error(reg, "sloppy")
    assert str(err) == (
        "backend 'Bad Name' from plugin 'sloppy' (no distribution found): invalid "
        "declaration: invalid BackendSpec: backend name 'Bad Name' must match "
        "^[a-z][a-z0-9_]{0,63}$; runtime 'nomodule' must be 'package.module:ClassName'. "
        + SKIP.format(p="sloppy"))


def test_a_fallback_to_a_disabled_backend_is_not_the_plugins_fault(fake_site):
    # trtllm_mla falls back to flashinfer_mla; disabling the target leaves the
    # source registered (the graph policy then treats the target as unavailable).
    reg = load_registry(autoload=False, disable=["flashinfer_mla"])
    assert "trtllm_mla" in reg.names() and reg.errors == []


def test_each_refused_backend_carries_its_own_error(fake_site):
    reg = _load("quirks")
    refused = {e.backend for e in reg.errors if e.plugin == "quirks"}
    assert refused == {"rocm_arch_bug", "npu_page_bug", "fallback_pins_mha",
                       "fallback_ghost", "fallback_chain"}


def test_capabilities_requires_is_deprecated_not_refused(fake_site):
    # attnreg 0.1.0's Capabilities(requires=...): it loads, merged into the spec, and
    # the plugin is listed (doctor) as using a deprecated form.
    with pytest.warns(DeprecationWarning, match=r"Capabilities\(requires=\.\.\.\) of backend "
                      "'legacy_requires' is deprecated since attnreg 0.2.0"):
        reg = _load("quirks")
    assert "legacy_requires" in reg.names()
    assert [r.distribution for r in reg.get("legacy_requires").requires] == ["torch"]
    info = reg.plugin("quirks")
    assert info is not None and len(info.deprecations) == 1
    assert info.deprecations[0].startswith("Capabilities(requires=...) of backend "
                                           "'legacy_requires'")
