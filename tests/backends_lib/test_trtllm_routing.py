"""TRTLLMMLABackend routing on a CPU machine, with flashinfer faked (fakes.py).

The seed-000 defect: absorbed (576, 576, 512) tensors reached trtllm's ragged
prefill kernel under capture and hit its assert.  Here absorbed extend always
goes to flashinfer's paged MLA, MHA under any capture mode is refused, and the
ragged kernel is called only with MHA head dims -- checked on the recorded
calls of the (mocked) kernels.  The native kernels are refused off Blackwell
before flashinfer is called; the tests that run them pretend the device is
sm100 (the fakes compute the attention on the CPU)."""

from __future__ import annotations

import contextlib
import dataclasses
import math

import pytest
import torch

from attnreg.backends.reference import attention_with_lse, gather_sequence
from attnreg.graph_policy.capture import (
    break_handler,
    capturing,
    eager_break,
    recording_served,
)
from attnreg.registry import (
    DType,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    UnsupportedError,
    load_registry,
)
from attnreg.runtime import MLAConfig
from attnreg.testing.workload import LARGE_Q_GAINS, round_q

from ._cases import assert_close, expected, make_case, make_pool
from .fakes import Calls, install_fake_flashinfer

CAPTURE_MODES = [GraphMode.BREAKABLE, GraphMode.TC_PIECEWISE]


@pytest.fixture(scope="module")
def reg():
    return load_registry(autoload=False)


def backend(reg, cfg: MLAConfig, *, sm: int | None = None):
    from attnreg.backends.trtllm_mla import TRTLLMMLABackend

    b = TRTLLMMLABackend(cfg, capabilities=reg.declaration("trtllm_mla", "cuda:sm100"))
    if sm is not None:
        b.device_sm = sm  # what device_sm() reports on that GPU
    return b


def assert_ragged_saw_only_mha_dims(calls: Calls) -> None:
    assert all(576 not in c["dims"] for c in calls.trtllm_ragged), calls.trtllm_ragged


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("mode", [None, *CAPTURE_MODES], ids=["eager", *map(str, CAPTURE_MODES)])
def test_absorbed_extend_goes_to_flashinfer_paged_mla(reg, monkeypatch, kv_dtype: str,
                                                      mode: GraphMode | None) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=32, kv_dtype=kv_dtype)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 300)
    case = make_case(cfg, pool, [40, 0], [6, 9], seed=1)
    trt.init_forward_metadata(case.batch)  # eager planning, as under piecewise graphs
    if mode is None:
        got = trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch)
    else:
        with capturing(mode):
            got = trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch)
    assert_close(got, expected(cfg, case), what="extend via flashinfer")
    assert calls.trtllm_ragged == [] and calls.trtllm_decode == []
    assert len(calls.mla_runs) == 1
    # an fp8 pool reaches flashinfer converted to the query dtype
    assert calls.mla_plans[-1]["kv_dtype"] == torch.bfloat16


@pytest.mark.parametrize("mode", CAPTURE_MODES)
def test_capture_fallback_reports_the_declared_target(reg, monkeypatch, mode: GraphMode) -> None:
    """What ran under capture is what the declaration's FALLBACK names."""
    install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=32, kv_dtype="fp8_e4m3")
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 300)
    case = make_case(cfg, pool, [40, 0], [6, 9], seed=2)
    trt.init_forward_metadata(case.batch)
    declared = trt.capabilities.graph_support("prefill", mode).capture.fallback_to
    with recording_served() as served, capturing(mode):
        trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch)
    assert [s.implementation for s in served] == [declared] == ["flashinfer_mla"]
    assert served[0].mode is mode


@pytest.mark.parametrize("mode", CAPTURE_MODES)
def test_mha_under_capture_is_refused_before_any_kernel(reg, monkeypatch,
                                                        mode: GraphMode) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=32)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [0], [8], mha=True)
    trt.init_forward_metadata(case.batch)
    with capturing(mode), pytest.raises(UnsupportedError, match="(?i)mla"):
        trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch,
                           method=ForwardMethod.MHA, k=case.k, v=case.v)
    assert calls.trtllm_ragged == [] and calls.ragged_runs == [] and calls.mla_runs == []


