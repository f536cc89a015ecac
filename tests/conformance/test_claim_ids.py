"""Claim ids are stable: reports are compared by id (docs/conformance/*.json).

``data/claim_ids.json`` holds every claim id the built-in backends' declarations
expanded to before the claim expansion moved into the check classes (main at
7a1e444, its per-kind generators and sparse claims), on cpu and on simulated
cuda platforms (sm90, sm100), plus the exhaustive and ``heads`` variants of a
cpu run.  A change to this list must be
deliberate: regenerate it with ``python tests/conformance/test_claim_ids.py``
and say in the commit why ids changed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from attnreg.registry import get_registry
from attnreg.testing.claims import expand_claims

DATA = Path(__file__).parent / "data" / "claim_ids.json"
BUILT_INS = ("reference", "triton", "flashinfer_mla", "flash_attn_cute", "trtllm_mla")
#: (platform the declaration is evaluated on, device profile, expand_claims options)
RUNS: dict[str, tuple[str, str, dict[str, object]]] = {
    "cpu": ("cpu", "cpu", {}),
    "cpu-exhaustive": ("cpu", "cpu", {"exhaustive": True}),
    "cpu-heads32": ("cpu", "cpu", {"heads": (32,)}),
    "cuda:sm90": ("cuda:sm90", "cuda", {}),
    "cuda:sm100": ("cuda:sm100", "cuda", {}),
}


def current_ids() -> dict[str, dict[str, list[str]]]:
    """run -> backend -> the ids of its claims, in expansion order."""
    # the Triton backend declares its cpu kernels only under the interpreter (as
    # `attnreg conformance --device cpu` sets it)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    reg = get_registry()
    out: dict[str, dict[str, list[str]]] = {}
    for run, (platform, device, options) in RUNS.items():
        out[run] = {}
        for name in BUILT_INS:
            caps = reg.declaration(name, platform)
            claims = expand_claims(caps, device, **options) if caps.kernels else []  # type: ignore[arg-type]
            out[run][name] = [c.id for c in claims]
    return out


@pytest.mark.parametrize("run", list(RUNS))
def test_claim_ids_of_the_built_in_backends_are_unchanged(run):
    expected = json.loads(DATA.read_text())[run]
    got = current_ids()[run]
    for name in BUILT_INS:
        missing = sorted(set(expected[name]) - set(got[name]))
        added = sorted(set(got[name]) - set(expected[name]))
        assert not missing and not added, (name, run, missing[:5], added[:5])
        assert len(got[name]) == len(expected[name]), (name, run)


if __name__ == "__main__":  # regenerate the data (deliberately)
    DATA.write_text(json.dumps(current_ids(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {DATA}", file=sys.stderr)
