"""Declarations against what the runtime classes do, on a CPU machine.

Every built-in backend is built with its declaration for cpu / sm90 / sm100
(flashinfer and flash-attn-4 faked, see fakes.py; triton in the Triton
interpreter) and asked, under each prefill capture mode, which forward method
it pins (:meth:`AttentionBackend.forward_method_for`).  The answer must be the
declaration's, a pinned mode must refuse every other declared method before any
kernel library is called, and a mode without pinning must let the MHA companion
through (flash_attn_cute on sm90 captures it under BREAKABLE).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from attnreg.graph_policy.capture import break_handler, capturing, eager_break
from attnreg.registry import (
    ForwardMethod,
    GraphMode,
    Phase,
    UnsupportedError,
    load_registry,
)
from attnreg.runtime import AttentionBackend, MLAConfig

from ._cases import assert_close, expected, make_case, make_pool
from .fakes import install_fake_flash_attn_cute, install_fake_flashinfer

PLATFORMS = ("cpu", "cuda:sm90", "cuda:sm100")
BUILTINS = ("reference", "triton", "flashinfer_mla", "trtllm_mla", "flash_attn_cute")
PREFILL_MODES = (GraphMode.BREAKABLE, GraphMode.TC_PIECEWISE)

#: (backend, declaration platform): every built-in on each platform it declares kernels on.
RUNTIMES = [("reference", "cpu"), ("triton", "cpu"), ("flashinfer_mla", "cuda:sm90"),
            ("flashinfer_mla", "cuda:sm100"), ("trtllm_mla", "cuda:sm100"),
            ("flash_attn_cute", "cuda:sm90"), ("flash_attn_cute", "cuda:sm100")]


@pytest.fixture(scope="module")
def reg():
    return load_registry(autoload=False)


class _KernelLog:
    """What any kernel library was asked to do, whichever backend is under test."""

    def __init__(self) -> None:
        self.triton: list[str] = []
        self.flashinfer: Any = None
        self.fa4: list[dict[str, Any]] = []

    def empty(self) -> bool:
        fi = self.flashinfer
        fi_calls = 0 if fi is None else (len(fi.mla_runs) + len(fi.ragged_runs)
                                         + len(fi.trtllm_ragged) + len(fi.trtllm_decode))
        return not self.triton and not self.fa4 and fi_calls == 0


def build(reg, monkeypatch, name: str, platform: str, cfg: MLAConfig
          ) -> tuple[AttentionBackend, _KernelLog]:
    """The backend's runtime class with its declaration for ``platform``; kernels logged."""
    log = _KernelLog()
    caps = reg.declaration(name, platform)
    sm = {"cuda:sm90": 90, "cuda:sm100": 100}.get(platform)
    if name == "reference":
        from attnreg.backends.reference import ReferenceBackend
        return ReferenceBackend(cfg, capabilities=caps), log
    if name == "triton":
        from attnreg.backends import triton_mla
        for kernel in ("mla_decode", "mla_extend", "mha_prefill"):
            real = getattr(triton_mla, kernel)

            def logged(*args: Any, _real: Any = real, _name: str = kernel, **kw: Any) -> Any:
                log.triton.append(_name)
                return _real(*args, **kw)

            monkeypatch.setattr(triton_mla, kernel, logged)
        return triton_mla.TritonMLABackend(cfg, capabilities=caps), log
    if name == "flash_attn_cute":
        from attnreg.backends.flash_attn_cute import FlashAttnCuteBackend
        log.fa4 = install_fake_flash_attn_cute(monkeypatch)
        b: Any = FlashAttnCuteBackend(cfg, capabilities=caps)
        b.device_sm = sm  # what device_sm() reports on that GPU
        return b, log
    log.flashinfer = install_fake_flashinfer(monkeypatch)
    if name == "flashinfer_mla":
        from attnreg.backends.flashinfer_mla import FlashInferMLABackend
        return FlashInferMLABackend(cfg, capabilities=caps), log
    from attnreg.backends.trtllm_mla import TRTLLMMLABackend
    b = TRTLLMMLABackend(cfg, capabilities=caps)
    b.device_sm = sm
    return b, log