def test_the_backend_itself_refuses_mha_under_capture(reg, monkeypatch) -> None:
    """Below the base class's pinning check: the routing refuses on its own."""
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=32)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [0], [8], mha=True)
    trt.init_forward_metadata(case.batch)
    md = trt.forward_metadata
    out = torch.empty(8, 2, 128, dtype=torch.bfloat16)
    with capturing(GraphMode.TC_PIECEWISE), pytest.raises(UnsupportedError, match="absorbed"):
        trt._forward_extend_impl(case.q, pool, md, out, method=ForwardMethod.MHA,
                                 k=case.k, v=case.v)
    assert calls.trtllm_ragged == []


def test_ragged_kernel_refuses_absorbed_dims_itself(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=32)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [0], [8])
    trt.init_forward_metadata(case.batch)
    q = case.q                                         # [8, 2, 576]
    kv = torch.zeros(8, 2, 576, dtype=torch.bfloat16)  # absorbed "k"
    out = torch.empty(8, 2, 512, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="head dims"):
        trt._run_ragged_kernel(q, kv, kv[..., :512], trt.forward_metadata, out)
    assert calls.trtllm_ragged == []


def test_eager_mha_without_prefix_runs_the_ragged_kernel(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=32)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [0, 0], [8, 13], mha=True, seed=2)
    got = trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch,
                             method=ForwardMethod.MHA, k=case.k, v=case.v)
    assert_close(got, expected(cfg, case, ForwardMethod.MHA), what="ragged")
    assert [c["dims"] for c in calls.trtllm_ragged] == [(192, 192, 128)]
    assert calls.ragged_runs == []
    assert_ragged_saw_only_mha_dims(calls)


def test_eager_mha_with_prefix_runs_flashinfer_ragged(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=32)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [30, 0], [4, 11], mha=True, seed=3)
    got = trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch,
                             method=ForwardMethod.MHA, k=case.k, v=case.v)
    assert_close(got, expected(cfg, case, ForwardMethod.MHA), what="prefix ragged")
    assert calls.trtllm_ragged == [] and calls.ragged_runs == [(192, 192, 128)]


def test_mha_inside_an_eager_break_is_eager(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=2, page_size=32)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [0], [8], mha=True)
    with capturing(GraphMode.BREAKABLE), \
            break_handler(lambda label: contextlib.nullcontext()), eager_break("attn"):
        got = trt.forward_extend(case.q, case.latent_new, case.rope_new, pool,
                                 case.batch, method=ForwardMethod.MHA, k=case.k, v=case.v)
    assert_close(got, expected(cfg, case, ForwardMethod.MHA))
    assert [c["dims"] for c in calls.trtllm_ragged] == [(192, 192, 128)]


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [32, 64])
def test_native_decode_matches_reference(reg, monkeypatch, kv_dtype: str,
                                         page_size: int) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=page_size, kv_dtype=kv_dtype)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 600)
    case = make_case(cfg, pool, [0, 70, 200], [1, 1, 1], decode=True, seed=4)
    got = trt.forward_decode(case.q, case.latent_new, case.rope_new, pool, case.batch)
    if kv_dtype == "fp8_e4m3":
        # an fp8 pool gets an fp8 query (attnreg's per-tensor rounding, declared as
        # q_compute_dtype): its rounding is part of the kernel's answer
        case = dataclasses.replace(case, q=round_q(case.q, DType.FP8_E4M3).to(case.q.dtype))
    assert_close(got, expected(cfg, case), what="trtllm decode")
    call = calls.trtllm_decode[-1]
    assert call["tables"][1] % (128 // page_size) == 0
    assert call["dtype"] == (torch.bfloat16 if kv_dtype == "bf16" else torch.float8_e4m3fn)


def test_captured_decode_pads_tables_and_lengths(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=32)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 1200)
    trt.init_cuda_graph_state(4, 4, max_seq_len=100, graph_modes={"decode": "full"})
    first = make_case(cfg, pool, [10, 20, 30, 40], [1] * 4, decode=True, seed=5)
    trt.init_forward_metadata_capture(4, 4, first.batch)
    replay = make_case(cfg, pool, [60, 3], [1, 1], decode=True, seed=6)
    trt.init_forward_metadata_replay(4, 4, replay.batch)
    q = torch.zeros(4, 16, 576, dtype=torch.bfloat16)
    q[:2] = replay.q
    lat = torch.zeros(4, 512, dtype=torch.bfloat16)
    rope = torch.zeros(4, 64, dtype=torch.bfloat16)
    lat[:2], rope[:2] = replay.latent_new, replay.rope_new
    with capturing(GraphMode.FULL):
        got = trt.forward_decode(q, lat, rope, pool)
    assert_close(got[:2], expected(cfg, replay), what="captured decode")
    # 100 tokens = 4 pages of 32, rounded up to a multiple of 128 / 32
    assert calls.trtllm_decode[-1]["tables"] == (4, 4)


