"""Per-bucket decode backends in the plan: only with a decode profile, only among backends that
declare the same pool (page size, KV dtype, heads) and capture full decode graphs, only where
the profile measured both and the candidate is more than 2% faster; a reason per bucket; in
the fingerprint, the JSON and `attnreg compat`.  Simulated h200 (declarations only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from attnreg.graph_policy import (
    EngineFacts,
    GraphConfig,
    ModelFacts,
    ReplayGate,
    plan_fingerprint,
    resolve,
)
from attnreg.graph_policy.bucket_backends import MIN_GAIN
from attnreg.graph_policy.decode_profile import DecodeProfile, DecodeProfileError
from attnreg.registry import get_registry

SIZES = (1, 8, 64, 128)


def _entry(name: str, bucket: int, *us: float) -> dict[str, Any]:
    return {"backend": name, "bucket": bucket,
            "points": [{"kv_len": 1024 * 2 ** i, "us": t} for i, t in enumerate(us)]}


def _data(entries: list[dict[str, Any]], **top: Any) -> dict[str, Any]:
    base = {"schema": "attnreg.decode_profile", "schema_version": 1, "platform": "cuda:sm90",
            "heads": 16, "kv_dtype": "bf16", "page_size": 16, "entries": entries}
    base.update(top)
    return base


#: page 16, bf16: flashinfer_mla (priority 30) is the decode default, triton the candidate
PROFILE = DecodeProfile.from_dict(_data([
    _entry("flashinfer_mla", 1, 54.3, 60.0), _entry("triton", 1, 30.1, 33.0),
    _entry("flashinfer_mla", 8, 25.5), _entry("triton", 8, 25.4),   # 0.4%: within noise
    _entry("flashinfer_mla", 64, 64.1, 70.0), _entry("triton", 64, 89.0, 95.0),
    _entry("triton", 128, 10.0),                                    # no default time here
]))
MODEL = ModelFacts(attention="mla", kv_dtype="bf16", num_heads=16)


def _plan(profile: Any = PROFILE, *, page: int | None = 16, model: ModelFacts = MODEL,
          **kw: Any):  # type: ignore[no-untyped-def]
    kw.setdefault("config", GraphConfig(decode_batch_sizes=SIZES))
    return resolve("h200", model, assume_installed=True, registry=get_registry(),
                   engine=EngineFacts(page_size=page), decode_profile=profile, **kw)


def _decision(plan: Any, prefix: str = "decode.bucket_backends"):  # type: ignore[no-untyped-def]
    found = [d for d in plan.decisions if d.rule.startswith(prefix)]
    assert len(found) == 1, found
    return found[0]


def test_without_a_profile_one_backend_serves_every_bucket():
    plan = _plan(None)
    assert plan.decode.bucket_backends == () and plan.decode.backends == ("flashinfer_mla",)
    assert not [d for d in plan.decisions if d.rule.startswith("decode.bucket")]
    assert plan.to_dict()["phases"]["decode"]["bucket_backends"] == []  # type: ignore[index]


def test_each_bucket_gets_the_measured_faster_backend_with_its_reason():
    plan = _plan()
    got = {b.bucket: (b.backend, b.ratio) for b in plan.decode.bucket_backends}
    assert got[1][0] == "triton" and got[1][1] == pytest.approx(
        ((30.1 / 54.3) * (33.0 / 60.0)) ** 0.5, abs=1e-4)
    assert got[8] == ("flashinfer_mla", 1.0), f"under {MIN_GAIN:.0%} faster stays"
    assert got[64] == ("flashinfer_mla", 1.0)
    assert got[128] == ("flashinfer_mla", None), "no default time: never a guess"
    reasons = {b.bucket: b.reason for b in plan.decode.bucket_backends}
    assert "0.552x flashinfer_mla's time at bucket 1" in reasons[1]
    assert "no flashinfer_mla time at bucket 128" in reasons[128]
    assert plan.decode.backend_for(1) == "triton" and plan.decode.backend_for(64) == \
        "flashinfer_mla"
    d = _decision(plan)
    assert d.rule == "decode.bucket_backends" and "1 triton, 8..128 flashinfer_mla" in d.message
    assert plan.decode.backends == ("flashinfer_mla", "triton")
    one = _plan(None)
    assert plan.decode.capture_memory_bytes > one.decode.capture_memory_bytes, \
        "triton's graph state counts too"


def test_the_fingerprint_and_json_carry_the_bucket_backends():
    plan, one = _plan(), _plan(None)
    a, b = plan_fingerprint(plan), plan_fingerprint(one)
    assert a.differences(b) == ("decode.bucket_backends",)
    assert ReplayGate(plan).fingerprint != ReplayGate(one).fingerprint
    rows = plan.to_dict()["phases"]["decode"]["bucket_backends"]  # type: ignore[index]
    assert rows[0] == {"bucket": 1, "backend": "triton", "rule": "decode.bucket_backends",
                       "reason": plan.decode.bucket_backends[0].reason,
                       "ratio": plan.decode.bucket_backends[0].ratio}


@pytest.mark.parametrize(("change", "why"), [
    ({"page": None}, "did not pass its page size"),
    ({"page": 64}, "page size 16 (the plan's is 64)"),
    ({"model": ModelFacts(attention="mla", kv_dtype="bf16", num_heads=128)},
     "heads per rank 16 (the plan's is 128)"),
    ({"backends": ("triton", "flashinfer_mla")}, "the user named the decode backend"),
    ({"config": GraphConfig.from_user(decode="disabled", decode_batch_sizes=SIZES)},
     "decode graphs are not captured"),
    ({"config": "budget of one backend"}, "over the capture budget"),
])
def test_otherwise_one_backend_captures_every_bucket_and_the_plan_says_why(change, why):
    if change.get("config") == "budget of one backend":  # room for flashinfer_mla's graphs only
        room = _plan(None).capture_memory_bytes
        change = {"config": GraphConfig(decode_batch_sizes=SIZES,
                                        capture_memory_budget_bytes=room)}
    plan = _plan(**change)
    assert plan.decode.bucket_backends == ()
    d = _decision(plan)
    assert d.rule == "decode.bucket_backends_off" and why in d.message, d.message


def test_a_profile_without_the_phase_backend_compares_nothing():
    profile = DecodeProfile.from_dict(_data([_entry("triton", 1, 1.0)]))
    plan = _plan(profile)
    assert plan.decode.bucket_backends == ()
    assert "no time of flashinfer_mla, the phase's backend" in _decision(plan).message


def test_a_backend_that_cannot_read_the_pool_is_no_candidate():
    # fp8 KV, page 64: flashinfer_mla's fa3 kernel reads no fp8 pool; flashmla is not a
    # built-in here (plugins are not autoloaded in tests): unknown names are reasons too
    profile = DecodeProfile.from_dict(_data([
        _entry("triton", 1, 50.0), _entry("flashinfer_mla", 1, 10.0), _entry("flashmla", 1, 9.0),
    ], kv_dtype="fp8_e4m3", page_size=64))
    fp8 = ModelFacts(attention="mla", kv_dtype="fp8_e4m3", num_heads=16)
    plan = _plan(profile, page=64, model=fp8)
    assert plan.decode.backend == "triton" and plan.decode.bucket_backends == ()
    d = _decision(plan)
    assert "flashinfer_mla (its kernels do not read this pool" in d.message
    assert "kv dtype fp8_e4m3" in d.message and "flashmla (" in d.message


def test_a_profile_path_is_read_and_a_bad_one_is_refused(tmp_path: Path):
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(PROFILE.to_dict()))
    assert _plan(str(path)).decode.backend_for(1) == "triton"
    path.write_text(json.dumps(_data([_entry("triton", 1, 1.0), _entry("triton", 1, 2.0)])))
    with pytest.raises(DecodeProfileError, match="listed twice"):
        _plan(str(path))


def test_compat_renders_the_buckets_and_their_json(tmp_path: Path):
    path = tmp_path / "decode.json"
    path.write_text(json.dumps(PROFILE.to_dict()))
    base = [sys.executable, "-m", "attnreg", "compat", "--platform", "h200", "--model",
            "deepseek-v3", "--num-heads", "16", "--page-size", "16", "--decode-batch-sizes",
            "1,8,64,128", "--decode-profile", str(path)]
    text = subprocess.run(base, capture_output=True, text=True, check=True).stdout
    assert "decode buckets (from the decode profile):" in text
    assert "triton measured 0.552x" in " ".join(text.split())
    data = json.loads(subprocess.run([*base, "--json"], capture_output=True, text=True,
                                     check=True).stdout)
    assert [b["backend"] for b in data["phases"]["decode"]["bucket_backends"]] == [
        "triton", "flashinfer_mla", "flashinfer_mla", "flashinfer_mla"]
    bad = subprocess.run([*base[:-1], str(tmp_path / "missing.json")], capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "no such file" in bad.stderr