def _config(name: str, platform: str) -> MLAConfig:
    # trtllm_mla's declared pages are 32 / 64; everything else takes 16
    return MLAConfig(num_heads=2, page_size=32 if name == "trtllm_mla" else 16)


# ----------------------------------------------------------------------------------------
# the declarations themselves
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", BUILTINS)
def test_a_pinned_method_is_one_the_backend_has_in_that_phase(reg, name: str,
                                                              platform: str) -> None:
    """Pinning a method the backend cannot run would refuse every captured batch."""
    caps = reg.declaration(name, platform)
    if caps.platform_reason:
        pytest.skip(caps.platform_reason)
    for gm in caps.graph_modes:
        if gm.pinned_method is not None:
            assert gm.pinned_method in caps.methods(gm.phase), (gm.phase, gm.mode)


def test_triton_declares_no_bf16_query_over_an_fp16_pool(reg) -> None:
    """Its kernels take a 16-bit cache only in the query dtype (or fp8)."""
    for platform in ("cpu", "cuda:sm90"):
        caps = reg.declaration("triton", platform)
        for phase in ("decode", "prefill"):
            assert caps.check_request("mla", phase, q_dtype="bf16", kv_dtype="fp16",
                                      page_size=16)
            assert caps.check_request("mla", phase, q_dtype="fp16", kv_dtype="bf16",
                                      page_size=16)
            for q in ("bf16", "fp16"):
                for kv in (q, "fp8_e4m3"):
                    assert caps.check_request("mla", phase, q_dtype=q, kv_dtype=kv,
                                              page_size=16) == [], (phase, q, kv)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_triton_refuses_a_mixed_16bit_pool_from_its_declaration(reg, monkeypatch,
                                                                phase: str) -> None:
    cfg = MLAConfig(num_heads=2, page_size=16, q_dtype="bf16", kv_dtype="fp16")
    tri, log = build(reg, monkeypatch, "triton", "cpu", cfg)
    pool = make_pool(cfg, 64)
    case = make_case(cfg, pool, [5], [1] if phase == "decode" else [3],
                     decode=phase == "decode")
    with pytest.raises(UnsupportedError, match=r"kv dtype fp16 not in \['bf16', 'fp8_e4m3'\]"):
        tri.forward(case.q, case.latent_new, case.rope_new, pool, case.batch)
    assert log.triton == []


# ----------------------------------------------------------------------------------------
# pinning at run time
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", PREFILL_MODES, ids=str)
@pytest.mark.parametrize("name,platform", RUNTIMES)
def test_forward_method_for_is_the_declared_pin(reg, monkeypatch, name: str, platform: str,
                                                mode: GraphMode) -> None:
    cfg = _config(name, platform)
    backend, _ = build(reg, monkeypatch, name, platform, cfg)
    support = backend.capabilities.graph_support("prefill", mode)
    assert backend.forward_method_for("prefill") is None  # eager: the caller chooses
    if support.capture.is_unsupported:
        with capturing(mode), pytest.raises(UnsupportedError, match=str(mode)):
            backend.forward_method_for("prefill")
        return
    with capturing(mode):
        assert backend.forward_method_for("prefill") is support.pinned_method
    assert backend.forward_method_for("prefill", mode) is support.pinned_method
    for method in backend.capabilities.methods("prefill"):
        if support.pinned_method in (None, method):
            backend.check_graph_mode("prefill", mode, method)
        else:
            with pytest.raises(UnsupportedError, match=f"pins {support.pinned_method}"):
                backend.check_graph_mode("prefill", mode, method)


