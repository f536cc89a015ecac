"""The example plugin package, installed like a third-party distribution, works end to end.

``examples/attnreg-example-backend`` is built and installed (non-editable,
``--no-deps``) into a throwaway directory that is put on ``PYTHONPATH`` of
subprocesses, so the developer's venv is never modified and no plugin leaks
into other tests.  (When the example is already installed in this venv, e.g.
``pip install -e`` while following the tutorial, that installation is used
instead: adding a second copy would register the backend twice.)  The
subprocesses run with plugin autoload on, exactly as a user's shell would.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "attnreg-example-backend"
BACKEND = "example_mla"
PLUGIN = "example"
DISTRIBUTION = "attnreg-example-backend"



def _load_build_docs() -> ModuleType:
    """scripts/build_docs.py holds the install helper the docs build uses too."""
    spec = importlib.util.spec_from_file_location("attnreg_scripts_build_docs",
                                                  REPO / "scripts" / "build_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


build_docs = _load_build_docs()


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path | None]:
    """Where the example is installed for the subprocesses (None: in this venv already)."""
    if build_docs.example_installed_in_environment():
        yield None
        return
    target = tmp_path_factory.mktemp("example") / "site"
    build_docs.install_example(target)
    yield target


def _env(site: Path | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "ATTNREG_PLUGINS", "ATTNREG_DISABLE",
                        "ATTNREG_PLATFORM")}
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(site), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # nothing written into the repository's example tree
    env.update(extra)
    return env


def attnreg(site: Path | None, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnreg", *args], capture_output=True,
                          text=True, env=_env(site, **env), cwd=REPO, timeout=600, check=False)


def test_backends_lists_it_with_its_distribution(site):
    proc = attnreg(site, "backends", "--platform", "cpu", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    rows = {row["name"]: row for row in data["backends"]}
    assert BACKEND in rows, sorted(rows)
    row = rows[BACKEND]
    assert (row["plugin"], row["distribution"], row["version"]) == (PLUGIN, DISTRIBUTION, "0.1.0")
    assert row["available"] is True
    kernels = row["capabilities"]["kernels"]
    assert {tuple(k["page_sizes"]) for k in kernels} == {(16, 64)}
    assert {k["max_heads"] for k in kernels} == {64}
    assert [e for e in data["errors"] if e["plugin"] == PLUGIN] == []


def test_autoload_off_or_disabled_hides_it(site):
    for env in ({"ATTNREG_DISABLE_PLUGIN_AUTOLOAD": "1"}, {"ATTNREG_DISABLE": PLUGIN},
                {"ATTNREG_PLUGINS": ""}):
        proc = attnreg(site, "backends", "--platform", "cpu", "--json", **env)
        assert proc.returncode == 0, proc.stderr
        names = [row["name"] for row in json.loads(proc.stdout)["backends"]]
        assert BACKEND not in names and "reference" in names, env


def test_compat_chooses_it_for_both_phases(site):
    proc = attnreg(site, "compat", "--platform", "cpu", "--model", "deepseek-v2-lite",
                   "--prefill-backend", BACKEND, "--decode-backend", BACKEND, "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["phases"]["prefill"]["backend"] == BACKEND
    assert plan["phases"]["decode"]["backend"] == BACKEND
    # cpu has no device graphs: even the tc_piecewise prefill it declares native runs eagerly.
    assert plan["phases"]["prefill"]["mode"] == "disabled"
    assert plan["phases"]["decode"]["mode"] == "disabled"


def test_compat_refuses_a_model_outside_its_declaration(site):
    proc = attnreg(site, "compat", "--platform", "cpu", "--model", "deepseek-v3",
                   "--backend", BACKEND)
    assert proc.returncode == 2
    assert "128 heads not in 1..64" in proc.stderr


def test_conformance_suite_passes_on_cpu(site, tmp_path):
    """Run from the repository root, as the tutorial does."""
    report = tmp_path / "report.json"
    proc = attnreg(site, "conformance", "--backend", BACKEND, "--device", "cpu",
                   "--output", str(report))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(report.read_text())
    assert data["summary"]["by_backend"][BACKEND]["refuted"] == 0
    claims = [c for c in data["claims"] if c["backend"] == BACKEND]
    verified = {(c["kind"], c["check"]) for c in claims if c["status"] == "verified"}
    # Its own decode and the inherited extend match the oracle, and what it does
    # not declare (page size 32, > 64 heads, the MHA method) is refused.
    assert {("eager", "matches_reference"), ("refusal", "page_size"),
            ("refusal", "num_heads"), ("refusal", "method")} <= verified, sorted(verified)


def test_the_example_packages_own_tests_pass(site):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLE / "tests")],
        capture_output=True, text=True, env=_env(site), cwd=EXAMPLE, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
