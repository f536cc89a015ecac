"""Runtime dotted paths are checked at startup without importing them; a path known not to
resolve makes the backend unavailable, so the policy never plans it."""

from __future__ import annotations

import sys
import textwrap

import pytest

from attnreg.cli import main
from attnreg.graph_policy import BackendChoice, ModelFacts, resolve
from attnreg.registry import GraphPolicyError, RuntimeState, load_registry
from attnreg.registry.resolution import check_runtime, locate_module


@pytest.fixture
def tmp_modules(tmp_path, monkeypatch):
    """Write modules under a fresh sys.path entry: ``tmp_modules({"pkg/__init__.py": src})``."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written: list[str] = []

    def write(files: dict[str, str]) -> None:
        for rel, source in files.items():
            path = tmp_path / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(source))
            written.append(rel.split("/")[0].removesuffix(".py"))

    yield write
    for name in [m for m in sys.modules if m.split(".")[0] in written]:
        del sys.modules[name]


def test_every_builtin_runtime_resolves_without_being_imported():
    reg = load_registry(autoload=False)
    for name in reg.names():
        module = reg.get(name).runtime.partition(":")[0]
        if module in sys.modules:
            continue  # imported by an earlier test: the check is then an attribute lookup
        assert reg.runtime_check(name).state is RuntimeState.RESOLVES, name
        assert module not in sys.modules


@pytest.mark.parametrize("runtime,state,detail", [
    ("attnreg_no_such_pkg.runtime:Backend", "missing",
     "no module named 'attnreg_no_such_pkg.runtime'"),
    ("nocolon", "missing", "not of the form 'package.module:ClassName'"),
    ("pkg_ok.runtime:Missing", "missing", "module 'pkg_ok.runtime' defines no 'Missing'"),
    ("pkg_ok.runtime:Backend", "resolves", ""),
    ("pkg_ok.runtime:Imported", "resolves", ""),
    ("pkg_ok.runtime:Optional", "resolves", ""),
    ("pkg_ok.star:Anything", "not_checked", "may define 'Anything' dynamically"),
    ("pkg_ok.broken:Other", "missing", "module 'pkg_ok.broken' has a syntax error (line 1)"),
])
def test_static_check(tmp_modules, runtime, state, detail):
    tmp_modules({
        "pkg_ok/__init__.py": "",
        "pkg_ok/runtime.py": """
            from collections import (
                OrderedDict as Imported,
            )
            try:
                from fast import Optional
            except ImportError:
                Optional = None

            class Backend:
                pass
        """,
        "pkg_ok/star.py": "from os.path import *\n",
        "pkg_ok/broken.py": "class Backend(:\n",
    })
    check = check_runtime(runtime)
    assert check.state.value == state
    assert detail in check.detail


def test_an_extension_module_is_not_checked_rather_than_guessed():
    check = check_runtime("_json:NoSuchThing")  # a C module: no source to read
    if "_json" in sys.modules:
        assert check.state is RuntimeState.MISSING  # imported already: a real lookup
    else:
        assert check.state is RuntimeState.NOT_CHECKED


def test_locating_a_module_runs_no_package_code(tmp_modules):
    tmp_modules({"pkg_exits/__init__.py": "raise SystemExit('imported!')\n",
                 "pkg_exits/runtime.py": "class Backend: ...\n"})
    spec = locate_module("pkg_exits.runtime")
    assert spec is not None and spec.origin.endswith("runtime.py")
    assert "pkg_exits" not in sys.modules
    assert check_runtime("pkg_exits.runtime:Backend").state is RuntimeState.RESOLVES
    assert locate_module("pkg_exits.nothing") is None


def test_an_unresolved_runtime_is_unavailable_and_never_planned(fake_site):
    reg = load_registry(allow=["thirdparty"], disable=["greedy_mla"])
    a = reg.availability("ghost_mla", "cuda:sm90", assume_installed=True)
    assert not a.available and a.runtime.missing
    assert a.reason == ("its runtime 'attnreg_thirdparty.runtime:GhostBackend' does not resolve "
                        "(module 'attnreg_thirdparty.runtime' defines no 'GhostBackend'); plugin "
                        "'thirdparty' (attnreg-thirdparty 2.0.0) is incomplete: reinstall or "
                        "fix it")
    # ghost_mla (priority 35) outranks every built-in available on a CPU: unchecked, it
    # would be the default.
    plan = resolve("cpu", ModelFacts(), registry=reg, assume_installed=True)
    assert plan.decode.backend in {"reference", "triton"}
    with pytest.raises(GraphPolicyError, match="ghost_mla cannot run on cpu: its runtime"):
        resolve("cpu", ModelFacts(), BackendChoice(prefill="ghost_mla", decode="ghost_mla"),
                registry=reg, assume_installed=True)


def test_backends_check_fails_on_an_unresolved_runtime(fake_site, monkeypatch, capsys):
    monkeypatch.setenv("ATTNREG_PLUGINS", "thirdparty")
    assert main(["backends", "--platform", "cpu", "--check", "--wide"]) == 1  # rows unwrapped
    out = capsys.readouterr().out
    ghost = next(line for line in out.splitlines() if line.startswith("ghost_mla"))
    assert "missing" in ghost and "attnreg-thirdparty 2.0.0" in ghost
    monkeypatch.setenv("ATTNREG_PLUGINS", "")
    assert main(["backends", "--platform", "cpu", "--check"]) == 0
    assert "resolves" in capsys.readouterr().out


def test_doctor_shows_each_runtime_and_whether_it_resolves(fake_site, monkeypatch, capsys):
    monkeypatch.setenv("ATTNREG_PLUGINS", "thirdparty")
    assert main(["doctor", "--json"]) == 0
    import json

    backends = json.loads(capsys.readouterr().out)["backends"]
    assert backends["ghost_mla"]["runtime_check"] == {
        "state": "missing",
        "detail": "module 'attnreg_thirdparty.runtime' defines no 'GhostBackend'"}
    assert backends["reference"]["runtime_check"]["state"] == "resolves"
    assert (backends["ghost_mla"]["distribution"], backends["ghost_mla"]["version"]) == \
        ("attnreg-thirdparty", "2.0.0")
