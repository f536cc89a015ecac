"""attnreg backends as vLLM 0.33 MLA attention backends (``ATTNREG_<NAME>``), on CPU.

Each step runs through vLLM's real metadata builder (``MLACommonMetadataBuilder.build``:
vLLM's own decode / prefill split) and impl (``forward_mqa`` for the decode part,
``forward_mha`` for the prefill part) over vLLM's paged MLA cache, one part at a
time and through vLLM's real ``MLAAttention.forward_impl`` (which absorbs
``W_UK`` and applies ``W_UV`` itself), and is compared with attnreg's float64
oracle.  What is stood in, and why, is in
:mod:`._adapter_env`.  The reference backend and the Triton kernels (under
``TRITON_INTERPRET=1``, tiny shapes) run every case.
"""

from __future__ import annotations

import os

import pytest
import torch

from .conftest import HAS_VLLM, SKIP_REASON

if not HAS_VLLM:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from attnreg.backends.declarations.triton_sizing import decode_rounds_q
from attnreg.integrations.vllm import plugin
from attnreg.integrations.vllm.registration import (
    register_backends,
    registered,
    unregister_backends,
)
from attnreg.registry import DType, ForwardMode, Phase, UnsupportedError
from attnreg.testing.batches import BatchSpec
from attnreg.testing.workload import compare, oracle_attention, round_q

from ._adapter_env import HEADS, LATENT, NOPE, ROPE, SCALE, VDIM, Step, TinyEngine

#: step name -> (context lens, query lens), requests in vLLM's order (decodes first)
STEPS = {
    # cached prefixes ending mid-block, across blocks, and a first token
    "decode": ([6, 20, 0], [1, 1, 1]),
    # a fresh prompt and a chunked prefill over a cached prefix
    "prefill": ([0, 21], [7, 5]),
    # what vLLM runs most: decodes and a prefill chunk in one step
    "mixed": ([13, 30, 4], [1, 1, 6]),
}
#: The tiny engine runs on the CPU, where Triton runs only under its interpreter (which
#: the suite turns on only without a GPU).
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on the CPU needs TRITON_INTERPRET=1 (set by the suite without a GPU)"))]


@pytest.fixture(autouse=True)
def _fresh_vllm_registry() -> None:
    unregister_backends()


def _spec(step: Step, reqs: range, mode: ForwardMode) -> BatchSpec:
    phase = Phase.DECODE if mode is not ForwardMode.EXTEND else Phase.PREFILL
    return BatchSpec("vllm", phase, tuple((step.context[i], step.query[i]) for i in reqs),
                     "a vLLM step", mode)


def _rounds_q(engine: TinyEngine) -> bool:
    """Whether the engine's backend computes decode-phase steps with q rounded to fp8 per
    head row (declared: triton over an fp8 cache at these heads)."""
    return (engine.backend_name == "triton" and engine.fp8
            and decode_rounds_q(HEADS, "fp8_e4m3"))


def _decode_part(engine: TinyEngine, step: Step, md: object, reqs: range,
                 mode: ForwardMode) -> None:
    """forward_mqa of the decode requests (absorbed q) against the float64 oracle."""
    tokens = sum(step.query[i] for i in reqs)
    q_nope, q_pe = engine.randn(tokens, HEADS, LATENT), engine.randn(tokens, HEADS, ROPE)
    out, lse = engine.impl.forward_mqa((q_nope, q_pe), engine.kv_cache, md, engine.layer)
    q = torch.cat([q_nope, q_pe], dim=-1)
    if _rounds_q(engine):
        q = round_q(q, "fp8_e4m3", "row")
    expected, expected_lse, start = [], [], 0
    for i in reqs:
        kv = step.rows[i][:, None, :]
        o, row_lse = oracle_attention(q[start:start + step.query[i]], kv, kv[:, :, :LATENT],
                                      SCALE)
        expected.append(o)
        expected_lse.append(row_lse)
        start += step.query[i]
    spec = _spec(step, reqs, mode)
    assert out.shape == (tokens, HEADS, LATENT) and out.dtype == torch.bfloat16
    assert compare(out, torch.cat(expected), DType.BF16, spec) is None
    assert lse is not None  # both backends declare the log-sum-exp
    assert torch.allclose(lse.float(), torch.cat(expected_lse), atol=2e-3, rtol=2e-4)


