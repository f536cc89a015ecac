"""Claims expansion: declarations of the built-in backends -> claims (pure, no torch)."""

from __future__ import annotations

import math
import subprocess
import sys
from dataclasses import replace

import pytest

from attnreg.registry import (
    DType,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    Phase,
    SupportKind,
    get_registry,
)
from attnreg.testing.batches import eager_specs, quick_specs
from attnreg.testing.checks import CPU_RUNNABLE_CAPTURE_CHECKS, FP8_LARGE_Q
from attnreg.testing.claims import (
    YARN_SM_SCALE,
    Check,
    ClaimKind,
    expand_claims,
    head_dims_config,
)


def _claims(name: str, platform: str, device: str, **kw):
    return expand_claims(get_registry().declaration(name, platform), device, **kw)


@pytest.mark.parametrize("name,platform,device", [
    ("reference", "cpu", "cpu"), ("triton", "cuda:sm90", "cuda"),
    ("flashinfer_mla", "cuda:sm90", "cuda"), ("flash_attn_cute", "cuda:sm90", "cuda"),
    ("flash_attn_cute", "cuda:sm100", "cuda"), ("trtllm_mla", "cuda:sm100", "cuda"),
])
def test_every_declared_value_is_covered_by_an_eager_claim(name, platform, device):
    caps = get_registry().declaration(name, platform)
    claims = expand_claims(caps, device)
    eager = [c.combo for c in claims if c.kind is ClaimKind.EAGER]
    for k in caps.kernels:
        for phase in k.phases:
            mine = [c for c in eager if c.method is k.method and c.phase is phase]
            assert mine, f"no eager claim for {k.method} {phase}"
            for page in k.page_sizes:
                assert any(c.page_size == page for c in mine), (k.kernel, page)
            for dims in k.head_dims:
                assert any(c.head_dims == dims for c in mine), (k.kernel, dims)
            for q in k.q_dtypes - {DType.FP8_E4M3}:
                assert any(c.q_dtype is q for c in mine), (k.kernel, q)
            if k.page_sizes:
                for kv in k.kv_dtypes:
                    assert any(c.kv_dtype is kv for c in mine), (k.kernel, kv)
            # every eager combination is one the declaration accepts
            for c in mine:
                assert caps.check_request(c.method, c.phase, head_dims=c.head_dims,
                                          q_dtype=c.q_dtype, kv_dtype=c.kv_dtype,
                                          page_size=c.page_size if k.page_sizes else None,
                                          num_heads=c.num_heads) == []


@pytest.mark.parametrize("name,platform", [("reference", "cpu"), ("triton", "cuda:sm90"),
                                           ("flashinfer_mla", "cuda:sm90"),
                                           ("trtllm_mla", "cuda:sm100")])
def test_refusal_claims_ask_for_something_the_declaration_rejects(name, platform):
    caps = get_registry().declaration(name, platform)
    refusals = [c for c in expand_claims(caps, "cuda") if c.kind is ClaimKind.REFUSAL]
    checks = {c.check for c in refusals}
    assert {Check.NUM_HEADS, Check.INDEX_DTYPE, Check.HEAD_DIMS} <= checks
    for c in refusals:
        if c.check in (Check.INDEX_DTYPE, Check.SPARSE_INDEX):
            continue  # int32 lengths and in-pool top-k slots are runtime contracts
        combo = c.combo
        paged = any(k.page_sizes for k in caps.kernels_for(combo.method, combo.phase))
        reasons = caps.check_request(combo.method, combo.phase, head_dims=combo.head_dims,
                                     q_dtype=combo.q_dtype, kv_dtype=combo.kv_dtype,
                                     page_size=combo.page_size if paged else None,
                                     num_heads=combo.num_heads)
        assert reasons, f"{c.id} is declared, so refusing it would be wrong"


def test_unsupported_capture_modes_become_refusal_claims():
    claims = _claims("reference", "cpu", "cpu")
    refuse = {(c.combo.phase, c.graph_mode) for c in claims if c.check is Check.REFUSES_CAPTURE}
    assert refuse == {(Phase.DECODE, GraphMode.FULL), (Phase.PREFILL, GraphMode.BREAKABLE)}
    # tc_piecewise is native for the reference: its eager path is claimed under it
    assert any(c.graph_mode is GraphMode.TC_PIECEWISE and c.check is Check.CAPTURE_PATH
               for c in claims)