def test_native_kernels_are_refused_off_blackwell(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=32)
    trt = backend(reg, cfg, sm=90)
    pool = make_pool(cfg, 200)
    dec = make_case(cfg, pool, [5], [1], decode=True)
    with pytest.raises(UnsupportedError, match=r"needs sm100/sm103 \(Blackwell\); this is sm90"):
        trt.forward_decode(dec.q, dec.latent_new, dec.rope_new, pool, dec.batch)
    mha = make_case(cfg, pool, [0], [4], mha=True)
    with pytest.raises(UnsupportedError, match="Blackwell"):
        trt.forward_extend(mha.q, mha.latent_new, mha.rope_new, pool, mha.batch,
                           method=ForwardMethod.MHA, k=mha.k, v=mha.v)
    assert calls.trtllm_decode == [] and calls.trtllm_ragged == []
    # while the flashinfer fallback runs anywhere flashinfer does
    ext = make_case(cfg, pool, [9], [3])
    with capturing(GraphMode.TC_PIECEWISE):
        got = trt.forward_extend(ext.q, ext.latent_new, ext.rope_new, pool, ext.batch)
    assert_close(got, expected(cfg, ext))


# -- target verify: the decode kernel with [B, q_len, H, 576] queries -----------------

VERIFY = ForwardMode.TARGET_VERIFY


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [32, 64])
def test_eager_verify_passes_one_query_length_per_request(reg, monkeypatch, kv_dtype: str,
                                                          page_size: int) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=page_size, kv_dtype=kv_dtype)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 600)
    case = make_case(cfg, pool, [0, 70, 200], [2, 2, 2], seed=7, forward_mode=VERIFY)
    with recording_served() as served:
        got = trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch)
    if kv_dtype == "fp8_e4m3":
        case = dataclasses.replace(case, q=round_q(case.q, DType.FP8_E4M3).to(case.q.dtype))
    # causal among the two drafts over the whole prefix (the reference's verify)
    assert_close(got, expected(cfg, case), what="trtllm verify")
    [call] = calls.trtllm_decode
    assert call["query"] == (3, 2, 16, 576)
    assert call["dtype"] == (torch.bfloat16 if kv_dtype == "bf16" else torch.float8_e4m3fn)
    assert call["seq_lens"] == [2, 72, 202]  # whole lengths, the drafts included
    assert call["tables"][0] == 3 and call["tables"][1] % (128 // page_size) == 0
    assert call["max_seq_len"] == 202
    assert calls.mla_runs == [] and calls.trtllm_ragged == []  # not the flashinfer fallback
    assert [s.implementation for s in served] == ["trtllm_mla"]


def test_the_fake_kernel_masks_drafts_causally(reg, monkeypatch) -> None:
    """The oracle above is only as good as the fake: a draft must not see later drafts."""
    install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=32)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [5], [2], seed=8, forward_mode=VERIFY)
    got = trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch)
    keys = gather_sequence(pool, case.batch.page_table[0], 7)[:, None, :]  # 5 + 2 drafts
    # the first draft sees the prefix and itself (6 keys), not the second draft
    first = attention_with_lse(case.q[:1], keys[:6], keys[:6, :, :512], cfg.softmax_scale,
                               causal=False)[0]
    seeing_all = attention_with_lse(case.q[:1], keys, keys[:, :, :512], cfg.softmax_scale,
                                    causal=False)[0]
    assert_close(got[:1], first, what="first draft")
    assert (got[:1].float() - seeing_all).abs().max().item() > 0.1  # the check can fail


