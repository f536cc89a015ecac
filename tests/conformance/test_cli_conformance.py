"""`attnreg conformance` end to end on the cpu: the reference and the Triton backend
(in the Triton interpreter) pass; usage errors exit 2; the plugin stays out of the way
of test runs that do not ask for it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from ._run import by_status, conformance, env

pytest.importorskip("torch")


def _check_cpu_report(data, backend):
    assert data["header"]["backends"] == [backend]
    assert data["header"]["device"] == "cpu" and data["header"]["platform"] == "cpu"
    assert data["header"]["libraries"]["torch"]
    assert by_status(data, "refuted") == {}
    skipped = by_status(data, "skipped")
    # on a cpu only the claims that need a real device graph are skipped, with the reason
    assert skipped and all(m.startswith("no CUDA graphs on cpu") for m in skipped.values())
    verified = by_status(data, "verified")
    kinds = {i.split("/")[1] for i in verified}
    assert kinds == {"eager", "refusal", "capture"}
    return verified


def test_reference_passes_on_cpu(tmp_path):
    code, out, data = conformance(tmp_path, "--backend", "reference", "--device", "cpu")
    assert code == 0, out
    verified = _check_cpu_report(data, "reference")
    # FULL and BREAKABLE are declared unsupported: refusing them is a verified claim
    assert "reference/capture/decode/full/refuses_capture/mla/bf16-bf16/p16/h2/576x512" \
        in verified
    assert "OK:" in out and "attnreg conformance claims" in out


def test_triton_passes_on_cpu_in_the_interpreter(tmp_path):
    code, out, data = conformance(tmp_path, "--backend", "triton", "--device", "cpu")
    assert code == 0, out
    verified = _check_cpu_report(data, "triton")
    # the capture-mode code paths (no device graph) and the pinning run on the cpu
    assert "triton/capture/prefill/breakable/pinning/mla/bf16-bf16/p16/h2/576x512" in verified
    assert "triton/capture/decode/full/capture_path/mla/bf16-bf16/p16/h2/576x512" in verified
    assert any(i.startswith("triton/eager/decode/mla/bf16-fp8_e4m3") for i in verified)


def test_unknown_backend_is_a_usage_error_with_a_suggestion(tmp_path):
    code, out, _ = conformance(tmp_path, "--backend", "tritn", "--device", "cpu")
    assert code == 2
    assert "Did you mean: triton" in out


def test_list_shows_claims_without_running_them(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "attnreg", "conformance", "--backend",
                           "reference", "--device", "cpu", "--list", "-k", "refusal"],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "reference/refusal/decode/mla/page_size/p3" in proc.stdout
    assert "passed" not in proc.stdout


def test_plugin_generates_nothing_for_unrelated_tests_and_imports_no_torch(tmp_path):
    (tmp_path / "test_plain.py").write_text(textwrap.dedent("""
        import sys

        def test_plain():
            assert "torch" not in sys.modules
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_plain.py"], cwd=tmp_path, env=env(), capture_output=True,
                          text=True, timeout=120, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "1 passed" in out and "attnreg conformance" not in out


def test_a_backend_package_opts_in_by_subclassing(tmp_path):
    (tmp_path / "test_mine.py").write_text(textwrap.dedent("""
        from attnreg.testing.suite import BackendConformance

        class TestReferenceConformance(BackendConformance):
            attnreg_backends = ("reference",)
    """))
    report = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "test_mine.py", "--attnreg-device", "cpu", "-k", "refusal",
                           "--attnreg-report", str(report)],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300,
                          check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    data = json.loads(report.read_text())
    assert data["summary"]["verified"] >= 10 and data["summary"]["refuted"] == 0
    assert all(c["id"].startswith("reference/refusal/") for c in data["claims"])


def test_device_cuda_without_a_gpu_is_a_usage_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, _ = conformance(tmp_path, "--backend", "reference", "--device", "cuda")
    assert code == 2 and "torch sees no CUDA device" in out