def test_native_capture_modes_expand_into_replay_churn_sync_and_split_claims():
    claims = _claims("triton", "cuda:sm90", "cuda")
    full = {c.check for c in claims if c.graph_mode is GraphMode.FULL and not c.speculative}
    assert full == {Check.CAPTURE_PATH, Check.REPLAY, Check.ALLOCATOR_CHURN,
                    Check.NO_SYNC_ALLOC, Check.SPLIT_KV, Check.PADDED_ROWS,
                    Check.CAPTURE_MEMORY, Check.MULTI_LAYER, FP8_LARGE_Q,
                    Check.SPARSE_REPLAY, Check.KV_SCALE_CHANGE}
    # its sparse decode is declared on cuda (the H200 ran its claims) and on cpu
    cpu_full = {c.check for c in _claims("triton", "cpu", "cpu")
                if c.graph_mode is GraphMode.FULL and not c.speculative}
    assert Check.SPARSE_REPLAY in cpu_full
    breakable = {c.check for c in claims if c.graph_mode is GraphMode.BREAKABLE}
    assert Check.PINNING in breakable and Check.SPLIT_KV in breakable  # split extend
    # a replay claim per declared kv dtype of the pinned kernel (fp8 + graphs broke engines)
    kv = {c.combo.kv_dtype for c in claims if c.check is Check.REPLAY
          and c.graph_mode is GraphMode.FULL}
    assert kv == {DType.BF16, DType.FP16, DType.FP8_E4M3}
    split = next(c for c in claims if c.check is Check.SPLIT_KV
                 and c.graph_mode is GraphMode.FULL)
    assert split.batches[0] == "ragged_decode" and "long_kv" in split.batches
    # a prefill graph is captured for a few tokens: sized for hundreds it would not split
    split = next(c for c in claims if c.check is Check.SPLIT_KV
                 and c.graph_mode is GraphMode.BREAKABLE)
    assert split.batches == ("short_extend", "long_kv_extend")


@pytest.mark.parametrize("name,platform", [("triton", "cuda:sm90"),
                                           ("flashinfer_mla", "cuda:sm90"),
                                           ("flash_attn_cute", "cuda:sm90"),
                                           ("trtllm_mla", "cuda:sm100")])
def test_every_full_or_breakable_capture_claims_padded_rows_and_capture_memory(name, platform):
    """Issue 15: padded replays give zero rows, and the declared capture memory is measured,
    for every backend that captures attention (FULL decode, BREAKABLE prefill)."""
    claims = _claims(name, platform, "cuda")
    captured = {(c.combo.phase, c.graph_mode) for c in claims
                if c.graph_mode in (GraphMode.FULL, GraphMode.BREAKABLE)
                and c.check is Check.REPLAY}
    assert captured
    for check in (Check.PADDED_ROWS, Check.CAPTURE_MEMORY):
        have = {(c.combo.phase, c.graph_mode) for c in claims if c.check is check}
        assert have == captured, (check, have, captured)
        assert all(not c.needs_device_graphs for c in claims if c.check is check)
    # one capture-memory claim per declared kv dtype: an FP8 fallback converts the pool
    kv = {c.combo.kv_dtype for c in claims if c.check is Check.CAPTURE_MEMORY}
    assert kv == {c.combo.kv_dtype for c in claims if c.check is Check.REPLAY}
    assert not [c for c in claims if c.check in (Check.PADDED_ROWS, Check.CAPTURE_MEMORY)
                and c.graph_mode is GraphMode.TC_PIECEWISE]


@pytest.mark.parametrize("name,platform,pages", [
    ("triton", "cuda:sm90", {1, 16, 64}), ("flashinfer_mla", "cuda:sm90", {1, 16, 64}),
    ("trtllm_mla", "cuda:sm100", {32, 64}),
])
def test_graphs_replay_and_pad_at_the_smallest_and_largest_declared_page_sizes(
        name, platform, pages):
    """A graph's page table and padding page are set per page size on a path no eager
    claim runs: replay and padded_rows are made at both ends of the declared sizes, at
    every capture site, at the base dtypes and heads; on cpu only with --exhaustive."""
    claims = _claims(name, platform, "cuda")
    for check in (Check.REPLAY, Check.PADDED_ROWS):
        sites = {(c.combo.phase, c.graph_mode, c.forward_mode) for c in claims
                 if c.check is check}
        assert sites
        for site in sites:
            mine = [c for c in claims if c.check is check
                    and (c.combo.phase, c.graph_mode, c.forward_mode) == site]
            base = mine[0].combo
            at = {c.combo.page_size for c in mine
                  if replace(c.combo, page_size=base.page_size) == base}
            assert at == pages, (check, site, at)
    cpu = _claims("triton", "cpu", "cpu")
    assert {c.combo.page_size for c in cpu if c.check is Check.PADDED_ROWS} == {16}
    exhaustive = _claims("triton", "cpu", "cpu", exhaustive=True)
    assert {c.combo.page_size for c in exhaustive
            if c.check is Check.PADDED_ROWS} == {1, 16, 64}