def _prefill_part(engine: TinyEngine, step: Step, md: object, reqs: range) -> None:
    """forward_mha of the prefill requests against float64 MHA over the layer's
    kv_b_proj-decompressed rows (prefix from the cache, new tokens as given)."""
    tokens = sum(step.query[i] for i in reqs)
    first = sum(step.query[:reqs.start])
    q = engine.randn(tokens, HEADS, NOPE + ROPE)
    # the layer hands forward_mha the new tokens' rows as the model computed them
    new_rows = torch.cat([step.written[i][step.context[i]:] for i in reqs])
    kv_c, k_pe = new_rows[:, :LATENT], new_rows[:, None, LATENT:]
    output = torch.full((tokens, HEADS * VDIM), float("nan"), dtype=torch.bfloat16)
    engine.impl.forward_mha(q, kv_c, k_pe, engine.kv_cache, md, engine.layer._k_scale, output)
    expected, start = [], 0
    for i in reqs:
        # the cached prefix as the cache holds it, the new tokens as computed
        c = step.context[i]
        rows = torch.cat([step.rows[i][:c].to(torch.bfloat16), step.written[i][c:]])
        k, v = engine.impl._decompress(rows[:, :LATENT], rows[:, LATENT:])
        n = step.query[i]
        o, _ = oracle_attention(q[start:start + n], k, v, SCALE)
        expected.append(o)
        start += n
    assert first == step.num_tokens - tokens
    spec = _spec(step, reqs, ForwardMode.EXTEND)
    assert compare(output.view(tokens, HEADS, VDIM), torch.cat(expected), DType.BF16,
                   spec) is None


#: vLLM cache_dtype -> the layer's k_scale
KV = {"auto": 1.0, "fp8": 0.5}


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kv", list(KV))
@pytest.mark.parametrize("case", list(STEPS))
def test_a_vllm_step_through_vllms_builder_and_impl(name: str, kv: str, case: str) -> None:
    engine = TinyEngine(name, kv=kv, k_scale=KV[kv])
    step = engine.step(*STEPS[case])
    md = engine.build(step)
    decodes = sum(1 for n in step.query if n == 1)
    # vLLM's own split, which the adapter's batches follow
    assert (md.num_decodes, md.num_prefills) == (decodes, len(step.query) - decodes)
    if decodes:
        assert md.attnreg_decode.batch.forward_mode is ForwardMode.DECODE
        _decode_part(engine, step, md, range(decodes), ForwardMode.DECODE)
    else:
        assert md.attnreg_decode is None
    if md.num_prefills:
        assert md.attnreg_prefill.batch.prefix_lens_cpu == tuple(step.context[decodes:])
        _prefill_part(engine, step, md, range(decodes, len(step.query)))
    else:
        assert md.attnreg_prefill is None


def _mha_oracle(engine: TinyEngine, step: Step, q: torch.Tensor, decodes: int
                ) -> torch.Tensor:
    """float64 MHA of every request over its kv_b_proj-decompressed rows: decode requests
    read all their rows from the cache, prefill requests the new ones as computed."""
    expected, start = [], 0
    for i, (c, n) in enumerate(zip(step.context, step.query)):
        cached = step.rows[i] if i < decodes else step.rows[i][:c]
        rows = torch.cat([cached.to(torch.bfloat16), step.written[i][cached.shape[0]:]])
        k, v = engine.impl._decompress(rows[:, :LATENT], rows[:, LATENT:])
        o, _ = oracle_attention(q[start:start + n], k, v, SCALE)
        expected.append(o)
        start += n
    return torch.cat(expected)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("kv", list(KV))
