"""Claims a backend declares only for other CUDA platforms are listed, skipped, with why.

On an H200 (cuda:sm90) the suite also lists what the sm100/sm103 declarations
promise beyond sm90 (flash_attn_cute's absorbed ``qv`` extend, trtllm_mla's
decode and ragged kernels) as skipped "declared for cuda:sm100, cuda:sm103
only; this is cuda:sm90".  Simulated here with ``ATTNREG_PLATFORM`` and
``--attnreg-device cuda``; only claims that are skipped anyway are run.
"""

from __future__ import annotations

import json
import subprocess
import sys

from attnreg.registry import ForwardMethod, Phase, get_registry
from attnreg.testing.claims import (
    CUDA_PLATFORMS,
    ClaimKind,
    expand_claims,
    other_platform_claims,
)

from ._run import by_status, env

BLACKWELL_ONLY = "declared for cuda:sm100, cuda:sm103 only; this is cuda:sm90"
SM90 = "cuda:sm90"


def _others(name: str, device: str = "cuda"):
    """(claims of ``name`` on sm90, its claims declared only for the other platforms)."""
    reg = get_registry()
    here_caps = reg.declaration(name, SM90)
    here = expand_claims(here_caps, device) if here_caps.kernels else []
    others = [reg.declaration(name, p) for p in CUDA_PLATFORMS]
    return here, other_platform_claims(here, others, SM90, device)


def test_flash_attn_cute_lists_its_blackwell_qv_claims_as_skipped_on_sm90():
    here, extra = _others("flash_attn_cute")
    assert extra, "the sm100 qv declaration adds claims sm90 does not make"
    assert {c.skip_reason for c in extra} == {BLACKWELL_ONLY}
    assert all(c.declared_for == ("cuda:sm100", "cuda:sm103") for c in extra)
    # what sm90 claims is run here, never listed again
    assert not {c.id for c in here} & {c.id for c in extra}
    eager = [c for c in extra if c.kind is ClaimKind.EAGER]
    assert eager and all(c.combo.method is ForwardMethod.MLA and c.combo.phase is Phase.PREFILL
                         for c in eager)
    assert "flash_attn_cute/capture/prefill/breakable/pinning/mla/bf16-bf16/p16/h16/576x512" \
        in {c.id for c in extra}


def test_trtllm_mla_lists_decode_and_ragged_claims_though_sm90_declares_nothing():
    here, extra = _others("trtllm_mla")
    assert here == []
    assert {c.skip_reason for c in extra} == {BLACKWELL_ONLY}
    eager = {(c.combo.phase, c.combo.method) for c in extra if c.kind is ClaimKind.EAGER}
    assert (Phase.DECODE, ForwardMethod.MLA) in eager  # trtllm decode kernel
    assert (Phase.PREFILL, ForwardMethod.MHA) in eager  # trtllm ragged kernel


def test_ids_stay_unique_and_the_platform_under_test_adds_nothing():
    reg = get_registry()
    here = expand_claims(reg.declaration("flash_attn_cute", SM90), "cuda")
    sm100 = reg.declaration("flash_attn_cute", "cuda:sm100")
    sm103 = reg.declaration("flash_attn_cute", "cuda:sm103")
    twice = other_platform_claims(here, [sm100, sm103, sm100], SM90, "cuda")
    ids = [c.id for c in twice]
    assert len(ids) == len(set(ids))
    # the same ids a run of sm100 alone makes: equal promises get equal ids
    assert ids == [c.id for c in other_platform_claims(here, [sm100], SM90, "cuda")]
    # a backend declaring the same on every platform has nothing to add
    triton = [reg.declaration("triton", p) for p in CUDA_PLATFORMS]
    assert other_platform_claims(expand_claims(triton[0], "cuda"), triton, SM90, "cuda") == []


def _pytest_suite(tmp_path, *args: str, platform: str = SM90):
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--pyargs",
         "attnreg.testing.suite", "--attnreg-device", "cuda", "--attnreg-report", str(report),
         "-q", *args],
        cwd=tmp_path, env=env(ATTNREG_PLATFORM=platform), capture_output=True, text=True,
        timeout=300, check=False)
    out = proc.stdout + proc.stderr
    data = json.loads(report.read_text()) if report.exists() else None
    return proc.returncode, out, data


def test_an_unavailable_backend_lists_its_other_platform_claims_beside_the_availability_skip(
        tmp_path):
    # trtllm_mla runs nothing on sm90 (installed or not): every claim is a skip
    code, out, data = _pytest_suite(tmp_path, "--attnreg-backend", "trtllm_mla")
    assert code == 0, out
    skipped = by_status(data, "skipped")
    assert skipped.pop("trtllm_mla/availability").startswith("backend not available")
    assert skipped and set(skipped.values()) == {BLACKWELL_ONLY}
    assert any(i.startswith("trtllm_mla/eager/decode/mla/") for i in skipped)
    assert data["header"]["other_platforms"] is True
    assert f"claims: {BLACKWELL_ONLY}" in out  # the text report groups them under one reason


def test_flash_attn_cute_other_platform_claims_carry_a_marker(tmp_path):
    # -m selects only the listed claims, so nothing needs flash-attn-4 or a GPU
    code, out, data = _pytest_suite(tmp_path, "--attnreg-backend", "flash_attn_cute",
                                    "-m", "attnreg_other_platform")
    assert code == 0, out
    _, extra = _others("flash_attn_cute")
    assert by_status(data, "skipped") == {c.id: BLACKWELL_ONLY for c in extra}
    assert by_status(data, "verified") == {} and by_status(data, "refuted") == {}


def test_a_full_run_includes_a_backend_declared_only_elsewhere(tmp_path):
    code, out, data = _pytest_suite(tmp_path, "--collect-only")
    assert code == 0, out
    assert "trtllm_mla" in data["header"]["backends"]
    assert "OTHER PLATFORM (listed, skipped here)" in out and "trtllm_mla/eager/decode" in out
    code, out, data = _pytest_suite(tmp_path, "--collect-only", "--attnreg-no-other-platforms")
    assert code == 0, out
    assert "trtllm_mla" not in data["header"]["backends"]
    assert "trtllm_mla/" not in out and data["header"]["other_platforms"] is False


def _list(tmp_path, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "attnreg", "conformance", "--device", "cpu",
                           "--backend", "flash_attn_cute", "--list", *args],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_cpu_lists_other_platforms_only_when_asked(tmp_path):
    # on cpu the declaration of every cuda platform is "another platform": opt-in only
    assert "flash_attn_cute/eager" not in _list(tmp_path)
    out = _list(tmp_path, "--other-platforms")
    assert "OTHER PLATFORM (listed, skipped here)" in out
    assert "declared for cuda:sm100, cuda:sm103 only; this is cpu" in out
    assert "flash_attn_cute/eager/prefill/mla/bf16-bf16/p16/h2/576x512" in out
