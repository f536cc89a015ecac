"""One formula per backend: what the runtime allocates for graphs is what its declaration's
CaptureMemory.estimate says, at the shape init_cuda_graph_state builds (cpu: the bytes of
the typed graph buffers; the GPU measurement is the conformance claim ``capture_memory``)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from attnreg.backends.declarations import flash_attn_cute as fa_decl
from attnreg.backends.declarations import flashinfer_mla as fi_decl
from attnreg.backends.declarations import triton_sizing
from attnreg.backends.declarations import trtllm_mla as trt_decl
from attnreg.registry import CaptureShape, DType, GraphMode, Phase, load_registry
from attnreg.runtime import MLAConfig

MODES = {Phase.DECODE: GraphMode.FULL, Phase.PREFILL: GraphMode.BREAKABLE}


@pytest.fixture(scope="module")
def reg():
    return load_registry(autoload=False)


def _estimate(backend, phase: Phase, **shape_changes: int) -> int:
    state = backend.graph_state
    mem = backend.capabilities.graph_support(phase, MODES[phase]).capture_memory
    return mem.estimate(replace(state.capture_shape, **shape_changes))


@pytest.mark.parametrize("phase", [Phase.DECODE, Phase.PREFILL])
@pytest.mark.parametrize("heads, max_bs, tokens, seq_len, options", [
    (2, 4, 18, 1101, {}),
    (16, 8, 64, 8192, {}),
    (128, 3, 40, 600, {"num_sms": 132}),
    (16, 6, 30, 4096, {"force_kv_splits": 3}),
    (16, 6, 30, 4096, {"max_kv_splits": 2, "num_sms": 64}),
])
def test_triton_allocates_what_it_declares(reg, phase, heads, max_bs, tokens, seq_len,
                                           options) -> None:
    cfg = MLAConfig(num_heads=heads, page_size=16)
    tri = reg.create("triton", cfg, platform="cpu", **options)
    tri.init_cuda_graph_state(max_bs, tokens, max_seq_len=seq_len,
                              graph_modes={phase: MODES[phase]})
    shape = tri.graph_state.capture_shape
    assert shape.num_sms == tri.num_sms and shape.num_heads == heads
    allocated = tri.graph_buffer_bytes()
    if not (options.keys() & {"force_kv_splits", "max_kv_splits"}):
        assert allocated == _estimate(tri, phase)
    # with split options the runtime sizes by the same functions, given its options
    split = triton_sizing.SplitOptions(cap=options.get("max_kv_splits"),
                                       force=options.get("force_kv_splits"))
    fn = triton_sizing.decode_capture_bytes if phase is Phase.DECODE \
        else triton_sizing.extend_capture_bytes
    assert allocated == fn(shape, split)
    # buffers only for the captured mode
    other = tri.graph_state.buffers
    if phase is Phase.DECODE:
        assert other.extend_partial_out is None and other.decode_partial_out is not None
    else:
        assert other.decode_partial_out is None


def test_triton_capture_bytes_of_a_captured_shape_are_views_of_the_buffers(reg) -> None:
    tri = reg.create("triton", MLAConfig(num_heads=2, page_size=16), platform="cpu")
    tri.init_cuda_graph_state(4, 4, max_seq_len=2000, graph_modes={"decode": "full"})
    before = tri.graph_buffer_bytes()
    for bs in (4, 2, 1):
        tri.init_forward_metadata_capture(bs, bs)
    assert tri.graph_buffer_bytes() == before, "captured plans view the buffers, no copies"


def test_deepseek_v3_triton_decode_fits_a_one_gib_budget() -> None:
    """Issue 15: the old per-slot formula said 2 GiB at 128 heads and 256 slots, and a
    1 GiB budget dropped both graphs; the runtime allocates 64 MiB there."""
    shape = CaptureShape(max_batch_size=256, max_num_tokens=256, max_seq_len=8192,
                         num_heads=128, num_sms=132)
    assert triton_sizing.decode_capture_bytes(shape) == 256 * 128 * 513 * 4
    upper = triton_sizing.decode_capture_bytes(replace(shape, num_sms=0))
    assert upper < 65 * 2**20

    from attnreg.cli import main

    args = ["compat", "--platform", "cuda:sm90", "--model", "deepseek-v3", "--backend",
            "triton", "--capture-memory-budget", "1GiB", "--json"]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(args) == 0
    plan = json.loads(out.getvalue())
    modes = {phase: plan["phases"][phase]["mode"] for phase in ("prefill", "decode")}
    assert modes == {"prefill": "breakable", "decode": "full"}
    assert not [d for d in plan["decisions"] if d["rule"] == "budget.capture_memory"]


def test_flashinfer_allocates_its_declared_index_buffers(reg, monkeypatch) -> None:
    from backends_lib.fakes import install_fake_flashinfer

    install_fake_flashinfer(monkeypatch)
    from attnreg.backends.flashinfer_mla import FlashInferMLABackend

    cfg = MLAConfig(num_heads=4, page_size=16)
    fi = FlashInferMLABackend(cfg, capabilities=reg.declaration("flashinfer_mla", "cuda:sm90"))
    fi.init_cuda_graph_state(8, 64, max_seq_len=2000, graph_modes={"decode": "full"})
    shape = fi.graph_state.capture_shape
    index = 4 * sum(fi_decl.graph_index_sizes(shape))
    assert fi.graph_buffer_bytes() == index
    # the per-graph int workspace flashinfer allocates inside each use_cuda_graph wrapper
    assert _estimate(fi, Phase.DECODE, num_graphs=3) == \
        index + 3 * fi_decl.WRAPPER_INT_WORKSPACE_BYTES


def test_trtllm_decode_tables_and_fp8_fallback_are_declared(reg, monkeypatch) -> None:
    from backends_lib.fakes import install_fake_flashinfer

    install_fake_flashinfer(monkeypatch)
    from attnreg.backends.trtllm_mla import TRTLLMMLABackend

    caps = reg.declaration("trtllm_mla", "cuda:sm100")
    cfg = MLAConfig(num_heads=16, page_size=32, kv_dtype="fp8_e4m3")
    trt = TRTLLMMLABackend(cfg, capabilities=caps)
    trt.init_cuda_graph_state(4, 4, max_seq_len=3000, graph_modes={"decode": "full"})
    assert trt.graph_buffer_bytes() == _estimate(trt, Phase.DECODE)
    assert trt.graph_state.buffers.block_tables.shape[1] % (trt_decl.TABLE_ALIGN // 32) == 0
    trt.init_cuda_graph_state(2, 96, max_seq_len=3000, graph_modes={"prefill": "breakable"})
    pool_bytes = 1 << 30
    fp8 = _estimate(trt, Phase.PREFILL, kv_pool_bytes=pool_bytes, num_graphs=1)
    bf16 = trt_decl.fallback_capture_bytes(replace(trt.graph_state.capture_shape,
                                                   kv_dtype=DType.BF16,
                                                   kv_pool_bytes=pool_bytes, num_graphs=1))
    assert fp8 - bf16 == 2 * pool_bytes, "an FP8 pool is converted to 16 bits in the graph"
    index = 4 * sum(fi_decl.graph_index_sizes(trt.graph_state.capture_shape))
    assert trt.graph_buffer_bytes() == index


def test_flash_attn_cute_declares_the_output_it_allocates_in_the_graph(reg) -> None:
    shape = CaptureShape(max_batch_size=2, max_num_tokens=96, max_seq_len=4096, num_heads=16)
    sm90 = reg.declaration("flash_attn_cute", "cuda:sm90").graph_support("prefill", "breakable")
    sm100 = reg.declaration("flash_attn_cute", "cuda:sm100").graph_support("prefill",
                                                                           "breakable")
    assert sm90.capture_memory.estimate(shape) == fa_decl.mha_capture_bytes(shape) \
        == 96 * 16 * 128 * 2
    assert sm100.capture_memory.estimate(shape) == 96 * 16 * 512 * 2


@pytest.mark.parametrize("q_dtype", ["bf16", "fp8_e4m3"])
def test_the_capture_shape_carries_the_query_dtype(q_dtype) -> None:
    """A backend that rounds a 16-bit q inside its graphs (the FlashMLA plugin over an fp8
    pool) allocates nothing for the engine's own fp8 q: its formula needs q's dtype."""
    import torch

    from attnreg.runtime.graph_buffers import GraphState

    cfg = MLAConfig(num_heads=16, page_size=64, kv_dtype="fp8_e4m3", q_dtype=q_dtype)
    shape = GraphState.shape_for(cfg, torch.device("cpu"), 4, 4, 1024)
    assert shape.q_dtype is DType.parse(q_dtype) and shape.kv_dtype is DType.FP8_E4M3
    assert CaptureShape(max_batch_size=1, max_num_tokens=1, max_seq_len=1,
                        num_heads=1).q_dtype is DType.BF16  # the plugin API 1.1 form


@pytest.mark.parametrize("kv_dtype, page_size", [("fp8_e4m3", 64), ("fp8_e4m3", 1),
                                                 ("bf16", 64)])
def test_triton_decode_declares_the_workspace_of_the_config_its_pool_runs(
        reg, kv_dtype, page_size) -> None:
    """16 heads over an fp8 pool of 64-token pages run one program per SM (half the
    splits): the declared decode workspace follows the pool's dtype and page size, and is
    what the backend allocates."""
    tri = reg.create("triton", MLAConfig(num_heads=16, page_size=page_size,
                                         kv_dtype=kv_dtype), platform="cpu", num_sms=132)
    tri.init_cuda_graph_state(8, 8, max_seq_len=8192,
                              graph_modes={Phase.DECODE: MODES[Phase.DECODE]})
    shape = tri.graph_state.capture_shape
    assert (str(shape.kv_dtype.value), shape.page_size) == (kv_dtype, page_size)
    allocated = tri.graph_buffer_bytes()
    assert allocated == _estimate(tri, Phase.DECODE)
    bf16_p1 = triton_sizing.decode_capture_bytes(replace(shape, kv_dtype=DType.BF16,
                                                         page_size=1))
    if (kv_dtype, page_size) == ("fp8_e4m3", 64):
        assert allocated < bf16_p1          # fewer splits: a smaller workspace
    else:
        assert allocated == bf16_p1