def test_a_backend_of_one_page_size_gets_no_page_variants():
    caps = get_registry().declaration("triton", "cuda:sm90")
    one = replace(caps, kernels=tuple(replace(k, page_sizes=(16,)) if k.page_sizes else k
                                      for k in caps.kernels))
    claims = expand_claims(one, "cuda")
    assert {c.combo.page_size for c in claims if c.check in (Check.REPLAY,
                                                            Check.PADDED_ROWS)} == {16}


def test_pinned_mode_captures_only_the_pinned_method_and_unpinned_mode_every_method():
    pinned = _claims("triton", "cuda:sm90", "cuda")
    methods = {c.combo.method for c in pinned if c.graph_mode is GraphMode.BREAKABLE}
    assert methods == {ForwardMethod.MLA}
    unpinned = _claims("flash_attn_cute", "cuda:sm90", "cuda")
    bk = [c for c in unpinned if c.graph_mode is GraphMode.BREAKABLE]
    assert bk and {c.combo.method for c in bk} == {ForwardMethod.MHA}
    assert not any(c.check is Check.PINNING for c in bk)


def test_fallback_modes_are_claimed_with_their_fallback():
    claims = _claims("trtllm_mla", "cuda:sm100", "cuda")
    fb = [c for c in claims if c.capture is SupportKind.FALLBACK]
    assert fb and all(c.fallback_to == "flashinfer_mla" for c in fb)
    assert {c.graph_mode for c in fb} == {GraphMode.BREAKABLE, GraphMode.TC_PIECEWISE}


def test_cpu_skips_exactly_the_claims_that_need_device_graphs():
    for c in _claims("triton", "cpu", "cpu"):
        if c.kind is ClaimKind.CAPTURE and c.check not in CPU_RUNNABLE_CAPTURE_CHECKS:
            assert c.skip_reason.startswith("no CUDA graphs on cpu"), c.id
        else:
            assert not c.skip_reason, c.id


def test_exhaustive_is_the_full_product_and_a_superset():
    cover = {c.id for c in _claims("triton", "cuda:sm90", "cuda")}
    full = {c.id for c in _claims("triton", "cuda:sm90", "cuda", exhaustive=True)}
    assert cover < full
    # decode MLA (the plain matches_reference ids: backend/eager/phase/method/dtypes/
    # page/heads/dims) x 4 page sizes x 1 dims: the 16-bit pools (2 pairs) at 16 and 128
    # heads; the fp8 pool (2 pairs) at 16 (1..16 heads: two entries, pages below 64 and
    # from 64, together the 4 sizes), at 32 (17..32) and at 128 (33..128, fp8 score dots
    # on q rounded)
    decode = [i for i in full if i.startswith("triton/eager/decode/") and i.count("/") == 7]
    assert len(decode) == 4 * (2 * 2 + 2 * 2 + 2 * 1)


def test_claim_ids_are_unique_and_k_friendly():
    for name, plat in (("reference", "cpu"), ("triton", "cuda:sm90"),
                       ("flashinfer_mla", "cuda:sm90")):
        ids = [c.id for c in _claims(name, plat, "cuda", exhaustive=True)]
        assert len(ids) == len(set(ids))
        assert all(" " not in i for i in ids)


def test_head_dims_map_to_config_fields():
    assert head_dims_config(ForwardMethod.MHA, (192, 128)) == {
        "qk_nope_head_dim": 128, "v_head_dim": 128, "qk_rope_head_dim": 64}
    assert head_dims_config(ForwardMethod.MLA, (320, 256))["kv_lora_rank"] == 256
    assert head_dims_config(ForwardMethod.MLA, (576, 576)) is None


