"""BucketSessions on a cpu: a plan resolved with a decode profile captures each decode bucket
with its own backend over one pool and one runner; the gate picks the bucket, the step runs
through that bucket's backend, the outputs equal the reference, and eager steps run on the
phase's backend.  Two capturable backends run on a cpu: triton (interpreter, tiny shapes) and
``triton_twin``, a test plugin registering the same kernels under another name and a lower
priority (the reference backend declares no decode capture)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.backends.declarations import triton as triton_declaration  # noqa: E402
from attnreg.backends.declarations._common import TORCH, TRITON  # noqa: E402
from attnreg.graph_policy import EngineFacts, GraphConfig, ModelFacts, ReplayGate, resolve  # noqa: E402
from attnreg.graph_policy.decode_profile import DecodeProfile  # noqa: E402
from attnreg.registry import BackendSpec, get_registry, hookimpl  # noqa: E402
from attnreg.registry.manager import load_registry  # noqa: E402
from attnreg.runtime import MLAConfig, SessionError, decode_batch  # noqa: E402
from attnreg.runtime.bucket_sessions import BucketSessions  # noqa: E402

from ._session_inputs import random_inputs, random_pool  # noqa: E402

H, PAGE = 2, 16
TWIN = "triton_twin"


class _TwinPlugin:
    """triton's declaration and runtime under another name, priority below triton's."""

    @hookimpl
    def attnreg_register_backends(self, register):  # type: ignore[no-untyped-def]
        def capabilities(ctx):  # type: ignore[no-untyped-def]
            from dataclasses import replace
            return replace(triton_declaration.capabilities(ctx), backend=TWIN, priority=5)
        register(BackendSpec(name=TWIN, summary="tests only: triton under another name",
                             capabilities=capabilities,
                             runtime="attnreg.backends.triton_mla:TritonMLABackend",
                             requires=(TORCH, TRITON)))


@pytest.fixture(scope="module")
def reg():  # type: ignore[no-untyped-def]
    # flashinfer_mla (the sm90 default for page 16, bf16) is blocked: it has no cpu kernel
    return load_registry(["flashinfer_mla"], autoload=False,
                         extra_plugins=[("twin", _TwinPlugin())])


def _profile(fast_at_1: str) -> DecodeProfile:
    slow = "triton" if fast_at_1 == TWIN else TWIN

    def entry(name: str, bucket: int, us: float) -> dict:
        return {"backend": name, "bucket": bucket,
                "points": [{"kv_len": 64, "us": us}, {"kv_len": 200, "us": 2 * us}]}
    return DecodeProfile.from_dict({
        "schema": "attnreg.decode_profile", "schema_version": 1, "platform": "cuda:sm90",
        "heads": H, "kv_dtype": "bf16", "page_size": PAGE,
        "entries": [entry(fast_at_1, 1, 10.0), entry(slow, 1, 20.0),
                    entry(fast_at_1, 4, 30.0), entry(slow, 4, 15.0)]})


def _plan(profile: DecodeProfile, reg):  # type: ignore[no-untyped-def]
    return resolve("h200", ModelFacts(attention="mla", kv_dtype="bf16", num_heads=H),
                   registry=reg, assume_installed=True,
                   config=GraphConfig(decode_batch_sizes=(1, 4)),
                   engine=EngineFacts(page_size=PAGE, max_context_len=256),
                   decode_profile=profile)






def test_each_bucket_replays_through_the_backend_the_plan_gave_it(reg):
    plan = _plan(_profile(fast_at_1=TWIN), reg)
    assert plan.decode.backend == "triton"
    assert [(b.bucket, b.backend) for b in plan.decode.bucket_backends] == [
        (1, TWIN), (4, "triton")]
    cfg = MLAConfig(num_heads=H, page_size=PAGE, max_context_len=256)
    backends = {"triton": reg.create("triton", cfg), TWIN: reg.create(TWIN, cfg)}
    pool = random_pool(cfg)
    ses = BucketSessions(backends, pool, ReplayGate(plan), writes_kv=False,
                         device_graphs=False)
    assert {n: s.buckets for n, s in ses.sessions.items()} == {TWIN: (1,),
                                                                "triton": (4,)}
    assert all(s.runner is ses.runner for s in ses.sessions.values()), "one runner, one pool"
    graphs = ses.capture()
    # the session of the largest bucket captures first (the shared pool is sized by it)
    assert [(n, b) for n, (_, b) in graphs] == [("triton", 4), (TWIN, 1)]
    calls: list[str] = []
    for name, backend in backends.items():
        real = backend.forward_decode

        def spy(*a, _real=real, _name=name, **k):  # type: ignore[no-untyped-def]
            calls.append(_name)
            return _real(*a, **k)
        backend.forward_decode = spy  # type: ignore[method-assign]
    for lens, bucket, owner in (([40], 1, TWIN), ([30, 100, 7], 4, "triton")):
        batch, inputs = decode_batch(pool, lens), random_inputs(len(lens), H, seed=len(lens))
        calls.clear()
        res = ses.run(batch, inputs)
        assert res.replayed and res.bucket == bucket and calls == [owner]
        calls.clear()
        eager = ses.sessions[owner].eager(batch, inputs)[0]
        assert torch.allclose(res.output.float(), eager.float(), atol=2e-2)
    # more requests than the largest bucket: eager, on the phase's backend (triton)
    calls.clear()
    big = ses.run(decode_batch(pool, [9] * 5), random_inputs(5, H, seed=9))
    assert not big.replayed and big.reason.rule == "gate.batch_slots" and calls == ["triton"]
    assert ses.eager_backend == "triton"
    assert ses.counts.replays == 2 and ses.counts.eager == {"gate.batch_slots": 1}


def test_outputs_equal_the_reference_at_every_bucket(reg):
    plan = _plan(_profile(fast_at_1="triton"), reg)
    assert [(b.bucket, b.backend) for b in plan.decode.bucket_backends] == [
        (1, "triton"), (4, TWIN)]
    cfg = MLAConfig(num_heads=H, page_size=PAGE, max_context_len=256)
    backends = {"triton": reg.create("triton", cfg), TWIN: reg.create(TWIN, cfg)}
    oracle = get_registry().create("reference", cfg)
    pool = random_pool(cfg)
    ses = BucketSessions(backends, pool, ReplayGate(plan), writes_kv=False,
                         device_graphs=False)
    ses.capture()
    for lens in ([50], [20, 200, 3]):
        batch, inputs = decode_batch(pool, lens), random_inputs(len(lens), H, seed=7 + len(lens))
        res = ses.run(batch, inputs)
        assert res.replayed
        oracle.init_forward_metadata(batch)
        want = oracle.forward_decode(inputs.q[0], None, None, pool, batch)
        assert torch.allclose(res.output.float(), want.float(), atol=2e-2)


def test_a_missing_backend_or_another_pool_is_refused(reg):
    plan = _plan(_profile(fast_at_1=TWIN), reg)
    cfg = MLAConfig(num_heads=H, page_size=PAGE, max_context_len=256)
    pool = random_pool(cfg)
    with pytest.raises(ValueError, match=r"give an instance of \['triton_twin'\]"):
        BucketSessions({"triton": reg.create("triton", cfg)}, pool, ReplayGate(plan),
                       device_graphs=False)
    other = MLAConfig(num_heads=H, page_size=32, max_context_len=256)
    with pytest.raises(ValueError, match="must read the one pool"):
        BucketSessions({"triton": reg.create("triton", cfg),
                        TWIN: reg.create(TWIN, other)}, pool, ReplayGate(plan),
                       device_graphs=False)
    ses = BucketSessions({"triton": reg.create("triton", cfg),
                          TWIN: reg.create(TWIN, cfg)}, pool, ReplayGate(plan),
                         device_graphs=False)
    with pytest.raises(SessionError, match="no decode bucket 2"):
        ses.session_for(2)
