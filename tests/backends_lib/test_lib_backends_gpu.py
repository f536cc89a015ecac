"""flashinfer_mla, trtllm_mla and flash_attn_cute on a real GPU, against the reference:
eager, and under CUDA graph capture with replays of other lengths and contents.

Each test skips with the reason when its library is missing or the GPU is of
the wrong architecture (trtllm-gen kernels need Blackwell, flash-attn-4's
absorbed path too).  trtllm_mla's capture fallback to flashinfer's paged MLA
runs anywhere flashinfer does: it is tested with the sm100 declaration.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.graph_policy.capture import capturing
from attnreg.registry import (
    ForwardMethod,
    ForwardMode,
    GraphMode,
    UnsupportedError,
    get_registry,
)
from attnreg.runtime import GraphSession, MLAConfig, StepInputs
from attnreg.testing.capture_harness import CaptureMemoryCheck

from ._cases import Case, assert_close, expected, make_case, make_pool

pytestmark = pytest.mark.gpu


def _sm() -> int | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def _importable(module: str) -> str:
    """'' when ``module`` imports, else why not."""
    try:
        __import__(module)
    except (ImportError, OSError, RuntimeError) as exc:  # missing, or a broken CUDA setup
        return f"{type(exc).__name__}: {exc}"
    return ""


def need_flashinfer() -> None:
    why = _importable("flashinfer")
    if why:
        pytest.skip(f"flashinfer-python is not installed here ({why}); install attnreg[flashinfer]")


def need_flash_attn_cute() -> None:
    why = _importable("flash_attn.cute")
    if why:
        pytest.skip(f"flash-attn-4 is not installed here ({why}); "
                    "install attnreg[flash-attn-cute]")


def need_blackwell(what: str) -> None:
    if _sm() not in (100, 103):
        pytest.skip(f"{what} needs sm100/sm103 (Blackwell); this is sm{_sm()}")


@pytest.fixture(scope="module", autouse=True)
def _prebuild_flashinfer_kernels() -> None:
    """Compile the flashinfer JIT variants used below at the same time (``warm_jit_cache``).

    Only a speed-up: each test would otherwise compile its variant on first use
    (20-130 s each, one after another).  Any failure is left to the tests.
    """
    if _importable("flashinfer") or _sm() is None:
        return
    from attnreg.backends.flashinfer_mla import warm_jit_cache

    warm_jit_cache(_sm())


def config(**kw: object) -> MLAConfig:
    kw.setdefault("num_heads", 16)
    return MLAConfig(device="cuda", max_context_len=4096, **kw)  # type: ignore[arg-type]


def flashinfer_backend(cfg: MLAConfig, **options: object):
    need_flashinfer()
    return get_registry().create("flashinfer_mla", cfg, **options)


def trtllm_backend(cfg: MLAConfig):
    """Built with the sm100 declaration, whatever the GPU (its fallback runs anywhere)."""
    need_flashinfer()
    from attnreg.backends.trtllm_mla import TRTLLMMLABackend

    return TRTLLMMLABackend(cfg, capabilities=get_registry().declaration("trtllm_mla",
                                                                         "cuda:sm100"))


def flash_attn_cute_backend(cfg: MLAConfig):
    need_flash_attn_cute()
    return get_registry().create("flash_attn_cute", cfg)


def run(backend, case: Case, method: ForwardMethod = ForwardMethod.MLA) -> torch.Tensor:
    if case.batch.is_decode:
        return backend.forward_decode(case.q, case.latent_new, case.rope_new, case.pool,
                                      case.batch)
    return backend.forward_extend(case.q, case.latent_new, case.rope_new, case.pool,
                                  case.batch, method=method, k=case.k, v=case.v)


# ----------------------------------------------------------------------------------------
# graphs: capture once, replay other batches
# ----------------------------------------------------------------------------------------
def graph_replays(backend, cfg: MLAConfig, cases: list[Case], *, mode: GraphMode, bs: int,
                  num_tokens: int, method: ForwardMethod = ForwardMethod.MLA,
                  max_kv_tokens: int = 0) -> None:
    """Capture with ``cases[0]``; replay every case (the first too) and compare each."""
    decode = cases[0].batch.is_decode
    bucket = bs if decode else num_tokens
    # two side-stream warm-ups: kernels compile and libraries set up state outside the graph
    session = GraphSession(backend, cases[0].pool, phase="decode" if decode else "prefill",
                           mode=mode, buckets=[bucket], max_requests=bs,
                           max_seq_len=cfg.max_context_len, method=method,
                           max_kv_rows=max_kv_tokens or None, warmup=2)

    def inputs(case: Case) -> StepInputs:
        return StepInputs.one(case.q, case.latent_new, case.rope_new, k=case.k, v=case.v)

    session.capture(batches={bucket: cases[0].batch}, inputs={bucket: inputs(cases[0])})
    assert session.statics is not None
    out = session.statics.outs[0]
    for case in cases:
        out.fill_(float("nan"))
        session.replay(case.batch, inputs(case), bucket=bucket)
        torch.cuda.synchronize()
        rows = case.q.shape[0]
        got = out[:rows].clone()
        assert_close(got, expected(cfg, case, method),
                     what=f"replay of seq_lens {case.batch.seq_lens_cpu}")
        assert torch.count_nonzero(out[rows:].float().nan_to_num(1.0)) == 0, \
            f"replay of seq_lens {case.batch.seq_lens_cpu}: padding rows must be zero"


# ----------------------------------------------------------------------------------------
# flashinfer_mla
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [1, 2, 4, 8, 16, 32, 64])
def test_flashinfer_decode_and_extend_eager(page_size: int) -> None:
    cfg = config(page_size=page_size)
    fi = flashinfer_backend(cfg)
    pool = make_pool(cfg, 8000)
    dec = make_case(cfg, pool, [0, 45, 700, 2047], [1, 1, 1, 1], decode=True, seed=1)
    assert_close(run(fi, dec), expected(cfg, dec), what="decode")
    ext = make_case(cfg, pool, [0, 100, 513], [77, 1, 130], seed=2)
    assert_close(run(fi, ext), expected(cfg, ext), what="extend")


@pytest.mark.parametrize("dtype,mla_backend", [("fp16", "auto"), ("bf16", "fa2")])
def test_flashinfer_other_dtype_and_kernel(dtype: str, mla_backend: str) -> None:
    cfg = config(page_size=16, q_dtype=dtype, kv_dtype=dtype)
    fi = flashinfer_backend(cfg, mla_backend=mla_backend)
    pool = make_pool(cfg, 4000)
    dec = make_case(cfg, pool, [3, 900], [1, 1], decode=True, seed=3)
    assert_close(run(fi, dec), expected(cfg, dec), what=f"{dtype} {mla_backend} decode")
    ext = make_case(cfg, pool, [0, 300], [64, 17], seed=4)
    assert_close(run(fi, ext), expected(cfg, ext), what=f"{dtype} {mla_backend} extend")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_flashinfer_mha_ragged_prefill_with_prefix(dtype: str) -> None:
    cfg = config(page_size=16, q_dtype=dtype, kv_dtype=dtype)
    fi = flashinfer_backend(cfg)
    pool = make_pool(cfg, 3000)
    case = make_case(cfg, pool, [0, 250, 31], [120, 9, 64], mha=True, seed=5)
    assert_close(run(fi, case, ForwardMethod.MHA), expected(cfg, case, ForwardMethod.MHA),
                 what="ragged mha")


def test_flashinfer_fp8_pool_follows_the_declaration() -> None:
    cfg = config(page_size=16, kv_dtype="fp8_e4m3")
    fi = flashinfer_backend(cfg)
    pool = make_pool(cfg, 2000)
    case = make_case(cfg, pool, [10, 600], [1, 1], decode=True, seed=6)
    declared = fi.capabilities.check_request("mla", "decode", q_dtype="bf16",
                                             kv_dtype="fp8_e4m3") == []
    if not declared:
        with pytest.raises(UnsupportedError, match="fp8"):
            run(fi, case)
        return
    assert_close(run(fi, case), expected(cfg, case), atol=4e-2, what="fp8 decode")


@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page_size", [1, 64])
def test_flashinfer_decode_graph_replays(heads: int, page_size: int) -> None:
    cfg = config(num_heads=heads, page_size=page_size)
    fi = flashinfer_backend(cfg)
    pool = make_pool(cfg, 30000)
    cases = [make_case(cfg, pool, [100, 200, 300, 400, 500, 600, 700, 800], [1] * 8,
                       decode=True, seed=10),
             make_case(cfg, pool, [3000], [1], decode=True, seed=11),
             make_case(cfg, pool, [7, 1500, 64], [1, 1, 1], decode=True, seed=12),
             make_case(cfg, pool, [1, 2, 3, 4, 5, 6, 7, 4000], [1] * 8, decode=True, seed=13)]
    graph_replays(fi, cfg, cases, mode=GraphMode.FULL, bs=8, num_tokens=8)


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_extend_graph_replays(page_size: int) -> None:
    cfg = config(page_size=page_size)
    fi = flashinfer_backend(cfg)
    pool = make_pool(cfg, 20000)
    cases = [make_case(cfg, pool, [0, 0, 0], [40, 40, 48], seed=20),
             make_case(cfg, pool, [100, 7], [30, 2], seed=21),
             make_case(cfg, pool, [1000], [1], seed=22),
             make_case(cfg, pool, [0, 60, 2000], [64, 32, 32], seed=23)]
    graph_replays(fi, cfg, cases, mode=GraphMode.BREAKABLE, bs=3, num_tokens=128)


# ----------------------------------------------------------------------------------------
# trtllm_mla
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [32, 64])
def test_trtllm_extend_fallback_under_breakable_capture(kv_dtype: str, page_size: int) -> None:
    cfg = config(page_size=page_size, kv_dtype=kv_dtype)
    trt = trtllm_backend(cfg)
    pool = make_pool(cfg, 20000)
    cases = [make_case(cfg, pool, [0, 0], [50, 46], seed=30),
             make_case(cfg, pool, [333, 5], [20, 60], seed=31),
             make_case(cfg, pool, [1500], [3], seed=32)]
    graph_replays(trt, cfg, cases, mode=GraphMode.BREAKABLE, bs=2, num_tokens=96)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_trtllm_fallback_capture_memory_is_what_it_declares(kv_dtype: str) -> None:
    """The FP8 fallback converts the whole pool inside the graph: the declaration counts
    it from CaptureShape.kv_pool_bytes, and the graph's pool holds it.  The pool is large
    (~150k tokens) so the conversion dominates what is measured."""
    from dataclasses import replace

    cfg = config(page_size=32, kv_dtype=kv_dtype)
    trt = trtllm_backend(cfg)
    pool = make_pool(cfg, 150_000)
    case = make_case(cfg, pool, [300, 0], [40, 56], seed=38)
    session = GraphSession(trt, pool, phase="prefill", mode="breakable", buckets=[96],
                           max_requests=2, max_seq_len=cfg.max_context_len, writes_kv=False)
    session.load((ForwardMode.EXTEND, 96), StepInputs.one(case.q))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    session.capture(batches={96: case.batch})
    torch.cuda.synchronize()
    state = trt.graph_state
    assert state is not None
    measured = torch.cuda.max_memory_allocated() - start - state.base_bytes
    shape = replace(state.capture_shape, kv_pool_bytes=pool.buffer.nbytes, num_graphs=1)
    declared = trt.capabilities.graph_support("prefill", "breakable").capture_memory.estimate(
        shape)
    if kv_dtype == "fp8_e4m3":
        assert declared > 2 * pool.buffer.nbytes
    check = CaptureMemoryCheck(measured=measured, declared=declared, how="peak allocated")
    assert check.problem() is None, check.problem()


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_trtllm_extend_fallback_eager_and_piecewise(kv_dtype: str) -> None:
    cfg = config(page_size=32, kv_dtype=kv_dtype)
    trt = trtllm_backend(cfg)
    pool = make_pool(cfg, 6000)
    eager = make_case(cfg, pool, [0, 90], [70, 12], seed=33)
    assert_close(run(trt, eager), expected(cfg, eager), what="eager absorbed extend")
    piecewise = make_case(cfg, pool, [400], [25], seed=34)
    trt.init_forward_metadata(piecewise.batch)
    with capturing(GraphMode.TC_PIECEWISE):
        got = run(trt, piecewise)
    assert_close(got, expected(cfg, piecewise), what="extend between piecewise pieces")


def test_trtllm_mha_prefix_batch_runs_flashinfer_ragged() -> None:
    cfg = config(page_size=32)
    trt = trtllm_backend(cfg)
    pool = make_pool(cfg, 3000)
    case = make_case(cfg, pool, [40, 0], [16, 33], mha=True, seed=35)
    assert_close(run(trt, case, ForwardMethod.MHA), expected(cfg, case, ForwardMethod.MHA),
                 what="prefix mha via flashinfer ragged")


def test_trtllm_native_kernels_refused_off_blackwell() -> None:
    if _sm() in (100, 103):
        pytest.skip("this GPU is Blackwell: the native kernels run (see the tests below)")
    cfg = config(page_size=32)
    trt = trtllm_backend(cfg)
    pool = make_pool(cfg, 2000)
    dec = make_case(cfg, pool, [10], [1], decode=True, seed=36)
    with pytest.raises(UnsupportedError, match="Blackwell"):
        run(trt, dec)
    mha = make_case(cfg, pool, [0], [12], mha=True, seed=37)
    with pytest.raises(UnsupportedError, match="Blackwell"):
        run(trt, mha, ForwardMethod.MHA)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [32, 64])
def test_trtllm_native_decode(kv_dtype: str, page_size: int) -> None:
    need_blackwell("trtllm-gen MLA")
    cfg = config(page_size=page_size, kv_dtype=kv_dtype)
    trt = trtllm_backend(cfg)
    pool = make_pool(cfg, 30000)
    eager = make_case(cfg, pool, [0, 77, 1900], [1, 1, 1], decode=True, seed=40)
    cases = [make_case(cfg, pool, [100, 200, 300, 400], [1] * 4, decode=True, seed=41),
             make_case(cfg, pool, [2500], [1], decode=True, seed=42)]
    if kv_dtype == "fp8_e4m3":
        # the kernel reads an fp8 query for an fp8 cache: give it queries that are exact
        # in fp8, so its answer and the reference's are the same attention
        for c in (eager, *cases):
            c.q.copy_(c.q.to(torch.float8_e4m3fn).to(c.q.dtype))
    assert_close(run(trt, eager), expected(cfg, eager), what="eager decode")
    graph_replays(trt, cfg, cases, mode=GraphMode.FULL, bs=4, num_tokens=4)


def test_trtllm_native_ragged_prefill() -> None:
    need_blackwell("trtllm-gen ragged prefill")
    cfg = config(page_size=32)
    trt = trtllm_backend(cfg)
    pool = make_pool(cfg, 3000)
    case = make_case(cfg, pool, [0, 0], [100, 7], mha=True, seed=43)
    assert_close(run(trt, case, ForwardMethod.MHA), expected(cfg, case, ForwardMethod.MHA),
                 what="trtllm ragged")


# ----------------------------------------------------------------------------------------
# flash_attn_cute
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,nope", [("bf16", 128), ("fp16", 128), ("bf16", 64)],
                         ids=["bf16-192_128", "fp16-192_128", "bf16-128_128"])
def test_flash_attn_cute_mha_eager(dtype: str, nope: int) -> None:
    cfg = config(page_size=16, q_dtype=dtype, kv_dtype=dtype, qk_nope_head_dim=nope)
    fa = flash_attn_cute_backend(cfg)
    pool = make_pool(cfg, 3000)
    case = make_case(cfg, pool, [0, 300, 17], [128, 5, 60], mha=True, seed=50)
    assert_close(run(fa, case, ForwardMethod.MHA), expected(cfg, case, ForwardMethod.MHA),
                 what="fa4 mha")


def test_flash_attn_cute_mha_breakable_graph_replays() -> None:
    cfg = config(page_size=16)
    fa = flash_attn_cute_backend(cfg)
    if fa.capabilities.graph_support("prefill", "breakable").pinned_method is not None:
        pytest.skip("this platform pins MLA under breakable capture: MHA is not captured")
    pool = make_pool(cfg, 8000)
    cases = [make_case(cfg, pool, [0, 0], [60, 36], mha=True, seed=51),
             make_case(cfg, pool, [500, 9], [20, 70], mha=True, seed=52),
             make_case(cfg, pool, [1200], [2], mha=True, seed=53)]
    graph_replays(fa, cfg, cases, mode=GraphMode.BREAKABLE, bs=2, num_tokens=96,
                  method=ForwardMethod.MHA, max_kv_tokens=2048)


def test_flash_attn_cute_absorbed_refused_before_fa4_off_blackwell() -> None:
    if (_sm() or 0) >= 100:
        pytest.skip("this GPU is Blackwell: the absorbed path runs (see the test below)")
    cfg = config(page_size=16)
    fa = flash_attn_cute_backend(cfg)
    pool = make_pool(cfg, 1000)
    case = make_case(cfg, pool, [20], [8], seed=54)
    with pytest.raises(UnsupportedError, match="Blackwell"):
        run(fa, case)


@pytest.mark.parametrize("page_size", [1, 16, 32, 64, 128])
def test_flash_attn_cute_absorbed_qv_extend(page_size: int) -> None:
    need_blackwell("flash-attn-4's absorbed qv path")
    cfg = config(page_size=page_size)
    fa = flash_attn_cute_backend(cfg)
    pool = make_pool(cfg, 20000)
    eager = make_case(cfg, pool, [0, 700], [90, 3], seed=55)
    assert_close(run(fa, eager), expected(cfg, eager), what="fa4 qv eager")
    cases = [make_case(cfg, pool, [0, 0], [40, 56], seed=56),
             make_case(cfg, pool, [3000, 12], [1, 90], seed=57)]
    graph_replays(fa, cfg, cases, mode=GraphMode.BREAKABLE, bs=2, num_tokens=96)