def test_importing_the_plugin_and_expanding_claims_does_not_import_torch():
    code = ("import sys; import attnreg.testing.plugin, attnreg.testing.suite; "
            "from attnreg.testing.claims import expand_claims; "
            "from attnreg.registry import get_registry; "
            "expand_claims(get_registry().declaration('triton', 'cuda:sm90'), 'cuda'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_fallback_modes_claim_that_the_declared_fallback_serves_them():
    claims = _claims("trtllm_mla", "cuda:sm100", "cuda")
    served = [c for c in claims if c.check is Check.FALLBACK_SERVED]
    fallback_modes = {(g.phase, g.mode) for g in get_registry().declaration(
        "trtllm_mla", "cuda:sm100").graph_modes if g.capture.is_fallback}
    assert {(c.combo.phase, c.graph_mode) for c in served} == fallback_modes
    assert all(c.fallback_to == "flashinfer_mla" and not c.needs_device_graphs
               and "flashinfer_mla" in c.statement for c in served)
    # native-only declarations make no such claim
    assert not [c for c in _claims("triton", "cuda:sm90", "cuda")
                if c.check is Check.FALLBACK_SERVED]


# -- the engine contract: speculative modes, LSE, layers ------------------------------

def test_full_decode_graphs_claim_each_declared_speculative_mode_at_its_draft_tokens():
    claims = _claims("triton", "cuda:sm90", "cuda")
    for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND):
        spec = [c for c in claims if c.forward_mode is mode]
        capture = {c.check for c in spec if c.kind is ClaimKind.CAPTURE}
        assert capture == {Check.CAPTURE_PATH, Check.REPLAY, Check.ALLOCATOR_CHURN,
                           Check.NO_SYNC_ALLOC, Check.SPLIT_KV, Check.PADDED_ROWS,
                           Check.CAPTURE_MEMORY, Check.MULTI_LAYER, FP8_LARGE_Q,
                           Check.KV_SCALE_CHANGE}
        assert all(c.query_len == 8 and c.graph_mode in (GraphMode.FULL, GraphMode.DISABLED)
                   for c in spec)
        assert any(c.kind is ClaimKind.EAGER for c in spec)
        replay = next(c for c in spec if c.check is Check.REPLAY)
        assert replay.batches[0].endswith("_ragged") and f"/full/{mode}/replay/" in replay.id
    # a backend that declares no speculative mode makes no such claim
    assert not [c for c in _claims("flash_attn_cute", "cuda:sm100", "cuda") if c.speculative]


def test_reference_claims_speculative_modes_eagerly_only():
    claims = _claims("reference", "cpu", "cpu")
    spec = [c for c in claims if c.speculative]
    assert spec and all(c.kind is ClaimKind.EAGER for c in spec)


def test_lse_is_claimed_per_method_and_phase_where_a_kernel_declares_it():
    claims = _claims("triton", "cuda:sm90", "cuda")
    lse = {(c.combo.method, c.combo.phase) for c in claims if c.check is Check.LSE}
    assert lse == {(ForwardMethod.MLA, Phase.DECODE), (ForwardMethod.MLA, Phase.PREFILL),
                   (ForwardMethod.MHA, Phase.PREFILL),
                   (ForwardMethod.MHA_CHUNKED_KV, Phase.PREFILL)}
    assert not [c for c in _claims("trtllm_mla", "cuda:sm100", "cuda") if c.check is Check.LSE]


def test_multi_layer_claims_use_an_fp8_pool_where_declared():
    claims = _claims("triton", "cuda:sm90", "cuda")
    multi = [c for c in claims if c.check is Check.MULTI_LAYER]
    assert {c.kind for c in multi} == {ClaimKind.EAGER, ClaimKind.CAPTURE}
    assert all(c.combo.kv_dtype is DType.FP8_E4M3 for c in multi)
    assert all(not c.needs_device_graphs for c in multi)


# -- issue 17: a non-default softmax scale, and the head counts a cpu run covers ---------

