"""A plugin written against attnreg 0.1.0's documented API still works, with warnings only.

``plugin_0_1/`` is the 0.1.0 tutorial's package as documented then (see its
README): ``Requirement(import, dist, extra, min_version)`` and
``Capabilities(requires=...)``, both deprecated in 0.2.0.  It must load with
no plugin error, plan, and pass the CPU conformance suite, while each
deprecated form warns with its replacement and ``attnreg doctor`` lists it.
These tests stay until 0.3.0 removes the forms (docs/api.md#deprecations).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnreg import GraphMode, GraphPolicyError, load_registry
from attnreg.cli import main
from attnreg.graph_policy import resolve
from attnreg.registry.deprecation import AttnregDeprecationWarning

SITE = Path(__file__).parent / "plugin_0_1"
REPO = Path(__file__).resolve().parents[2]
PLUGIN, BACKEND, MODULE = "compat_0_1", "compat_0_1_mla", "attnreg_compat_0_1"
POSITIONAL_EXTRA = ("Requirement('torch', 'torch', 'torch', '2.4') uses attnreg 0.1.0's "
                    "positional extra, deprecated since 0.2.0 and removed in 0.3.0: write "
                    "Requirement('torch', 'torch', '2.4', extra='torch')")
CAPS_REQUIRES = (f"Capabilities(requires=...) of backend {BACKEND!r} is deprecated since "
                 "attnreg 0.2.0 and removed in 0.3.0: declare requirements once, in "
                 "BackendSpec(requires=...)")


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch):
    """The 0.1.0 plugin on sys.path, as `pip install` would put it; imported afresh."""
    monkeypatch.syspath_prepend(str(SITE))
    monkeypatch.setenv("ATTNREG_PLUGINS", PLUGIN)
    monkeypatch.delenv("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("ATTNREG_DISABLE", raising=False)
    yield
    for name in [m for m in sys.modules if m == MODULE or m.startswith(MODULE + ".")]:
        del sys.modules[name]


def _loaded():
    with pytest.warns(AttnregDeprecationWarning) as caught:
        reg = load_registry(autoload=True, allow=[PLUGIN])
    return reg, [str(w.message) for w in caught]


def test_it_loads_with_a_warning_per_deprecated_form_and_no_error(installed):
    reg, warned = _loaded()
    assert reg.errors == []
    assert BACKEND in reg.names()
    assert any(w.startswith(POSITIONAL_EXTRA) for w in warned), warned
    assert any(w.startswith(CAPS_REQUIRES) for w in warned), warned
    info = reg.plugin(PLUGIN)
    assert info is not None and info.loaded
    assert sorted(d[:40] for d in info.deprecations) == [CAPS_REQUIRES[:40], POSITIONAL_EXTRA[:40]]


def test_the_old_requirement_means_what_it_meant(installed):
    reg, _ = _loaded()
    [req] = reg.get(BACKEND).requires  # Capabilities.requires merged: the same TORCH once
    assert (req.import_name, req.distribution, req.min_version, req.extra) == \
        ("torch", "torch", "2.4", "torch")
    assert req.install_hint() == "install attnreg[torch]"
    assert reg.availability(BACKEND, "cpu").available


def test_the_policy_plans_it(installed):
    reg, _ = _loaded()
    plan = resolve("cuda:sm90", "deepseek-v2-lite", BACKEND, registry=reg,
                   assume_installed=True)
    assert (plan.prefill.backend, plan.decode.backend) == (BACKEND, BACKEND)
    assert (plan.prefill.mode, plan.decode.mode) == (GraphMode.DISABLED, GraphMode.DISABLED)
    # in the words of its 0.1.0 declaration: both captures declared UNSUPPORTED
    why = {d.phase.value: d.message for d in plan.decisions
           if d.rule == "backend.capture_unsupported"}
    assert "decode capture has not been verified on a GPU" in why["decode"]
    assert "host-side lengths" in why["prefill"]
    # a 128-head model is outside its declaration: refused before anything runs
    with pytest.raises(GraphPolicyError, match="128 heads not in 1..64"):
        resolve("cpu", "deepseek-v3", BACKEND, registry=reg)


def test_doctor_lists_the_deprecated_forms_it_uses(installed, capsys):
    with pytest.warns(AttnregDeprecationWarning):
        assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    [row] = [p for p in data["plugins"] if p["name"] == PLUGIN]
    assert sorted(d[:40] for d in row["deprecations"]) == \
        [CAPS_REQUIRES[:40], POSITIONAL_EXTRA[:40]]
    assert data["errors"] == []
    # loaded again in this process (the module is imported once): still listed
    assert main(["doctor", "--wide"]) == 0
    out = capsys.readouterr().out
    assert "plugins using deprecated forms: 1 " in out
    assert f"  - {PLUGIN} (attnreg-compat-0-1 0.1.0): {POSITIONAL_EXTRA}" in out


def test_a_current_plugin_is_not_listed_as_deprecated():
    reg = load_registry(autoload=False)
    assert [p.name for p in reg.plugins if p.deprecations] == []


def test_it_passes_cpu_conformance_with_warnings_only(tmp_path):
    """In a subprocess, as a user runs it, with every DeprecationWarning shown."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "ATTNREG_DISABLE", "ATTNREG_PLATFORM")}
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
    env.update(ATTNREG_PLUGINS=PLUGIN, PYTHONDONTWRITEBYTECODE="1")
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-W", "always::DeprecationWarning", "-m", "attnreg", "conformance",
         "--backend", BACKEND, "--device", "cpu", "-o", str(report)],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=900, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert POSITIONAL_EXTRA in out and CAPS_REQUIRES in out
    assert "plugin error" not in out.lower()
    data = json.loads(report.read_text())
    counts = data["summary"]["by_backend"][BACKEND]
    assert counts["refuted"] == 0 and counts["verified"] > 0, counts
    verified = {(c["kind"], c["check"]) for c in data["claims"]
                if c["backend"] == BACKEND and c["status"] == "verified"}
    assert {("eager", "matches_reference"), ("refusal", "page_size"),
            ("refusal", "num_heads"), ("refusal", "method")} <= verified, sorted(verified)
