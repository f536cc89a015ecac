"""Triton backend vs the reference on a real GPU, bigger shapes, and real CUDA graph
capture / replay (through attnreg.runtime.GraphSession) with other lengths and contents
per replay."""

from __future__ import annotations

import pytest
import torch

from attnreg.backends.declarations.triton_sizing import decode_rounds_q
from attnreg.registry import ForwardMethod, ForwardMode, UnsupportedError, get_registry
from attnreg.runtime import CudaGraphRecorder, GraphSession, MLAConfig, StepInputs
from attnreg.testing.kv_canary import Canary
from attnreg.testing.workload import round_q

from ._scenarios import FP8_SCALE, make_scenario

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def backends(cfg: MLAConfig, **options: object):
    reg = get_registry()
    return reg.create("triton", cfg, **options), reg.create("reference", cfg)


def assert_close(got: torch.Tensor, want: torch.Tensor, atol: float = 2e-2) -> None:
    err = (got.float() - want.float()).abs().max().item()
    assert err <= atol, f"max abs error {err} > {atol}"


def q_dtype_for(kv_dtype: str) -> torch.dtype:
    return DTYPES.get(kv_dtype, torch.bfloat16)


DECODE_CASES = [(16, ps, kv) for ps in (1, 16, 32, 64) for kv in ("bf16", "fp8_e4m3")] + [
    (128, 16, "fp16"), (128, 64, "fp8_e4m3"), (128, 1, "bf16")]


@pytest.mark.parametrize("heads,page_size,kv_dtype", DECODE_CASES)
def test_decode_matches_reference(heads: int, page_size: int, kv_dtype: str) -> None:
    cfg = MLAConfig(num_heads=heads, page_size=page_size, kv_dtype=kv_dtype, device="cuda")
    tri, ref = backends(cfg)
    prefix = [0, 1, 255, 256, 1000, 3071]  # around the 256-token split chunk
    sc = make_scenario(cfg, prefix, [1] * len(prefix), decode=True, seed=heads + page_size,
                       q_dtype=q_dtype_for(kv_dtype))
    got = tri.forward_decode(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch)
    assert tri.forward_metadata is not None and tri.forward_metadata.plan.splits > 1
    # triton over an fp8 cache at 1-16 and 33+ heads computes with q rounded per row
    # (declared)
    q = round_q(sc.q, "fp8_e4m3", "row") if decode_rounds_q(heads, kv_dtype) else sc.q
    want = ref.forward_decode(q.to(sc.q.dtype), None, None, sc.pool, sc.batch)
    assert_close(got, want)


EXTEND_CASES = [(16, ps, kv) for ps in (1, 64) for kv in ("bf16", "fp8_e4m3")] + [
    (128, 16, "bf16"), (16, 32, "fp16")]


@pytest.mark.parametrize("heads,page_size,kv_dtype", EXTEND_CASES)
@pytest.mark.parametrize("prefix", [[0, 0, 0], [700, 0, 33]], ids=["no_prefix", "prefix"])
def test_mla_extend_matches_reference(heads: int, page_size: int, kv_dtype: str,
                                      prefix: list[int]) -> None:
    cfg = MLAConfig(num_heads=heads, page_size=page_size, kv_dtype=kv_dtype, device="cuda")
    tri, ref = backends(cfg)
    sc = make_scenario(cfg, prefix, [129, 300, 1], seed=7, q_dtype=q_dtype_for(kv_dtype))
    got = tri.forward_extend(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch)
    want = ref.forward_extend(sc.q, None, None, sc.pool, sc.batch)
    assert_close(got, want)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("prefix", [[0, 0], [500, 37]], ids=["no_prefix", "prefix"])
def test_mha_extend_matches_reference(dtype: str, prefix: list[int]) -> None:
    cfg = MLAConfig(num_heads=16, page_size=16, device="cuda", kv_dtype=dtype, q_dtype=dtype)
    tri, ref = backends(cfg)
    sc = make_scenario(cfg, prefix, [200, 63], mha=True, seed=8, q_dtype=DTYPES[dtype])
    got = tri.forward_extend(sc.q, None, None, None, sc.batch, method="mha", k=sc.k, v=sc.v)
    want = ref.forward_extend(sc.q, None, None, None, sc.batch, method="mha", k=sc.k, v=sc.v)
    assert_close(got, want)


def _churn() -> None:
    """Allocate and free memory between replays: a graph that recorded freed storage
    would now read or write reused memory."""
    junk = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(8)]
    del junk
    torch.cuda.empty_cache()