def test_captured_verify_replays_with_padded_requests(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=32)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 1200)
    trt.init_cuda_graph_state(4, 8, max_seq_len=100, graph_modes={"decode": "full"})
    trt.init_forward_metadata_capture(4, 8, forward_mode=VERIFY)
    replay = make_case(cfg, pool, [60, 3], [2, 2], seed=9, forward_mode=VERIFY)
    trt.init_forward_metadata_replay(4, 8, replay.batch)
    q = torch.zeros(8, 16, 576, dtype=torch.bfloat16)
    lat = torch.zeros(8, 512, dtype=torch.bfloat16)
    rope = torch.zeros(8, 64, dtype=torch.bfloat16)
    q[:4], lat[:4], rope[:4] = replay.q, replay.latent_new, replay.rope_new
    with capturing(GraphMode.FULL), recording_served() as served:
        got = trt.forward_extend(q, lat, rope, pool)
    assert_close(got[:4], expected(cfg, replay), what="captured verify")
    assert got[4:].abs().max().item() == 0  # the padded requests' rows
    [call] = calls.trtllm_decode
    assert call["query"] == (4, 2, 16, 576)
    # padded requests read q_len padding rows, one per draft token; tables of the
    # graph's width (100 tokens = 4 pages of 32, aligned to 128 / 32)
    assert call["seq_lens"] == [62, 5, 2, 2] and call["tables"] == (4, 4)
    assert [s.implementation for s in served] == ["trtllm_mla"]


def test_verify_beyond_the_declared_drafts_is_refused_before_the_kernel(reg,
                                                                         monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=32)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 400)
    case = make_case(cfg, pool, [10, 20], [3, 3], seed=10, forward_mode=VERIFY)
    with pytest.raises(UnsupportedError, match="<= 2 tokens per sequence"):
        trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch)
    # ragged draft-extend batches are not declared (no cum_seq_lens_q in 0.6.13)
    ragged = make_case(cfg, pool, [10, 20], [1, 2], seed=11,
                       forward_mode=ForwardMode.DRAFT_EXTEND)
    with pytest.raises(UnsupportedError, match="does not declare draft_extend"):
        trt.forward_extend(ragged.q, ragged.latent_new, ragged.rope_new, pool, ragged.batch)
    assert calls.trtllm_decode == [] and calls.mla_runs == []


def test_uneven_verify_metadata_is_refused_by_the_routing_itself(reg, monkeypatch) -> None:
    """Below the base class's uniform check: requests of different draft counts never
    reach the kernel's single ``q_len_per_request``."""
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=32)
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 400)
    case = make_case(cfg, pool, [10, 20], [2, 2], seed=12, forward_mode=VERIFY)
    trt.init_forward_metadata(case.batch)
    md = dataclasses.replace(trt.forward_metadata, num_tokens=3, extend_lens_cpu=(1, 2))
    out = torch.empty(3, 16, 512, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match=r"one query length for every request.*\[1, 2\]"):
        trt._forward_extend_impl(case.q[:3], pool.layer(0), md, out, method=ForwardMethod.MLA,
                                 k=None, v=None)
    assert calls.trtllm_decode == []


def test_verify_is_refused_off_blackwell(reg, monkeypatch) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=32)
    trt = backend(reg, cfg, sm=90)
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [5], [2], forward_mode=VERIFY)
    with pytest.raises(UnsupportedError, match="Blackwell"):
        trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch)
    assert calls.trtllm_decode == [] and calls.mla_runs == []