def test_vllms_mla_layer_runs_a_mixed_step_through_the_adapter(name: str, kv: str) -> None:
    # MLAAttention.forward_impl: vLLM's split, its W_UK absorption before forward_mqa,
    # its W_UV after it, forward_mha for the prefill; the cache as vLLM keeps it (uint8
    # storage for fp8, which the layer views as float8_e4m3fn)
    engine = TinyEngine(name, kv=kv, k_scale=KV[kv])
    step = engine.step([13, 30, 4], [1, 1, 6])
    md = engine.build(step)
    tokens = step.num_tokens
    q = engine.randn(tokens, HEADS, NOPE + ROPE)
    new = torch.cat([w[c:] for w, c in zip(step.written, step.context)])
    cache = engine.kv_cache.view(torch.uint8) if engine.fp8 else engine.kv_cache
    output = torch.full((tokens, HEADS * VDIM), float("nan"), dtype=torch.bfloat16)
    engine.layer.forward_impl(q, new[:, :LATENT], new[:, None, LATENT:], cache, md,
                              output=output)
    spec = BatchSpec("vllm", Phase.PREFILL, tuple(zip(step.context, step.query)),
                     "a mixed vLLM step", ForwardMode.EXTEND)
    # the decode requests' absorbed q is rounded inside the layer where declared, which an
    # MHA oracle cannot follow: fp8 tolerances there
    tolerance = DType.FP8_E4M3 if _rounds_q(engine) else DType.BF16
    assert compare(output.view(tokens, HEADS, VDIM), _mha_oracle(engine, step, q, 2),
                   tolerance, spec) is None


@pytest.mark.parametrize("name", BACKENDS)
def test_speculative_verify_runs_as_attnregs_target_verify(name: str) -> None:
    engine = TinyEngine(name, draft=2)
    # 1 + 2 draft tokens per request: vLLM's decode part under UNIFORM query lengths
    step = engine.step([5, 18], [3, 3])
    md = engine.build(step)
    assert engine.builder.reorder_batch_threshold == 3
    assert (md.num_decodes, md.num_decode_tokens) == (2, 6)
    assert md.attnreg_decode.batch.forward_mode is ForwardMode.TARGET_VERIFY
    _decode_part(engine, step, md, range(2), ForwardMode.TARGET_VERIFY)


def test_the_cache_is_viewed_without_a_copy() -> None:
    engine = TinyEngine("reference")
    step = engine.step([3], [1])
    md = engine.build(step)
    engine.impl.forward_mqa(engine.randn(1, HEADS, LATENT + ROPE), engine.kv_cache, md,
                            engine.layer)
    pool = engine.impl._pool
    assert pool is not None and pool.buffer.data_ptr() == engine.kv_cache.data_ptr()
    assert pool.buffer.shape == engine.kv_cache.shape


def test_a_block_size_outside_the_declaration_is_refused_when_vllm_builds_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from . import _adapter_env

    monkeypatch.setattr(_adapter_env, "BLOCK", 8)  # reference declares 1, 16, 32, 64
    with pytest.raises(UnsupportedError, match="page size 8"):
        TinyEngine("reference")


def test_fp8_cache_is_viewed_with_the_layers_scale() -> None:
    engine = TinyEngine("reference", kv="fp8", k_scale=0.5)
    step = engine.step([3], [1])
    md = engine.build(step)
    engine.impl.forward_mqa(engine.randn(1, HEADS, LATENT + ROPE), engine.kv_cache, md,
                            engine.layer)
    pool = engine.impl._pool
    assert pool is not None and pool.kv_dtype is DType.FP8_E4M3 and pool.scale == 0.5
    assert pool.buffer.data_ptr() == engine.kv_cache.data_ptr()


@pytest.mark.parametrize("name", BACKENDS)
def test_a_long_prefix_is_decompressed_in_chunks_of_vllms_workspace(name: str) -> None:
    # vLLM bounds the decompressed context by its chunked-prefill workspace; attnreg's
    # chunked-prefix MHA reads the prefix in chunks of that many rows
    engine = TinyEngine(name)
    engine.builder.chunked_prefill_workspace_size = 16
    step = engine.step([40, 7], [5, 3])
    md = engine.build(step)
    assert md.attnreg_prefill.chunk_tokens == 16
    assert len(md.attnreg_prefill.batch.prefix_chunks(16, 16)) == 3
    _prefill_part(engine, step, md, range(2))


def test_prefill_without_an_attnreg_kernel_runs_vllms_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # a backend with no chunked-prefix MHA kernel for the model: the builder plans no
    # attnreg prefill, and forward_mha is vLLM's own (here its CPU SDPA prefill backend)
    engine = TinyEngine("reference")
    engine.builder.attnreg_prefill = None
    step = engine.step([0], [5])  # no cached context: vLLM's path needs no CUDA op
    md = engine.build(step)
    assert md.attnreg_prefill is None and md.prefill.prefill_backend is not None
    _prefill_part(engine, step, md, range(1))