@pytest.mark.parametrize("heads,page_size,kv_dtype", [(16, 16, "fp8_e4m3"), (128, 1, "bf16")])
def test_decode_cuda_graph_replays_other_lengths_and_contents(heads: int, page_size: int,
                                                               kv_dtype: str) -> None:
    cfg = MLAConfig(num_heads=heads, page_size=page_size, kv_dtype=kv_dtype, device="cuda")
    tri, ref = backends(cfg)
    bs, max_seq = 6, 4096
    pool = cfg.make_pool(4 * (max_seq // page_size) * 6 + 8,
                         scale=FP8_SCALE if kv_dtype == "fp8_e4m3" else 1.0)
    canary = Canary.fill(pool)
    session = GraphSession(tri, pool, phase="decode", mode="full", buckets=[bs],
                           max_seq_len=max_seq, before_replay=_churn)
    key = (ForwardMode.DECODE, bs)
    session.init_graph_state()
    session.bind(key)
    assert tri.forward_metadata is not None
    assert tri.forward_metadata.plan.splits > 1, "split-KV must survive capture"
    session.record(key)
    assert session.statics is not None
    static_out = session.statics.outs[0]
    written: list[int] = []
    replays = [[0, 5, 300, 4095, 17, 1], [2000, 3], [255, 256, 257, 1023, 1024, 3000],
               [4000, 0, 0, 0]]
    for step, prefix in enumerate(replays):
        sc = make_scenario(cfg, prefix, [1] * len(prefix), decode=True, seed=step, pool=pool)
        b = sc.batch.batch_size
        static_out.fill_(float("nan"))
        # the session's replay runs the runner's before_replay hook (allocator churn) first
        session.replay(sc.batch, StepInputs.one(sc.q, sc.latent_new, sc.rope_new), bucket=bs)
        torch.cuda.synchronize()
        q = round_q(sc.q, "fp8_e4m3", "row") if decode_rounds_q(heads, kv_dtype) else sc.q
        want = ref.forward_decode(q, None, None, pool, sc.batch)
        assert_close(static_out[:b], want)
        assert torch.count_nonzero(static_out[b:].float().nan_to_num(1.0)) == 0, \
            "padded rows must be 0"
        written += sc.batch.out_cache_loc.tolist()
        for pages_b, p in zip(sc.batch.page_table.tolist(), prefix):
            written += pool.slots(pages_b, range(p))
        assert canary.corrupted_slots(written) == [], f"replay {step} wrote outside its slots"
        pool.free([p for row in sc.batch.page_table.tolist() for p in row if p])


def test_absorbed_extend_cuda_graph_replays_other_lengths_and_contents() -> None:
    cfg = MLAConfig(num_heads=16, page_size=16, kv_dtype="bf16", device="cuda")
    tri, ref = backends(cfg)
    bs, tokens = 4, 256
    pool = cfg.make_pool(600)
    canary = Canary.fill(pool)
    session = GraphSession(tri, pool, phase="prefill", mode="breakable", buckets=[tokens],
                           max_requests=bs, max_seq_len=2048, method=ForwardMethod.MLA,
                           before_replay=_churn)
    session.capture()
    assert session.statics is not None
    static_out = session.statics.outs[0]
    written: list[int] = []
    replays = [([0, 100, 1500, 7], [64, 64, 64, 64]), ([1000], [256]),
               ([0, 0, 3], [1, 200, 2])]
    for step, (prefix, extend) in enumerate(replays):
        sc = make_scenario(cfg, prefix, extend, seed=10 + step, pool=pool)
        t = sc.batch.num_tokens
        static_out.fill_(float("nan"))
        # the session's replay runs the runner's before_replay hook (allocator churn) first
        session.replay(sc.batch, StepInputs.one(sc.q, sc.latent_new, sc.rope_new),
                       bucket=tokens)
        torch.cuda.synchronize()
        want = ref.forward_extend(sc.q, None, None, pool, sc.batch)
        assert_close(static_out[:t], want)
        assert torch.count_nonzero(static_out[t:].float().nan_to_num(1.0)) == 0, \
            "padded rows must be 0"
        written += sc.batch.out_cache_loc.tolist()
        for pages_b, p in zip(sc.batch.page_table.tolist(), prefix):
            written += pool.slots(pages_b, range(p))
        assert canary.corrupted_slots(written) == [], f"replay {step} wrote outside its slots"
        pool.free([p for row in sc.batch.page_table.tolist() for p in row if p])


def test_reference_refuses_a_real_capture_without_a_capture_context() -> None:
    """A stream that is capturing counts as capture even with no capturing() context."""
    cfg = MLAConfig(num_heads=16, page_size=16, device="cuda")
    _, ref = backends(cfg)
    sc = make_scenario(cfg, [10], [1], decode=True)
    ref.init_forward_metadata(sc.batch)
    # the runner's recorder alone: a raw stream capture, no capturing() context
    recorder = CudaGraphRecorder(torch.cuda.graph_pool_handle())
    handle = recorder.begin()
    try:
        with pytest.raises(UnsupportedError, match="decode under full graph capture"):
            ref.forward_decode(sc.q, sc.latent_new, sc.rope_new, sc.pool, sc.batch)
    finally:
        recorder.end(handle)
