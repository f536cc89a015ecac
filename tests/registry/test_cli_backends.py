"""`attnreg backends` and `attnreg doctor`: JSON schema, tables, import cost."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from attnreg.cli import main

REQUIRED_KEYS = {"name", "plugin", "available", "unavailable_reason", "capabilities"}


def _json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def test_backends_json_schema(capsys):
    data = _json(capsys, "backends", "--json", "--platform", "cuda:sm90")
    assert data["schema_version"] == 1 and data["platform"] == "cuda:sm90"
    assert data["simulated"] is True
    names = {b["name"] for b in data["backends"]}
    assert {"reference", "triton", "flashinfer_mla", "trtllm_mla", "flash_attn_cute"} <= names
    for row in data["backends"]:
        assert REQUIRED_KEYS <= set(row)
        if row["available"]:
            assert row["unavailable_reason"] is None
            assert {"kernels", "graph_modes"} <= set(row["capabilities"])
        else:
            assert row["unavailable_reason"]
    by_name = {b["name"]: b for b in data["backends"]}
    assert not by_name["trtllm_mla"]["available"]
    assert "Blackwell" in by_name["trtllm_mla"]["unavailable_reason"]


def test_backends_table_for_simulated_blackwell(capsys):
    assert main(["backends", "--platform", "cuda:sm100"]) == 0
    out = capsys.readouterr().out
    assert "cuda:sm100 (simulated" in out
    assert "fallback->flashinfer_mla" in out


def test_backends_detected_platform_reports_missing_libraries(capsys):
    data = _json(capsys, "backends", "--json")
    assert data["simulated"] is False
    fi = {b["name"]: b for b in data["backends"]}["flashinfer_mla"]
    if not fi["available"]:
        assert "attnreg[flashinfer]" in fi["unavailable_reason"] or \
            "CUDA-only" in fi["unavailable_reason"]


def test_backends_disable_flag(capsys):
    data = _json(capsys, "backends", "--json", "--disable", "triton")
    assert "triton" not in {b["name"] for b in data["backends"]}


def test_bad_platform_exits_with_a_message(capsys):
    assert main(["backends", "--platform", "gpu:sm90"]) == 2  # bad input, like argparse's
    err = capsys.readouterr().err
    assert "unknown platform vendor" in err and err.count("\n") == 1


def test_doctor_json(capsys):
    data = _json(capsys, "doctor", "--json")
    assert data["plugins"][0]["name"] == "attnreg.builtin"
    assert data["plugins"][0]["module"] == "attnreg.backends.builtin"
    assert "pluggy" in data["libraries"] and data["errors"] == []


def test_doctor_lists_plugin_errors(capsys, fake_site):
    import os
    os.environ["ATTNREG_PLUGINS"] = "raising_hook"
    try:
        assert main(["doctor"]) == 0
    finally:
        del os.environ["ATTNREG_PLUGINS"]
    out = capsys.readouterr().out
    assert "raising_hook (attnreg_raising_hook 0.0.1): hook error" in out
    assert "silence it: `--disable raising_hook` / ATTNREG_DISABLE=raising_hook" in out


@pytest.mark.parametrize("module", ["attnreg.registry", "attnreg", "attnreg.cli"])
def test_startup_imports_never_pull_torch(module):
    code = (f"import sys, {module}; "
            "bad = [m for m in ('torch', 'triton', 'flashinfer', 'flash_attn', 'numpy') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_backends_command_in_a_subprocess_does_not_import_torch():
    code = ("import sys; from attnreg.cli import main; main(['backends', '--json']); "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