def test_a_requested_backend_that_cannot_run_here_fails_the_run(tmp_path):
    code, out, data = conformance(tmp_path, "--backend", "flashinfer_mla", "--device", "cpu")
    assert code == 1
    assert "not available here" in out and "nothing of them was checked" in out
    assert "flashinfer_mla" in data["header"]["unavailable"]
    assert by_status(data, "skipped")["flashinfer_mla/availability"].startswith(
        "backend not available: flashinfer kernels are CUDA-only")


def test_merge_joins_reports_without_running_claims(tmp_path):
    from attnreg.testing.report import ClaimResult, Report, Status

    paths = []
    for name, status in (("a", Status.VERIFIED), ("b", Status.REFUTED)):
        rep = Report({"backends": [name], "device": "cuda", "platform": "cuda:sm90",
                      "libraries": {"torch": "2.11.0"}})
        rep.add(ClaimResult({"id": f"{name}/1", "backend": name}, status, "why"))
        paths.append(rep.write_json(tmp_path / f"{name}.json"))
    out = tmp_path / "all.json"
    proc = subprocess.run([sys.executable, "-m", "attnreg", "conformance", "--merge",
                           str(paths[0]), "--merge", str(paths[1]), "-o", str(out)],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 1, proc.stderr  # b's claim is refuted
    assert "REFUTED   b/1" in proc.stdout and "a: 1 verified" in proc.stdout
    assert Report.read_json(out).header["backends"] == ["a", "b"]
    as_json = subprocess.run([sys.executable, "-m", "attnreg", "conformance", "--merge",
                              str(paths[0]), "--merge", str(paths[1]), "--json"],
                             capture_output=True, text=True, env=env(), timeout=120)
    assert as_json.returncode == 1
    assert json.loads(as_json.stdout)["header"]["backends"] == ["a", "b"]
    bad = subprocess.run([sys.executable, "-m", "attnreg", "conformance", "--merge",
                          str(paths[0]), "--backend", "triton"],
                         capture_output=True, text=True, env=env(), timeout=120)
    assert bad.returncode == 2 and "drop --backend" in bad.stderr
    missing = subprocess.run([sys.executable, "-m", "attnreg", "conformance", "--merge",
                              str(tmp_path / "nope.json")],
                             capture_output=True, text=True, env=env(), timeout=120)
    assert missing.returncode == 2 and "nope.json: no such file" in missing.stderr


def _attnreg_conformance(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "attnreg", "conformance", *args], cwd=tmp_path,
                          env=env(), capture_output=True, text=True, timeout=300, check=False)


def test_json_prints_the_report_alone_on_stdout_and_output_writes_it(tmp_path):
    proc = _attnreg_conformance(tmp_path, "--backend", "reference", "--device", "cpu",
                                "-k", "refusal/decode and not sparse", "--json", "-o", "r.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed = json.loads(proc.stdout)  # nothing but the report: pytest's lines went to stderr
    assert printed["summary"]["verified"] == 5 and printed["summary"]["refuted"] == 0
    assert "attnreg conformance claims" in proc.stderr
    assert json.loads((tmp_path / "r.json").read_text())["claims"] == printed["claims"]


def test_json_path_of_earlier_versions_still_writes_the_file_with_a_warning(tmp_path):
    proc = _attnreg_conformance(tmp_path, "--backend", "reference", "--device", "cpu",
                                "-k", "refusal/decode and not sparse", "--json", "old.json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "`--json old.json` is deprecated" in proc.stderr and "--output old.json" in proc.stderr
    assert "OK: 5 verified" in proc.stdout  # the table, as before
    assert json.loads((tmp_path / "old.json").read_text())["summary"]["verified"] == 5
    stray = _attnreg_conformance(tmp_path, "--backend", "reference", "stray.json")
    assert stray.returncode == 2 and "unrecognized argument: stray.json" in stray.stderr