@pytest.mark.parametrize("check", ["eager", "replay", "padded_rows"])
def test_verify_claims_hold_through_the_conformance_harness(reg, monkeypatch,
                                                           check: str) -> None:
    """The sm100 declaration's bf16 verify claims, checked by the conformance suite's own
    harness (float64 oracle, whole-KV integrity, padded graph rows) on the CPU profile,
    with the trtllm kernel faked and the device reported as sm100."""
    import attnreg.backends.trtllm_mla as trt_module
    from attnreg.registry import Platform
    from attnreg.testing.claims import expand_claims
    from attnreg.testing.harness import Harness

    calls = install_fake_flashinfer(monkeypatch)
    monkeypatch.setattr(trt_module, "device_sm", lambda device: 100)
    platform = Platform.parse("cuda:sm100")
    caps = reg.declaration("trtllm_mla", platform)

    class FakedHarness(Harness):
        def create(self, claim, config):  # the registry would refuse: no flashinfer here
            return trt_module.TRTLLMMLABackend(config, capabilities=caps)

    [claim] = [c for c in expand_claims(caps, "cpu")
               if c.forward_mode is VERIFY and "bf16-bf16" in c.id
               and (c.id.startswith("trtllm_mla/eager/") if check == "eager"
                    else f"/target_verify/{check}/" in c.id)]
    FakedHarness(reg, "cpu", platform).check(claim)
    assert calls.trtllm_decode and {c["query"][1] for c in calls.trtllm_decode} == {2}
    assert calls.mla_runs == []  # served by the trtllm kernel, not the fallback


# -- an FP8 pool: q scaled per tensor before the fp8 cast --------------------------------


def _large(case):
    """``case`` with query rows gained as the suite's fp8_large_q claims gain them."""
    gains = torch.tensor([LARGE_Q_GAINS[i % len(LARGE_Q_GAINS)]
                          for i in range(case.q.shape[0])])
    return dataclasses.replace(case, q=(case.q.float() * gains[:, None, None]).to(case.q.dtype))


@pytest.mark.parametrize("verify", [False, True], ids=["decode", "verify"])
def test_large_queries_stay_finite_and_right_over_an_fp8_pool(reg, monkeypatch,
                                                              verify: bool) -> None:
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=32, kv_dtype="fp8_e4m3")
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 600)
    if verify:
        case = _large(make_case(cfg, pool, [0, 70, 200], [2, 2, 2], seed=17,
                                forward_mode=VERIFY))
        got = trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch)
    else:
        case = _large(make_case(cfg, pool, [0, 70, 200], [1, 1, 1], decode=True, seed=16))
        got = trt.forward_decode(case.q, case.latent_new, case.rope_new, pool, case.batch)
    assert case.q.abs().max().item() > 2000  # far beyond fp8 e4m3's 448
    assert torch.isfinite(got).all()
    rounded = dataclasses.replace(case, q=round_q(case.q, DType.FP8_E4M3).to(case.q.dtype))
    assert_close(got, expected(cfg, rounded), what="large q over an fp8 pool")
    [call] = calls.trtllm_decode
    assert call["dtype"] == torch.float8_e4m3fn
    scale = call["bmm1_scale"]
    assert isinstance(scale, torch.Tensor) and scale.dtype == torch.float32
    # the descale is a power of two >= amax / 448, folded into sm_scale * kv_scale
    # (a float32 product: equal to float32 precision)
    descale = scale.item() / (cfg.softmax_scale * pool.kv_scale)
    power = 2.0 ** round(math.log2(descale))
    assert descale == pytest.approx(power, rel=1e-6)
    assert case.q.abs().max().item() / power <= 448 < 2 * case.q.abs().max().item() / power


def test_an_unscaled_cast_would_be_caught_by_the_same_comparison(reg, monkeypatch) -> None:
    """The test above can fail: the plain cast it replaced gives a wrong answer."""
    install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=32, kv_dtype="fp8_e4m3")
    pool = make_pool(cfg, 600)
    case = _large(make_case(cfg, pool, [0, 70, 200], [1, 1, 1], decode=True, seed=16))
    plain = dataclasses.replace(case, q=case.q.to(torch.float8_e4m3fn).to(case.q.dtype))
    rounded = dataclasses.replace(case, q=round_q(case.q, DType.FP8_E4M3).to(case.q.dtype))
    with pytest.raises(AssertionError):
        assert_close(expected(cfg, plain), expected(cfg, rounded), what="plain cast")


