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

import pytest
import torch

from attnreg.graph_policy.capture import (
    break_handler,
    capturing,
    eager_break,
    recording_served,
)
from attnreg.registry import ForwardMethod, GraphMode, UnsupportedError, load_registry
from attnreg.runtime import MLAConfig

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
        # an fp8 pool gets an fp8 query: its rounding is part of the kernel's answer
        case = dataclasses.replace(case, q=case.q.to(torch.float8_e4m3fn).to(case.q.dtype))
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