@pytest.mark.parametrize("name,platform,device", [
    ("reference", "cpu", "cpu"), ("triton", "cpu", "cpu"), ("triton", "cuda:sm90", "cuda"),
    ("flashinfer_mla", "cuda:sm90", "cuda"), ("flash_attn_cute", "cuda:sm90", "cuda"),
    ("flash_attn_cute", "cuda:sm100", "cuda"), ("trtllm_mla", "cuda:sm100", "cuda"),
])
def test_every_method_and_capture_path_is_also_claimed_at_a_yarn_softmax_scale(name, platform,
                                                                               device):
    claims = _claims(name, platform, device)
    # fp8_large_q claims run at their own scale (checks.LARGE_Q_SM_SCALE), not YaRN's
    scaled = [c for c in claims if c.combo is not None and c.combo.sm_scale is not None
              and c.check != FP8_LARGE_Q]
    assert {c.combo.sm_scale for c in scaled} == {YARN_SM_SCALE}
    assert abs(YARN_SM_SCALE - 1 / math.sqrt(192)) > 0.05  # far from the default
    assert all(c.id.endswith("/sm_scale0.1352") for c in scaled)
    # eagerly: every (method, phase) the backend serves
    plain = [c for c in claims if c.check is Check.MATCHES_REFERENCE and not c.speculative]
    assert {(c.combo.method, c.combo.phase) for c in scaled if c.kind is ClaimKind.EAGER} \
        == {(c.combo.method, c.combo.phase) for c in plain}
    # under capture: each capture-mode code path of the default scale has a scaled twin
    paths = [c for c in claims if c.check is Check.CAPTURE_PATH and not c.speculative]
    assert {(c.combo.phase, c.graph_mode, c.combo.method) for c in paths
            if c.combo.sm_scale is None} \
        == {(c.combo.phase, c.graph_mode, c.combo.method) for c in paths
            if c.combo.sm_scale is not None}
    assert all(not c.skip_reason for c in scaled)


def test_a_cpu_run_claims_16_and_the_largest_declared_head_count_on_one_small_batch():
    claims = _claims("triton", "cpu", "cpu")
    plain = [c for c in claims if c.check is Check.MATCHES_REFERENCE and not c.speculative
             and c.combo.sm_scale is None]
    for method, phase in {(c.combo.method, c.combo.phase) for c in plain}:
        mine = [c for c in plain if (c.combo.method, c.combo.phase) == (method, phase)]
        # decode: the fp8 pool's 1..16 entry claims 2 and 16, its 17..32 and 33..128
        # entries their smallest (17, 33) on cpu
        want = {2, 16, 17, 33, 128} if phase is Phase.DECODE else {2, 16, 128}
        assert {c.combo.num_heads for c in mine} == want, (method, phase)
        for c in mine:
            if c.combo.num_heads == 2:
                assert c.batches == eager_specs(phase, method=method), c.id
            else:  # the interpreter runs every head in turn: one small batch
                assert c.batches == quick_specs(phase), c.id
    # cuda: 16 and 128 on the phase's full batches, as before
    cuda = [c for c in _claims("triton", "cuda:sm90", "cuda")
            if c.check is Check.MATCHES_REFERENCE and not c.speculative]
    assert {c.combo.num_heads for c in cuda} == {16, 32, 128}
    assert all(c.batches == eager_specs(c.combo.phase, method=c.combo.method) for c in cuda)


def test_a_cpu_run_of_a_fixed_head_count_list_claims_its_smallest_16_and_largest():
    # trtllm_mla's decode kernel declares (16, 32, 64, 128); FlashMLA's (1, ..., 128)
    caps = get_registry().declaration("trtllm_mla", "cuda:sm100")
    decode = {c.combo.num_heads for c in expand_claims(caps, "cpu")
              if c.check is Check.MATCHES_REFERENCE and c.combo.phase is Phase.DECODE}
    assert decode == {16, 128}
    # --heads fixes the list: nothing else is added
    fixed = {c.combo.num_heads for c in expand_claims(caps, "cpu", heads=[32])
             if c.kind is ClaimKind.EAGER and c.combo.phase is Phase.DECODE}
    assert fixed == {32}