def _vllm_layer_views(layout_name: str, num_blocks: int = 4) -> list[torch.Tensor]:
    """Two layers' caches as vLLM's allocator views one backing buffer in ``layout``
    (``create_kv_cache_views``), bound as ``MLAAttention.bind_kv_cache`` binds them."""
    from vllm.v1.kv_cache_interface import KVCacheTensor, MLAAttentionSpec, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=LATENT + ROPE,
                            dtype=torch.bfloat16)
    page = spec.page_size_bytes
    if layout.is_layer_compact:
        strides = {"layer_stride": page * num_blocks, "block_stride": page}
    else:
        strides = {"layer_stride": page, "block_stride": 2 * page}
    placement = KVCacheTensor(size=2 * page * num_blocks, layers=["l0", "l1"], **strides)
    raw = torch.zeros(placement.size, dtype=torch.int8)
    views = create_kv_cache_views(raw, spec, num_blocks, layout, placement)
    return [v.squeeze(1) for v in views]  # MLAAttention.bind_kv_cache


def test_the_layouts_the_backend_asks_vllm_for_are_viewed_without_a_copy() -> None:
    engine = TinyEngine("reference")
    layouts = engine.backend_cls.supported_kv_cache_layouts()
    assert layouts and all(layout.is_layer_compact for layout in layouts)
    for layout in layouts:
        for view in _vllm_layer_views(layout.name):
            engine.impl._pool = None
            pool = engine.impl._pool_for(view, engine.layer._k_scale)
            assert pool.buffer.data_ptr() == view.data_ptr()
            assert pool.buffer.shape == view.shape == (4, 16, LATENT + ROPE)


def test_a_block_outermost_layout_is_refused() -> None:
    # what VLLM_KV_CACHE_LAYOUT=BLNHC would force: layers' pages interleaved per block
    engine = TinyEngine("reference")
    view = _vllm_layer_views("BLNHC")[1]
    with pytest.raises(UnsupportedError, match="without a copy"):
        engine.impl._pool_for(view, engine.layer._k_scale)


def test_a_padded_cache_layout_is_refused() -> None:
    engine = TinyEngine("reference")
    step = engine.step([3], [1])
    md = engine.build(step)
    padded = torch.zeros(16, 16, 640, dtype=torch.bfloat16)[..., :576]
    with pytest.raises(UnsupportedError, match="without a copy"):
        engine.impl.forward_mqa(engine.randn(1, HEADS, LATENT + ROPE), padded, md,
                                engine.layer)


def _reasons(cls: type, **changes: object) -> list[str]:
    from vllm.platforms.interface import DeviceCapability

    args: dict[str, object] = dict(
        head_size=LATENT + ROPE, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=16,
        use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
        attn_type="decoder")
    args.update(changes)
    return cls.validate_configuration(**args)


def test_vllms_selector_checks_read_the_declaration() -> None:
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    register_backends(["reference", "triton"])
    reference = AttentionBackendEnum["ATTNREG_REFERENCE"].get_class()
    triton = AttentionBackendEnum["ATTNREG_TRITON"].get_class()
    assert _reasons(reference) == []
    # reference declares pages of 1, 16, 32, 64 and no fp8_e5m2 cache
    assert _reasons(reference, block_size=8) == ["block_size not supported"]
    assert _reasons(reference, kv_cache_dtype="fp8_e5m2") == ["kv_cache_dtype not supported"]
    assert "sparse not supported" in _reasons(reference, use_sparse=True)
    # triton declares cuda sm80+
    assert _reasons(triton, device_capability=DeviceCapability(7, 5)) == [
        "compute capability not supported"]


def test_bridge_off_registers_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.delenv("ATTNREG_VLLM", raising=False)
    plugin.register()
    assert registered() == []
    with pytest.raises(ValueError, match="Unknown attention backend"):
        AttentionBackendEnum["ATTNREG_REFERENCE"]


def test_bridge_on_registers_every_attnreg_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from attnreg.integrations.vllm import hooks
    from attnreg.registry import get_registry

    monkeypatch.setenv("ATTNREG_VLLM", "1")
    try:
        plugin.register()
        names = registered()
        assert names == sorted("ATTNREG_" + n.upper() for n in get_registry().names())
        cls = AttentionBackendEnum["ATTNREG_TRITON"].get_class()
        assert cls.get_name() == "ATTNREG_TRITON" and cls.is_mla()
        assert cls.get_builder_cls().vllm_backend_name == "ATTNREG_TRITON"
    finally:
        hooks.uninstall()
