"""The CLI with broken, heavy, greedy and unpackaged plugins: every command keeps going and
names the plugin with its distribution."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from attnreg.cli import main
from attnreg.registry import load_registry

from .conftest import FAKE_SITE


def _attnreg(*argv: str, plugins: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNREG_")}
    env.update(PYTHONPATH=str(FAKE_SITE), ATTNREG_PLUGINS=plugins)
    return subprocess.run([sys.executable, "-m", "attnreg", *argv], capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.mark.parametrize("argv", [["backends", "--platform", "cpu"], ["doctor"],
                                  ["compat", "--platform", "cuda:sm90"]])
def test_a_plugin_calling_sys_exit_at_import_stops_no_command(argv):
    proc = _attnreg(*argv, plugins="exit_import,demo")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout + proc.stderr
    assert "exit_import" in text and "attnreg_exit_import 0.0.1" in text
    assert "sys.exit('attnreg_exit_import refuses to load')" in text
    if argv[0] != "compat":
        for backend in ("demo_mla", "reference", "triton", "flashinfer_mla", "trtllm_mla"):
            assert backend in proc.stdout
    else:
        assert "graph plan for" in proc.stdout


def test_backends_table_has_separate_plugin_and_distribution_columns(fake_site, monkeypatch,
                                                                      capsys):
    monkeypatch.setenv("ATTNREG_PLUGINS", "demo,exit_zero")
    assert main(["backends", "--platform", "cpu"]) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[1].split()
    assert header[:4] == ["backend", "plugin", "distribution", "available"]
    demo = next(line for line in out.splitlines() if line.startswith("demo_mla")).split()
    assert demo[1:4] == ["demo", "attnreg_demo_plugin", "1.2.3"]
    assert ("plugin error: exit_zero (attnreg_exit_zero 0.0.1): import error: importing "
            "attnreg_exit_zero called sys.exit(0) (SystemExit)") in out


def test_backends_json_names_plugin_distribution_and_version(fake_site, monkeypatch, capsys):
    monkeypatch.setenv("ATTNREG_PLUGINS", "demo,exit_zero")
    assert main(["backends", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    demo = next(b for b in data["backends"] if b["name"] == "demo_mla")
    assert (demo["plugin"], demo["distribution"], demo["version"]) == \
        ("demo", "attnreg_demo_plugin", "1.2.3")
    assert demo["requires"][0]["install_hint"] == "pip install 'torch'"
    [err] = data["errors"]
    assert (err["plugin"], err["distribution"], err["version"], err["kind"]) == \
        ("exit_zero", "attnreg_exit_zero", "0.0.1", "import error")


def test_doctor_lists_a_plugin_that_failed_to_import(fake_site, monkeypatch, capsys):
    monkeypatch.setenv("ATTNREG_PLUGINS", "demo,exit_import")
    assert main(["doctor", "--wide"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("exit_import "))
    # plugin, distribution, version, status, ..., module (last column)
    assert row.split()[1:4] == ["attnreg_exit_import", "0.0.1", "failed"]
    assert row.split()[-1] == "attnreg_exit_import"
    assert ("  - exit_import (attnreg_exit_import 0.0.1): import error: importing "
            "attnreg_exit_import called sys.exit('attnreg_exit_import refuses to load') "
            "(SystemExit)\n    silence it: `--disable exit_import` / "
            "ATTNREG_DISABLE=exit_import") in out
    # the same within 100 columns: the cause wraps under its item
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert ("  - exit_import (attnreg_exit_import 0.0.1): import error: importing "
            "attnreg_exit_import called\n    sys.exit('attnreg_exit_import refuses to load') "
            "(SystemExit)\n    silence it:") in out
    assert max(len(line) for line in out.splitlines()) <= 100
    monkeypatch.setenv("ATTNREG_DISABLE", "exit_import")
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["errors"] == [] and "exit_import" in data["disabled"]


@pytest.mark.parametrize("name", ["attnreg_demo_plugin", "attnreg-demo-plugin",
                                  "Attnreg.Demo_Plugin"])
def test_disable_accepts_a_distribution_name(fake_site, monkeypatch, name):
    monkeypatch.setenv("ATTNREG_DISABLE", name)
    reg = load_registry(allow=["demo", "thirdparty"])
    assert "demo_mla" not in reg.names() and reg.plugin("demo") is None
    assert "acme_mla" in reg.names()


def test_plugin_option_on_backends_compat_and_doctor(fake_site, monkeypatch, capsys):
    monkeypatch.setenv("ATTNREG_PLUGINS", "")
    plugin = ["--plugin", "attnreg_unpackaged", "--plugin", "attnreg_unpackaged:SECOND"]
    assert main(["backends", "--platform", "cpu", *plugin]) == 0
    out = capsys.readouterr().out
    assert "unpackaged_mla   attnreg_unpackaged " in out
    assert "unpackaged_two   attnreg_unpackaged:SECOND " in out
    assert main(["compat", "--platform", "cpu", "--backend", "unpackaged_two", *plugin]) == 0
    assert "unpackaged_two chosen by the user" in capsys.readouterr().out
    assert main(["doctor", "--json", *plugin]) == 0
    names = [p["name"] for p in json.loads(capsys.readouterr().out)["plugins"]]
    assert names == ["attnreg.builtin", "attnreg_unpackaged", "attnreg_unpackaged:SECOND"]


def test_plugin_option_naming_no_module_is_bad_input(fake_site, capsys):
    assert main(["backends", "--plugin", "attnreg_nowhere.plugin"]) == 2
    assert capsys.readouterr().err == (
        "attnreg backends: error: --plugin attnreg_nowhere.plugin: no module named "
        "'attnreg_nowhere.plugin'; check the name, or put its directory on PYTHONPATH\n")


def test_plugin_option_keeps_isolation(fake_site, monkeypatch, capsys):
    monkeypatch.setenv("ATTNREG_PLUGINS", "")
    assert main(["backends", "--platform", "cpu", "--plugin", "attnreg_exit_zero"]) == 0
    out = capsys.readouterr().out
    assert "plugin error: attnreg_exit_zero" in out and "reference" in out


def test_a_backend_outranking_every_builtin_gets_a_visible_note(fake_site, monkeypatch, capsys):
    monkeypatch.setenv("ATTNREG_PLUGINS", "thirdparty")
    note = ("attnreg: note: backend 'greedy_mla' from plugin 'thirdparty' (attnreg-thirdparty "
            "2.0.0) declares priority 1000000, above every built-in (at most 40): it is "
            "preferred wherever it lets the requested graph mode run; choose another with --backend, or --disable "
            "greedy_mla\n")
    # Graphs off: greedy_mla cannot capture on sm90, and selection by need would pass it over.
    assert main(["compat", "--platform", "cuda:sm90", "--prefill-graph", "disabled",
                 "--decode-graph", "disabled"]) == 0
    captured = capsys.readouterr()
    assert "greedy_mla chosen for prefill" in captured.out
    assert captured.err == note
    assert main(["backends", "--platform", "cuda:sm90", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == note
    assert [w["kind"] for w in json.loads(captured.out)["warnings"]] == ["priority"]


def test_a_plugin_given_by_module_name_finds_its_distribution(fake_site):
    reg = load_registry(autoload=False, extra_plugins=[("by_name", "attnreg_demo_plugin"),
                                                       ("loose", "attnreg_unpackaged")])
    assert (reg.get("demo_mla").distribution, reg.get("demo_mla").distribution_version) == \
        ("attnreg_demo_plugin", "1.2.3")
    assert reg.plugin("loose").origin == "plugin 'loose' (no distribution found)"