def test_multi_layer_claims_run_a_head_count_the_fp8_kernel_declares():
    # FlashMLA-like: the bf16 kernel takes 1..128 heads, the fp8 one only (16, 32)
    caps = get_registry().declaration("triton", "cuda:sm90")
    bf16, fp8 = (replace(k, kv_dtypes=frozenset({kv}), **extra)
                 for k, kv, extra in ((caps.kernels[0], DType.BF16, {}),
                                      (caps.kernels[0], DType.FP8_E4M3,
                                       {"head_counts": (16, 32), "max_heads": 32})))
    caps = replace(caps, kernels=(bf16, fp8))
    for device in ("cpu", "cuda"):
        multi = [c for c in expand_claims(caps, device) if c.check is Check.MULTI_LAYER]
        assert multi and all(c.combo.kv_dtype is DType.FP8_E4M3 for c in multi)
        assert all(c.combo.num_heads in (16, 32) for c in multi), [c.id for c in multi]


# -- a kernel entry split by page size: its own configuration is claimed under capture ---

_WHOLE_PAGE_CAPTURE_CHECKS = {Check.REPLAY, Check.CAPTURE_MEMORY, Check.PADDED_ROWS,
                              Check.SPLIT_KV, FP8_LARGE_Q}


@pytest.mark.parametrize("device,exhaustive,heads", [
    ("cuda", False, {16}), ("cpu", True, {2}), ("cpu", False, set()),
])
def test_capture_claims_cover_triton_s_whole_page_fp8_config(device, exhaustive, heads):
    """Up to 16 heads over an fp8 pool, triton's decode runs another config from 64-token
    pages (whole-page tiles, five stages, one program per SM: fewer splits, a smaller
    workspace), declared as its own entry: every decode-phase FULL graph (plain, target
    verify, draft extend) is claimed at page 64 with each fp8 pair, on cuda and with
    --exhaustive (a cpu run captures the base configuration only)."""
    platform = "cuda:sm90" if device == "cuda" else "cpu"
    caps = get_registry().declaration("triton", platform)
    whole = [k for k in caps.kernels_for(ForwardMethod.MLA, Phase.DECODE)
             if k.page_sizes == (64,)]
    assert len(whole) == 2 and all("pages >= 64" in k.kernel for k in whole)
    claims = expand_claims(caps, device, exhaustive=exhaustive)
    at = [c for c in claims if c.kind is ClaimKind.CAPTURE and c.combo.page_size == 64
          and c.combo.kv_dtype is DType.FP8_E4M3]
    got = {(c.check, c.forward_mode, c.combo.q_dtype, c.combo.num_heads) for c in at}
    modes = (None, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)
    want = {(check, mode, q, h) for check in _WHOLE_PAGE_CAPTURE_CHECKS for mode in modes
            for q in (DType.BF16, DType.FP16) for h in heads}
    # the scale change at the site's q dtype only
    want |= {(Check.KV_SCALE_CHANGE, mode, DType.BF16, h) for mode in modes for h in heads}
    assert got == want
    for c in at:  # each one served by the whole-page entry
        assert any(k.accepts_heads(c.combo.num_heads) and c.combo.q_dtype in k.q_dtypes
                   for k in whole), c.id


def test_dtype_variants_add_an_entry_split_by_page_size_at_its_own_base_page():
    from attnreg.testing.claims import base_combo, dtype_variants

    caps = get_registry().declaration("triton", "cuda:sm90")
    bf16 = caps.kernels[0]  # bf16 / bf16 decode, 1..128 heads, pages (1, 16, 32, 64)

    def variants(*kernels):
        split = replace(caps, kernels=kernels)
        base = base_combo(split, ForwardMethod.MLA, Phase.DECODE, "cuda")
        return base, dtype_variants(split, base, ForwardMethod.MLA, Phase.DECODE, "cuda",
                                    None)

    # split by page size only: the second entry at its own (only) page, the base's heads
    base, out = variants(replace(bf16, page_sizes=(1, 16, 32)), replace(bf16, page_sizes=(64,)))
    assert (base.page_size, base.num_heads) == (16, 16)
    assert out == [base, replace(base, page_size=64)]
    # an entry that takes the base's page and heads is covered: nothing added
    base, out = variants(replace(bf16, page_sizes=(1, 16)), replace(bf16, page_sizes=(64, 16)))
    assert out == [base]
    # an entry taking neither the base's heads nor its page: its base heads and its base
    # page (the preferred 16 first where it has it)
    base, out = variants(replace(bf16, max_heads=32),
                         replace(bf16, min_heads=33, page_sizes=(64, 16)),
                         replace(bf16, min_heads=33, page_sizes=(1,)))
    assert out == [base, replace(base, num_heads=128), replace(base, num_heads=128,
                                                                page_size=1)]
