"""BucketSessions with real CUDA graphs: a plan whose decode profile gives bucket 1 to triton
and bucket 8 to flashinfer_mla (page 64, bf16, 16 heads) captures each bucket with its
backend over one pool and one private memory pool with host syncs forbidden; every replay
equals the float32 reference.  The profile's times are test inputs, not measurements.  Run
on a GPU: ``pytest -m gpu tests/runtime/test_bucket_sessions_gpu.py``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.graph_policy import EngineFacts, GraphConfig, ModelFacts, ReplayGate, resolve  # noqa: E402
from attnreg.graph_policy.decode_profile import DecodeProfile  # noqa: E402
from attnreg.registry import Platform, get_registry  # noqa: E402
from attnreg.runtime import MLAConfig, StepInputs, decode_batch  # noqa: E402
from attnreg.runtime.bucket_sessions import BucketSessions  # noqa: E402

pytestmark = pytest.mark.gpu

H, PAGE, CONTEXT = 16, 64, 2048


def _entry(name: str, bucket: int, us: float) -> dict:
    return {"backend": name, "bucket": bucket, "points": [{"kv_len": 1024, "us": us}]}


def test_each_bucket_replays_its_own_backend_in_a_cuda_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    reg = get_registry()
    for name in ("triton", "flashinfer_mla"):
        avail = reg.availability(name)
        if not avail.available:
            pytest.skip(f"{name}: {avail.reason}")
    profile = DecodeProfile.from_dict({
        "schema": "attnreg.decode_profile", "schema_version": 1,
        "platform": str(Platform.detect()), "heads": H, "kv_dtype": "bf16", "page_size": PAGE,
        "entries": [_entry("triton", 1, 10.0), _entry("flashinfer_mla", 1, 20.0),
                    _entry("triton", 8, 30.0), _entry("flashinfer_mla", 8, 15.0)]})
    plan = resolve(profile.platform, ModelFacts(attention="mla", kv_dtype="bf16", num_heads=H),
                   config=GraphConfig(decode_batch_sizes=(1, 8)),
                   engine=EngineFacts(page_size=PAGE, max_context_len=CONTEXT),
                   decode_profile=profile)
    assert plan.decode.backend == "flashinfer_mla", plan.decode.backend_choice
    assert {b.bucket: b.backend for b in plan.decode.bucket_backends} == {
        1: "triton", 8: "flashinfer_mla"}
    cfg = MLAConfig(num_heads=H, page_size=PAGE, device="cuda", max_context_len=CONTEXT)
    backends = {n: reg.create(n, cfg) for n in ("triton", "flashinfer_mla")}
    pool = cfg.make_pool(8 * (CONTEXT // PAGE) + 2)
    g = torch.Generator(device="cuda").manual_seed(0)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g, device="cuda").bfloat16())
    ses = BucketSessions(backends, pool, ReplayGate(plan), writes_kv=False, forbid_sync=True)
    graphs = ses.capture()
    assert sorted((n, b) for n, (_, b) in graphs) == [("flashinfer_mla", 8), ("triton", 1)]
    oracle = reg.create("reference", MLAConfig(num_heads=H, page_size=PAGE, device="cuda",
                                               max_context_len=CONTEXT))
    for lens in ([1500], [100, 2000, 7, 640, 1024]):
        batch = decode_batch(pool, lens)
        q = torch.randn(len(lens), H, 576, generator=g, device="cuda").bfloat16()
        res = ses.run(batch, StepInputs([q]))
        assert res.replayed and res.bucket == (1 if len(lens) == 1 else 8)
        oracle.init_forward_metadata(batch)
        want = oracle.forward_decode(q, None, None, pool, batch)
        err = (res.output.float() - want.float()).norm() / want.float().norm()
        assert err < 2e-2, (ses.backend_for(res.bucket), float(err))
