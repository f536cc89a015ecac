"""The startup guard: each plugin's import and hook call are timed, heavy imports named.

No test here depends on how fast the machine is: "slow" is exercised by
setting the limit to 0 (everything is slow) or leaving the default for a
plugin that does nothing; heavy imports by declaring stand-in modules heavy.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from attnreg.cli import main
from attnreg.registry import StartupLimits, load_registry

from .conftest import FAKE_SITE

FAKE_HEAVY = "attnreg_fake_heavy,attnreg_fake_heavy_too"


def test_heavy_imports_at_import_and_in_the_hook_are_attributed(fake_site, monkeypatch):
    monkeypatch.setenv("ATTNREG_HEAVY_MODULES", FAKE_HEAVY)
    reg = load_registry(allow=["heavy_import", "demo"])
    info = reg.plugin("heavy_import")
    assert info is not None
    assert info.heavy_imports == ("attnreg_fake_heavy", "attnreg_fake_heavy_too")
    assert reg.plugin("demo").heavy_imports == ()
    [warning] = reg.startup_warnings()
    assert warning.plugin == "heavy_import"
    assert warning.line().startswith(
        "attnreg: warning: plugin 'heavy_import' (attnreg_heavy_import 0.0.1) imported "
        "attnreg_fake_heavy, attnreg_fake_heavy_too at startup")
    assert "--disable heavy_import" in warning.line()


def test_over_the_time_limit_is_a_warning_and_builtins_are_exempt(fake_site, monkeypatch):
    monkeypatch.setenv("ATTNREG_SLOW_PLUGIN_SECONDS", "0")
    reg = load_registry(allow=["demo"])
    [warning] = reg.startup_warnings()
    assert warning.plugin == "demo" and "took" in warning.message and "(limit 0 s)" in \
        warning.message


def test_a_plugin_that_does_nothing_heavy_gets_no_warning(fake_site):
    reg = load_registry(allow=["demo"])
    assert reg.startup_warnings() == []
    demo = reg.plugin("demo")
    assert demo.import_seconds > 0 and demo.call_order is not None


@pytest.mark.parametrize("env,expected", [
    ({}, StartupLimits()),
    ({"ATTNREG_SLOW_PLUGIN_SECONDS": "2.5"}, StartupLimits(slow_seconds=2.5)),
    ({"ATTNREG_HEAVY_MODULES": "torch, jax"}, StartupLimits(heavy_modules=("torch", "jax"))),
    ({"ATTNREG_HEAVY_MODULES": ""}, StartupLimits(heavy_modules=())),
])
def test_limits_from_the_environment(monkeypatch, env, expected):
    for key in ("ATTNREG_SLOW_PLUGIN_SECONDS", "ATTNREG_HEAVY_MODULES"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert StartupLimits.from_env() == expected


@pytest.mark.parametrize("env", [{"ATTNREG_SLOW_PLUGIN_SECONDS": "soon"},
                                 {"ATTNREG_SLOW_PLUGIN_SECONDS": "-1"}])
def test_limits_that_do_not_parse_are_an_error_naming_the_variable(monkeypatch, env):
    from attnreg.registry.environment import EnvironmentValueError

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(EnvironmentValueError, match="ATTNREG_SLOW_PLUGIN_SECONDS="):
        StartupLimits.from_env()


def test_backends_and_compat_print_one_warning_line_doctor_shows_figures(fake_site, monkeypatch,
                                                                         capsys):
    monkeypatch.setenv("ATTNREG_PLUGINS", "heavy_import")
    monkeypatch.setenv("ATTNREG_HEAVY_MODULES", FAKE_HEAVY)
    for argv in (["backends", "--platform", "cpu"], ["compat", "--platform", "cpu"]):
        for name in [m for m in sys.modules if m.startswith("attnreg_")]:
            del sys.modules[name]  # a fresh import each time, as in a new process
        assert main(argv) == 0
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if "heavy_import" in line]
        assert len(lines) == 1 and lines[0].startswith("attnreg: warning: plugin 'heavy_import'")
    for name in [m for m in sys.modules if m.startswith("attnreg_")]:
        del sys.modules[name]
    assert main(["doctor", "--wide"]) == 0  # rows unwrapped
    captured = capsys.readouterr()
    assert captured.err == ""  # doctor reports in its own tables
    row = next(line for line in captured.out.splitlines() if line.startswith("heavy_import "))
    assert "attnreg_heavy_import 0.0.1" in row and " ms " in row
    assert "attnreg_fake_heavy, attnreg_fake_heavy_too" in row
    assert "warnings and notes: 1" in captured.out


def _run(*argv: str, plugins: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNREG_")}
    env.update(PYTHONPATH=str(FAKE_SITE), ATTNREG_PLUGINS=plugins)
    code = ("import sys; from attnreg.cli import main; rc = main(sys.argv[1:]); "
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH', file=sys.stderr); "
            "sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          env=env, timeout=120)


def test_a_plugin_importing_torch_is_named_in_a_fresh_process():
    proc = _run("compat", "--platform", "cpu", plugins="torch_import")
    assert proc.returncode == 0, proc.stderr
    assert ("attnreg: warning: plugin 'torch_import' (attnreg_torch_import 0.0.1) imported "
            "torch") in proc.stderr


def test_well_behaved_plugins_keep_startup_torch_free():
    proc = _run("backends", "--json", plugins="demo,thirdparty,quirks")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip().endswith("NO TORCH"), proc.stderr
