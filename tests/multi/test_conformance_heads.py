"""`attnreg conformance --heads N`: every configuration with one tensor-parallel head count."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from attnreg.commands import conformance as conformance_cmd
from attnreg.registry import get_registry
from attnreg.testing.claims import ClaimKind, expand_claims


def _head_counts(claims) -> set[int]:
    # refusal claims carry the undeclared value they ask for (e.g. 129 heads)
    return {c.combo.num_heads for c in claims
            if c.combo is not None and c.kind is not ClaimKind.REFUSAL}


@pytest.mark.parametrize("heads", [64, 32, 16])
def test_heads_replace_the_device_defaults_in_every_claim(heads: int) -> None:
    caps = get_registry().declaration("triton", "cuda:sm90")
    default = expand_claims(caps, "cuda")
    assert _head_counts(default) == {16, 32, 128}  # 32: the fp8 pool's 1..32 entry
    chosen = expand_claims(caps, "cuda", heads=(heads,))
    assert _head_counts(chosen) == {heads}
    # the same checks are claimed, only the head count differs
    assert {c.kind for c in chosen} == {c.kind for c in default}
    assert {(c.kind, c.check) for c in chosen} == {(c.kind, c.check) for c in default}
    assert all(f"/h{heads}/" in c.id for c in chosen
               if c.kind in (ClaimKind.EAGER, ClaimKind.CAPTURE))


def test_a_head_count_no_kernel_declares_makes_no_forward_claims() -> None:
    caps = get_registry().declaration("triton", "cuda:sm90")  # max_heads 128
    claims = expand_claims(caps, "cuda", heads=(256,))
    assert not [c for c in claims if c.kind in (ClaimKind.EAGER, ClaimKind.CAPTURE)]


def test_a_head_count_below_one_is_rejected() -> None:
    caps = get_registry().declaration("triton", "cuda:sm90")
    with pytest.raises(ValueError, match="head counts must be >= 1"):
        expand_claims(caps, "cuda", heads=(0,))


def test_the_cli_passes_heads_to_the_plugin(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    conformance_cmd.add_arguments(parser)
    args = parser.parse_args(["--backend", "triton", "--heads", "32", "--heads", "64"])
    argv = conformance_cmd.pytest_args(args, tmp_path / "pytest.ini")
    pairs = [argv[i + 1] for i, a in enumerate(argv) if a == "--attnreg-heads"]
    assert pairs == ["32", "64"]


def _attnreg(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "attnreg", "conformance", *args],
                          capture_output=True, text=True, timeout=120, check=False)


def test_list_shows_claims_with_the_chosen_head_count_only() -> None:
    proc = _attnreg("--backend", "reference", "--device", "cpu", "--heads", "3", "--list")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ids = [line for line in proc.stdout.splitlines() if line.startswith("reference/")
           or "::" in line]
    assert any("/h3/" in i for i in ids), proc.stdout
    assert not any("/h2/" in i for i in ids), proc.stdout


def test_a_bad_head_count_is_a_usage_error() -> None:
    proc = _attnreg("--backend", "reference", "--device", "cpu", "--heads", "0", "--list")
    assert proc.returncode == 2
    assert "--heads" in proc.stderr and ">= 1" in proc.stderr


def test_device_cpu_runs_triton_without_triton_interpret_in_the_environment(tmp_path: Path
                                                                            ) -> None:
    # --device cpu must set TRITON_INTERPRET before the first declaration is
    # evaluated (declarations are cached per process), or triton reads as unavailable
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "attnreg", "conformance", "--backend", "triton",
                           "--device", "cpu", "--heads", "2", "-k", "refusal/decode"],
                          capture_output=True, text=True, timeout=120, check=False, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not available" not in proc.stdout + proc.stderr
    assert "OK:" in proc.stdout