@pytest.mark.parametrize("mode", PREFILL_MODES, ids=str)
@pytest.mark.parametrize("name,platform", [r for r in RUNTIMES if r[0] != "reference"])
def test_a_pinned_mode_refuses_the_mha_companion_before_any_kernel(
        reg, monkeypatch, name: str, platform: str, mode: GraphMode) -> None:
    cfg = _config(name, platform)
    backend, log = build(reg, monkeypatch, name, platform, cfg)
    pinned = backend.capabilities.graph_support("prefill", mode).pinned_method
    if pinned is None or ForwardMethod.MHA not in backend.capabilities.methods("prefill"):
        pytest.skip(f"{name} on {platform} pins nothing under {mode}, or has no MHA")
    pool = make_pool(cfg, 200)
    case = make_case(cfg, pool, [7], [5], mha=True)
    backend.init_forward_metadata(case.batch)  # planned eagerly, as under piecewise graphs
    with capturing(mode), pytest.raises(UnsupportedError, match=f"pins {pinned}"):
        backend.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch,
                               method=ForwardMethod.MHA, k=case.k, v=case.v)
    assert log.empty()


def test_forward_method_for_follows_the_active_mode(reg, monkeypatch) -> None:
    backend, _ = build(reg, monkeypatch, "triton", "cpu", MLAConfig(num_heads=2, page_size=16))
    assert backend.forward_method_for(Phase.PREFILL) is None
    with capturing(GraphMode.BREAKABLE):
        assert backend.forward_method_for(Phase.PREFILL) is ForwardMethod.MLA
        with break_handler(lambda label: contextlib.nullcontext()), eager_break("attn"):
            assert backend.forward_method_for(Phase.PREFILL) is None  # eager inside a break
    with capturing(GraphMode.TC_PIECEWISE):
        assert backend.forward_method_for(Phase.PREFILL) is None
    assert backend.forward_method_for("decode", "full") is ForwardMethod.MLA


def test_trtllm_pins_mla_under_both_prefill_modes_and_falls_back_to_flashinfer(
        reg, monkeypatch) -> None:
    cfg = _config("trtllm_mla", "cuda:sm100")
    trt, log = build(reg, monkeypatch, "trtllm_mla", "cuda:sm100", cfg)
    pool = make_pool(cfg, 300)
    for mode in PREFILL_MODES:
        support = trt.capabilities.graph_support("prefill", mode)
        assert support.capture.is_fallback and support.capture.fallback_to == "flashinfer_mla"
        case = make_case(cfg, pool, [20], [4], seed=3)
        trt.init_forward_metadata(case.batch)  # planned before capture: eager planning
        with capturing(mode):
            method = trt.forward_method_for("prefill")
            assert method is ForwardMethod.MLA
            got = trt.forward_extend(case.q, case.latent_new, case.rope_new, pool, case.batch,
                                     method=method)
        assert_close(got, expected(cfg, case), what=f"trtllm fallback under {mode}")
    assert len(log.flashinfer.mla_runs) == 2 and log.flashinfer.trtllm_ragged == []


def test_flash_attn_cute_on_sm90_captures_the_mha_companion_under_breakable(
        reg, monkeypatch) -> None:
    """Nothing is pinned there (no absorbed path on sm90): MHA is what gets captured."""
    cfg = MLAConfig(num_heads=2, page_size=16)
    fa, log = build(reg, monkeypatch, "flash_attn_cute", "cuda:sm90", cfg)
    pool = make_pool(cfg, 400)
    first = make_case(cfg, pool, [0, 5], [6, 4], mha=True, seed=4)
    fa.init_cuda_graph_state(2, 16, max_seq_len=128, graph_modes={"prefill": "breakable"})
    fa.init_forward_metadata_capture(2, 16, first.batch)
    heads, (qk, _) = cfg.num_heads, cfg.mha_head_dims
    for case in (first, make_case(cfg, pool, [30], [9], mha=True, seed=5)):
        fa.init_forward_metadata_replay(2, 16, case.batch)
        t = case.batch.num_tokens
        q = torch.zeros(16, heads, qk, dtype=case.q.dtype)
        q[:t] = case.q
        with capturing(GraphMode.BREAKABLE):
            assert fa.forward_method_for("prefill") is None
            got = fa.forward_extend(q, None, None, None, method=ForwardMethod.MHA,
                                    k=case.k, v=case.v)
        assert_close(got[:t], expected(cfg, case, ForwardMethod.MHA), what="captured fa4 mha")
    assert [c["qv"] for c in log.fa4] == [False, False]
