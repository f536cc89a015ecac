"""The declaration says exactly what was measured on the H200, on every platform, and is pure."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from attnreg.registry import (
    CaptureShape,
    DeclarationContext,
    DType,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    Phase,
    Platform,
    SplitKV,
    validate_capabilities,
)
from attnreg.testing.claims import Check, ClaimKind, expand_claims

from attnreg_flashmla.declaration import (
    BACKEND_NAME,
    FP8_HEAD_COUNTS,
    HEAD_COUNTS,
    MAX_VERIFY_TOKENS,
    PAGE_SIZE,
    VERIFY_TOKENS_RUN,
    capabilities,
    capture_bytes,
    decode_call_bytes,
    fp8_query_bytes,
    num_sm_parts,
    scheduler_bytes,
)

PLATFORMS = ["cpu", "cuda", "cuda:sm80", "cuda:sm90", "cuda:sm100", "cuda:sm103",
             "rocm:gfx942", "npu", "xpu"]


def _caps(platform: str):
    return capabilities(DeclarationContext(Platform.parse(platform)))


def test_plugin_registers_through_its_entry_point(registry):
    spec = registry.get(BACKEND_NAME)
    assert (spec.plugin, spec.distribution) == ("flashmla", "attnreg-flashmla")
    assert spec.runtime == "attnreg_flashmla.runtime:FlashMLABackend"
    assert [r.distribution for r in spec.requires] == ["torch", "sgl-flash-mla"]
    assert not [e for e in registry.errors if e.plugin == "flashmla"]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_declaration_is_valid_on_every_platform(platform):
    assert validate_capabilities(_caps(platform), BACKEND_NAME) == []


@pytest.mark.parametrize("platform,needle", [
    ("cpu", "FlashMLA is a CUDA library"),
    ("rocm:gfx942", "FlashMLA is a CUDA library"),
    ("cuda", "names no architecture"),
    ("cuda:sm80", "needs sm90"),
    # sm100: the library's current kernels exist there, but they are sparse only
    ("cuda:sm100", "exists only in its legacy sm90 kernels"),
    ("cuda:sm103", "exists only in its legacy sm90 kernels"),
])
def test_nothing_is_declared_off_sm90_and_the_reason_says_why(platform, needle):
    caps = _caps(platform)
    assert caps.kernels == ()
    assert needle in caps.platform_reason


def test_sm90_declares_the_measured_decode_kernels_only():
    caps = _caps("cuda:sm90")
    assert caps.platform_reason == ""
    bf16, fp8, fp8_q = caps.kernels
    for kernel in (bf16, fp8, fp8_q):
        assert kernel.method is ForwardMethod.MLA
        assert kernel.phases == frozenset({Phase.DECODE})
        assert kernel.head_dims == ((576, 512),)
        assert kernel.page_sizes == (PAGE_SIZE,) == (64,)
        assert kernel.split_kv is SplitKV.HOST_PLANNED
    # the model's q is bf16; fp16 ran once without an accuracy check
    assert bf16.q_dtypes == fp8.q_dtypes == frozenset({DType.BF16})
    assert bf16.kv_dtypes == frozenset({DType.BF16}) and bf16.q_compute_dtype is None
    assert bf16.head_counts == HEAD_COUNTS == (1, 2, 4, 8, 16, 32, 64, 128)
    # the bf16 kernel's LSE matched the oracle on the H200; the fp8 kernel's was never checked
    assert bf16.lse and not fp8.lse
    # fp8: attnreg's own single-scale pool, q rounded to fp8 on the device
    assert fp8.kv_dtypes == frozenset({DType.FP8_E4M3})
    assert fp8.q_compute_dtype is DType.FP8_E4M3
    assert fp8.head_counts == FP8_HEAD_COUNTS == (16, 32, 64, 128)
    # the kernel's own input: an engine's fp8 q with its scale, taken as given
    assert fp8_q.q_dtypes == fp8_q.kv_dtypes == frozenset({DType.FP8_E4M3})
    assert fp8_q.q_compute_dtype is None and not fp8_q.lse
    assert (fp8_q.kernel, fp8_q.head_counts) == (fp8.kernel, fp8.head_counts)
    assert caps.methods(Phase.PREFILL) == ()


def test_decode_and_target_verify_are_served_eagerly_and_in_the_decode_graphs():
    caps = _caps("cuda:sm90")
    full = caps.graph_support(Phase.DECODE, GraphMode.FULL)
    for served in (caps.eager_forward_modes, full.forward_modes):
        assert [(f.mode, f.max_query_len, f.uniform) for f in served] == [
            (ForwardMode.DECODE, 1, True), (ForwardMode.TARGET_VERIFY, 8, True)]
    # s_q 1, 2, 3, 4 and 8 ran on the H200 (causal); the bound is the largest run
    assert MAX_VERIFY_TOKENS == max(VERIFY_TOKENS_RUN) == 8
    # ragged accepted lengths: one call takes one s_q, so no draft extend; no prefill
    assert caps.eager_serving(ForwardMode.DRAFT_EXTEND) is None
    assert full.serving(ForwardMode.DRAFT_EXTEND) is None
    assert caps.eager_serving(ForwardMode.EXTEND) is None


def test_decode_capture_replans_split_kv_before_every_replay_and_prefill_is_refused():
    caps = _caps("cuda:sm90")
    full = caps.graph_support(Phase.DECODE, GraphMode.FULL)
    assert full.capture.is_native
    assert full.pinned_method is ForwardMethod.MLA
    assert full.split_kv is SplitKV.HOST_PLANNED
    assert "sglang #26019" in full.capture.reason
    for mode in (GraphMode.BREAKABLE, GraphMode.TC_PIECEWISE):
        prefill = caps.graph_support(Phase.PREFILL, mode)
        assert prefill.capture.is_unsupported
        assert "decode only" in prefill.capture.reason


@pytest.mark.parametrize("request_,needle", [
    ({"page_size": 1}, "page size 1 not in [64]"),
    ({"page_size": 128}, "page size 128 not in [64]"),
    ({"num_heads": 3}, "3 heads not in [1, 2, 4, 8, 16, 32, 64, 128]"),
    ({"num_heads": 256}, "256 heads not in"),
    ({"q_dtype": "fp16"}, "q dtype fp16 not in ['bf16']"),
    ({"kv_dtype": "fp16"}, "kv dtype fp16 not in"),
    # 8 heads ran over a bf16 pool only (either kernel's reason may be the one shown)
    ({"kv_dtype": "fp8_e4m3", "num_heads": 8}, "not in"),
])
def test_requests_outside_the_measurements_are_refused_by_the_declaration(request_, needle):
    reasons = _caps("cuda:sm90").check_request(ForwardMethod.MLA, Phase.DECODE,
                                               **{"page_size": 64, "num_heads": 16,
                                                  "q_dtype": "bf16", "kv_dtype": "bf16",
                                                  **request_})
    assert any(needle in r for r in reasons), reasons


def test_prefill_requests_name_the_reason():
    (reason,) = _caps("cuda:sm90").check_request(ForwardMethod.MLA, Phase.PREFILL)
    assert "no mla kernel for prefill" in reason and "decode only" in reason


def test_every_accepted_head_count_and_page_size_becomes_a_device_claim():
    claims = expand_claims(_caps("cuda:sm90"), "cuda")
    # the plain eager claims (multi-layer, LSE and speculative ones add their own)
    eager = [c.combo for c in claims if c.kind is ClaimKind.EAGER
             and c.check is Check.MATCHES_REFERENCE and c.forward_mode is None
             and c.combo.sm_scale is None]
    assert sorted(c.num_heads for c in eager if c.kv_dtype is DType.BF16) == list(HEAD_COUNTS)
    for q in (DType.BF16, DType.FP8_E4M3):  # the model's q, and the engine's own fp8 q
        assert sorted(c.num_heads for c in eager if c.kv_dtype is DType.FP8_E4M3
                      and c.q_dtype is q) == list(FP8_HEAD_COUNTS)
    assert {(c.page_size, c.q_dtype, c.kv_dtype, c.phase) for c in eager} \
        == {(64, DType.BF16, DType.BF16, Phase.DECODE), (64, DType.BF16, DType.FP8_E4M3,
            Phase.DECODE), (64, DType.FP8_E4M3, DType.FP8_E4M3, Phase.DECODE)}
    refused = {c.check for c in claims if c.kind is ClaimKind.REFUSAL}
    assert {Check.PAGE_SIZE, Check.NUM_HEADS, Check.Q_DTYPE, Check.KV_DTYPE,
            Check.INDEX_DTYPE} <= refused
    capture = [c for c in claims if c.kind is ClaimKind.CAPTURE]
    assert {(c.graph_mode, c.check) for c in capture} >= {(GraphMode.FULL, Check.SPLIT_KV),
                                                          (GraphMode.FULL, Check.REPLAY)}
    # one replay claim per pool dtype and served forward mode, each with a head count its
    # kernel was run with
    assert sorted((str(c.forward_mode), c.combo.q_dtype.value, c.combo.kv_dtype.value,
                   c.combo.num_heads) for c in capture if c.check is Check.REPLAY) == [
        ("None", "bf16", "bf16", 1), ("None", "bf16", "fp8_e4m3", 16),
        ("None", "fp8_e4m3", "fp8_e4m3", 16),
        ("target_verify", "bf16", "bf16", 1), ("target_verify", "bf16", "fp8_e4m3", 16),
        ("target_verify", "fp8_e4m3", "fp8_e4m3", 16)]
    # dense claims are decode only; the sparse kernels (DSA) serve prefill too
    sparse = {Check.SPARSE, Check.SPARSE_INDEX, Check.SPARSE_REFUSES_CAPTURE,
              Check.SPARSE_REPLAY}
    assert all(c.combo.phase is Phase.DECODE for c in claims if c.check not in sparse)
    assert {c.combo.phase for c in claims if c.check in sparse} == {Phase.DECODE,
                                                                    Phase.PREFILL}
    # the LSE is claimed where it is declared: the bf16 pool
    (lse,) = [c for c in claims if c.check is Check.LSE]
    assert lse.combo.kv_dtype is DType.BF16


def test_scheduler_partitions_follow_the_library_formula():
    # max(132 // ceil(s_q * H / 64), 1) on a 132-SM H200: [132, 8] at H=16 was measured
    assert num_sm_parts(16) == 132
    assert num_sm_parts(64) == 132
    assert num_sm_parts(128) == 66
    assert num_sm_parts(16, tokens_per_seq=8) == 66
    assert num_sm_parts(128, num_sms=1) == 1


def test_capture_memory_counts_the_scheduler_and_one_calls_allocations():
    # B=4, H=16: 132 partitions, 136 split rows; allocator granules of 512 bytes
    assert scheduler_bytes(4, 16) == {"tile_scheduler_metadata": 4608, "num_splits": 512}
    assert decode_call_bytes(4, 16) == {"out": 4 * 16 * 512 * 2, "lse": 512,
                                        "lse_accum": 136 * 16 * 4,
                                        "out_accum": 136 * 16 * 512 * 4}
    # DeepSeek-V3 on one GPU: 128 heads, 256 slots -> 66 partitions, 322 split rows
    big = decode_call_bytes(256, 128)
    assert big["out_accum"] == 322 * 128 * 512 * 4
    assert big["out"] == 256 * 128 * 512 * 2
    shape = CaptureShape(max_batch_size=256, max_num_tokens=256, max_seq_len=32768,
                         num_heads=128, page_size=64)
    assert capture_bytes(shape) == sum(big.values()) + sum(scheduler_bytes(256, 128).values())


def test_the_policy_estimate_is_the_same_formula():
    shape = CaptureShape(max_batch_size=8, max_num_tokens=8, max_seq_len=4096, num_heads=16,
                         page_size=64)
    memory = _caps("cuda:sm90").graph_support(Phase.DECODE, GraphMode.FULL).capture_memory
    assert memory.estimate(shape) == capture_bytes(shape) > 0
    assert "num_sm_parts" in memory.formula


def test_capture_memory_of_verify_graphs_is_the_larger_call_over_shared_scheduler_buffers():
    # 8 sequences of 8 drafts at 16 heads: the verify call (128 rows per sequence, 132 // 2
    # partitions) is larger than a decode call; the scheduler buffers are decode's (the
    # most partitions), shared by both
    verify = CaptureShape(max_batch_size=8, max_num_tokens=64, max_seq_len=4096, num_heads=16,
                          page_size=64)
    call = sum(decode_call_bytes(8, 16, tokens_per_seq=8).values())
    assert call > sum(decode_call_bytes(8, 16).values())
    assert capture_bytes(verify) == sum(scheduler_bytes(8, 16).values()) + call
    assert scheduler_bytes(8, 16)["tile_scheduler_metadata"] == 4608  # [132, 8] int32
    fp8 = CaptureShape(max_batch_size=8, max_num_tokens=64, max_seq_len=4096, num_heads=16,
                       page_size=64, kv_dtype=DType.FP8_E4M3)
    assert capture_bytes(fp8) - capture_bytes(verify) == sum(fp8_query_bytes(8, 16, 8).values())


def test_verify_shapes_count_the_reordered_lse():
    # several query tokens per sequence: the LSE is reordered to [B, H, s_q] (a copy)
    assert "lse_reordered" not in decode_call_bytes(4, 16)
    assert decode_call_bytes(4, 16, tokens_per_seq=2)["lse_reordered"] == 512


def test_an_fp8_pool_adds_the_rounded_queries():
    bf16 = CaptureShape(max_batch_size=64, max_num_tokens=64, max_seq_len=4096, num_heads=128,
                        page_size=64)
    fp8 = CaptureShape(max_batch_size=64, max_num_tokens=64, max_seq_len=4096, num_heads=128,
                       page_size=64, kv_dtype=DType.FP8_E4M3)
    assert fp8_query_bytes(64, 128) == {"q_fp8": 64 * 128 * 576, "q_descale": 512}
    assert capture_bytes(fp8) - capture_bytes(bf16) == 64 * 128 * 576 + 512
    # the engine's own fp8 q (with its scale) is the kernel's input: nothing is rounded
    fp8_q = replace(fp8, q_dtype=DType.FP8_E4M3)
    assert capture_bytes(fp8_q) == capture_bytes(bf16)


def test_the_declaration_and_the_hook_import_neither_torch_nor_the_library():
    code = ("import sys, attnreg_flashmla.declaration, attnreg_flashmla.plugin\n"
            "heavy = sorted(m for m in ('torch', 'flash_mla', 'attnreg.backends', "
            "'attnreg.runtime', 'attnreg.testing') if m in sys.modules)\n"
            "print(','.join(heavy))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert proc.stdout.strip() == ""


def test_sparse_kernels_are_declared_on_sm90_only_with_their_capture_support():
    from attnreg.registry import SparseKVFormat

    from attnreg_flashmla.declaration import (
        SPARSE_HEAD_COUNTS,
        sparse_call_bytes,
        sparse_capture_bytes,
    )

    for platform in PLATFORMS:
        caps = _caps(platform)
        assert bool(caps.sparse_kernels) == (platform == "cuda:sm90"), platform
    caps = _caps("cuda:sm90")
    formats = {k.kv_format: k for k in caps.sparse_kernels}
    assert set(formats) == {SparseKVFormat.FP8_DS_MLA, SparseKVFormat.BF16}
    for k in caps.sparse_kernels:
        assert k.phases == {Phase.DECODE, Phase.PREFILL}
        assert k.head_counts == SPARSE_HEAD_COUNTS and k.page_sizes == (PAGE_SIZE,)
        assert k.accepts_top_k(2048) and k.accepts_top_k(128) and not k.accepts_top_k(100)
    # the sm90 prefill kernel asserts topk % 128 == 0 (top-k 64 reached it on the H200)
    assert formats[SparseKVFormat.FP8_DS_MLA].accepts_top_k(64)
    assert not formats[SparseKVFormat.BF16].accepts_top_k(64)
    assert formats[SparseKVFormat.BF16].lse and not formats[SparseKVFormat.FP8_DS_MLA].lse
    # a DSA model with an fp8 pool gets the fp8_ds_mla kernel, a bf16 one the prefill kernel
    assert caps.check_sparse_request("decode", top_k=2048, kv_dtype="fp8_e4m3", num_heads=128,
                                     page_size=64, kv_format="fp8_ds_mla") == []
    assert caps.check_sparse_request("prefill", top_k=2048, kv_dtype="bf16", num_heads=64,
                                     page_size=64, kv_format="bf16") == []
    assert caps.check_sparse_request("decode", top_k=2048, kv_dtype="fp8_e4m3", num_heads=16,
                                     page_size=64)
    for phase, mode in ((Phase.DECODE, GraphMode.FULL), (Phase.PREFILL, GraphMode.BREAKABLE)):
        entry = caps.sparse_graph_support(phase, mode)
        assert not entry.capture.is_unsupported
        shape = CaptureShape(max_batch_size=8, max_num_tokens=8, max_seq_len=8192,
                             num_heads=128, page_size=64, kv_dtype="fp8_e4m3", num_sms=132)
        assert entry.capture_memory.estimate(shape) == sparse_capture_bytes(shape) == sum(
            sparse_call_bytes(8, 128, fp8_rows=True).values())
    assert not caps.sparse_graph_support(Phase.PREFILL, GraphMode.TC_PIECEWISE) \
        .capture.is_unsupported
    # the fp8 kernel's split-KV accumulators: (rows + num_sm_parts(128) = 66) x 128 x 513 x 4
    fp8 = sparse_call_bytes(8, 128, fp8_rows=True)
    assert fp8["out_accum"] == (8 + num_sm_parts(128)) * 128 * 512 * 4
    assert sum(sparse_call_bytes(8, 128, fp8_rows=False).values()) < sum(fp8.values())
