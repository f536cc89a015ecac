"""The hook is called through pluggy's caller: ordering marks, wrappers and tracing work.

Isolation must survive that: one plugin's failure is recorded against it and
the call goes on to the next implementation.
"""

from __future__ import annotations

import dataclasses

import pytest

import attnreg
from attnreg.backends.declarations import reference
from attnreg.registry import BackendSpec, load_registry, manager


def _spec(name: str) -> BackendSpec:
    def capabilities(ctx):
        return dataclasses.replace(reference.capabilities(ctx), backend=name, priority=-1)
    return BackendSpec(name=name, summary=name, capabilities=capabilities,
                       runtime="attnreg.backends.reference:ReferenceBackend")


class Plain:
    @attnreg.hookimpl
    def attnreg_register_backends(self, register):
        register(_spec("plain_mla"))


class First:
    @attnreg.hookimpl(tryfirst=True)
    def attnreg_register_backends(self, register):
        register(_spec("first_mla"))


def _order(reg) -> list[str]:
    called = [p for p in reg.plugins if p.call_order is not None]
    return [p.name for p in sorted(called, key=lambda p: p.call_order)]


def test_builtins_trylast_puts_them_after_a_plugin_registered_before_them(monkeypatch):
    # Without trylast, pluggy calls the last registered first: the built-in,
    # registered after "early", would run first.  trylast moves it last.
    monkeypatch.setattr(manager, "BUILTIN_PLUGINS", (("early", Plain()),
                                                     *manager.BUILTIN_PLUGINS))
    reg = load_registry(autoload=False)
    assert _order(reg) == ["early", "attnreg.builtin"]
    impls = reg.pm.hook.attnreg_register_backends.get_hookimpls()
    assert [i.plugin_name for i in impls if i.trylast] == ["attnreg.builtin"]


def test_tryfirst_beats_registration_order():
    # "first" is registered before "plain", so without tryfirst it would run after it.
    reg = load_registry(autoload=False, extra_plugins=[("first", First()), ("plain", Plain())])
    assert _order(reg) == ["first", "plain", "attnreg.builtin"]
    assert {"first_mla", "plain_mla", "reference"} <= set(reg.names())


def test_a_wrapper_sees_one_call_around_every_plugin():
    seen: list[str] = []

    class Wrapper:
        @attnreg.hookimpl(wrapper=True)
        def attnreg_register_backends(self, register):
            seen.append("before")
            result = yield
            seen.append("after")
            return result

    reg = load_registry(autoload=False, extra_plugins=[("plain", Plain()),
                                                       ("wrapper", Wrapper())])
    assert seen == ["before", "after"]
    assert {"plain_mla", "reference"} <= set(reg.names()) and reg.errors == []


def test_a_wrapper_that_raises_is_blamed_and_nothing_else_breaks():
    class Broken:
        @attnreg.hookimpl(wrapper=True)
        def attnreg_register_backends(self, register):
            raise RuntimeError("wrapper broke")
            yield  # pragma: no cover

    reg = load_registry(autoload=False, extra_plugins=[("broken_wrapper", Broken())])
    [err] = reg.errors
    assert (err.plugin, err.kind) == ("broken_wrapper", "hook error")
    assert "a hook wrapper of attnreg_register_backends raised RuntimeError: wrapper broke" \
        in err.cause


def test_a_failing_plugin_does_not_stop_the_call_for_the_others():
    class Exits:
        @attnreg.hookimpl(tryfirst=True)
        def attnreg_register_backends(self, register):
            register(_spec("kept_mla"))
            raise SystemExit("bye")

    reg = load_registry(autoload=False, extra_plugins=[("plain", Plain()), ("exits", Exits())])
    assert _order(reg) == ["exits", "plain", "attnreg.builtin"]
    assert {"kept_mla", "plain_mla", "reference"} <= set(reg.names())
    [err] = reg.errors
    assert err.cause == "attnreg_register_backends called sys.exit('bye') (SystemExit)"


def test_keyboard_interrupt_is_not_swallowed():
    class Interrupted:
        @attnreg.hookimpl
        def attnreg_register_backends(self, register):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        load_registry(autoload=False, extra_plugins=[("ctrl_c", Interrupted())])


def test_duplicates_follow_loading_order_not_call_order():
    # The plugin is called before the built-in (pluggy's order), yet the
    # built-in, loaded first, keeps the name.
    class Clash:
        @attnreg.hookimpl
        def attnreg_register_backends(self, register):
            register(dataclasses.replace(_spec("reference")))

    reg = load_registry(autoload=False, extra_plugins=[("clash", Clash())])
    assert reg.get("reference").plugin == "attnreg.builtin"
    [err] = reg.errors
    assert (err.plugin, err.kind) == ("clash", "duplicate")


def test_tracing_shows_the_hook_call(monkeypatch, capsys):
    monkeypatch.setenv("ATTNREG_TRACE_HOOKS", "1")
    load_registry(autoload=False, extra_plugins=[("plain", Plain())])
    err = capsys.readouterr().err
    assert "attnreg_register_backends" in err and "finish" in err


def test_the_plugin_manager_holds_the_plugins_own_objects_behind_isolation():
    plain = Plain()
    reg = load_registry(autoload=False, extra_plugins=[("plain", plain)])
    assert reg.pm.get_plugin("plain").plugin is plain