def test_captured_fp8_decode_passes_the_scale_as_a_tensor(reg, monkeypatch) -> None:
    """Under capture the q scale is computed on the device (no host read) and reaches the
    kernel as a float32 tensor; the graph's padded requests do not set it."""
    calls = install_fake_flashinfer(monkeypatch)
    cfg = MLAConfig(num_heads=16, page_size=32, kv_dtype="fp8_e4m3")
    trt = backend(reg, cfg, sm=100)
    pool = make_pool(cfg, 1200)
    trt.init_cuda_graph_state(4, 4, max_seq_len=100, graph_modes={"decode": "full"})
    first = make_case(cfg, pool, [10, 20, 30, 40], [1] * 4, decode=True, seed=5)
    trt.init_forward_metadata_capture(4, 4, first.batch)
    replay = _large(make_case(cfg, pool, [60, 3], [1, 1], decode=True, seed=6))
    trt.init_forward_metadata_replay(4, 4, replay.batch)
    q = torch.full((4, 16, 576), 60000.0, dtype=torch.bfloat16)  # stale padded rows
    q[:2] = replay.q
    lat = torch.zeros(4, 512, dtype=torch.bfloat16)
    rope = torch.zeros(4, 64, dtype=torch.bfloat16)
    lat[:2], rope[:2] = replay.latent_new, replay.rope_new
    with capturing(GraphMode.FULL):
        got = trt.forward_decode(q, lat, rope, pool)
    assert torch.isfinite(got[:2]).all()
    rounded = dataclasses.replace(replay, q=round_q(replay.q, DType.FP8_E4M3)
                                  .to(replay.q.dtype))
    assert_close(got[:2], expected(cfg, rounded), what="captured fp8 decode")
    scale = calls.trtllm_decode[-1]["bmm1_scale"]
    assert isinstance(scale, torch.Tensor) and scale.dtype == torch.float32
    assert scale.item() / (cfg.softmax_scale * pool.kv_scale) < 60000 / 448


@pytest.mark.parametrize("where", ["eager/decode/mla/fp8_large_q",
                                   "eager/decode/mla/target_verify/fp8_large_q",
                                   "capture/decode/full/fp8_large_q",
                                   "capture/decode/full/target_verify/fp8_large_q"])
@pytest.mark.parametrize("scaled", [True, False], ids=["scaled", "plain_cast"])
def test_fp8_large_q_claims_hold_and_catch_the_plain_cast(reg, monkeypatch, where: str,
                                                          scaled: bool) -> None:
    """The suite's fp8_large_q claims of the sm100 declaration, through its own harness
    (trtllm kernel faked, device reported as sm100): they hold with the scaled q and are
    refuted with the plain cast the backend used to do."""
    import attnreg.backends.trtllm_mla as trt_module
    from attnreg.registry import Platform
    from attnreg.testing.claims import expand_claims
    from attnreg.testing.errors import ClaimRefuted
    from attnreg.testing.harness import Harness

    install_fake_flashinfer(monkeypatch)
    monkeypatch.setattr(trt_module, "device_sm", lambda device: 100)
    if not scaled:
        def plain_cast(q, live):
            return q.to(torch.float8_e4m3fn), torch.ones(1, dtype=torch.float32)
        monkeypatch.setattr(trt_module, "quantize_q_fp8", plain_cast)
    platform = Platform.parse("cuda:sm100")
    caps = reg.declaration("trtllm_mla", platform)

    class FakedHarness(Harness):
        def create(self, claim, config):  # the registry would refuse: no flashinfer here
            return trt_module.TRTLLMMLABackend(config, capabilities=caps)

    [claim] = [c for c in expand_claims(caps, "cpu") if f"trtllm_mla/{where}/mla/" in c.id
               or (c.id.startswith(f"trtllm_mla/{where}/") and "/mla/" in c.id)]
    harness = FakedHarness(reg, "cpu", platform)
    if scaled:
        harness.check(claim)
    else:
        with pytest.raises(ClaimRefuted, match="without a scale"):
            harness.check(claim)
