"""CPU tests of the Triton MLA kernels (TRITON_INTERPRET=1 when no GPU; see conftest).

Head dims are fixed (576/512 for MLA, 192/128 for MHA), so token and head counts stay
tiny.  Every kernel is compared with a naive float32 per-sequence softmax written here.
Unused cache slots and unused page-table entries point at NaN-poisoned rows, and outputs
are NaN-poisoned before each call, so a read past a sequence or an unwritten output
fails the comparison.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

from attnreg.backends._triton_kernels import (
    default_extend_splits,
    default_max_splits,
    mha_prefill,
    mla_decode,
    mla_decode_workspace,
    mla_extend,
    mla_extend_workspace,
)
from attnreg.backends._triton_kernels import extend as extend_mod
from attnreg.backends._triton_kernels.decode import DecodeConfig, _mla_decode_impl, decode_config
from attnreg.backends._triton_kernels.extend import ExtendConfig
from attnreg.backends.declarations.triton_sizing import (
    FP8_SCORES_MIN_HEADS,
    FP8_SCORES_T_MAX_HEADS,
    decode_rounds_q,
    fp8_decode_head_ranges,
)
from attnreg.registry import DType
from attnreg.testing.workload import round_q

FP8 = getattr(torch, "float8_e4m3fn", None)
DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = DEV == "cpu"  # tests/conftest.py sets TRITON_INTERPRET=1 without CUDA


def INTERPRETER_SKIP(why: str) -> pytest.MarkDecorator:  # noqa: N802 - reads as a mark
    """A case that the interpreter runs as another case's program: compiled runs only."""
    return pytest.mark.skipif(INTERPRETED, reason=f"Triton interpreter: {why}")


# ----------------------------------------------------------------------------------------
# Builders and references (also imported by test_triton_kernels_gpu.py)
# ----------------------------------------------------------------------------------------

def make_paged_kv(lens, page_size, kv_dtype, *, device=DEV, seed=0, spare_pages=3,
                  pages_per_seq=None):
    """A shuffled paged cache holding ``lens[b]`` tokens per sequence.

    Returns (kv_cache, page_table, dense) where ``dense[b]`` is the float32 [L, 576]
    dequantised-before-scale content of sequence b.  Every slot not holding a token is
    NaN, and page-table entries past a sequence's last page point at a NaN page.
    """
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    need = [max(1, math.ceil(L / page_size)) for L in lens]
    maxp = pages_per_seq or max(need)
    npages = sum(need) + spare_pages
    cache = torch.full((npages, page_size, 576), float("nan"), dtype=torch.float32)
    perm = torch.randperm(npages, generator=g)
    nan_page = int(perm[-1])
    table = torch.full((B, maxp), nan_page, dtype=torch.int32)
    dense = []
    k = 0
    for b, L in enumerate(lens):
        vals = torch.randn(L, 576, generator=g)
        if kv_dtype == FP8:
            vals = vals.to(FP8).float()
        else:
            vals = vals.to(kv_dtype).float()
        for j in range(need[b]):
            p = int(perm[k])
            k += 1
            table[b, j] = p
            lo, hi = j * page_size, min(L, (j + 1) * page_size)
            if hi > lo:
                cache[p, : hi - lo] = vals[lo:hi]
        dense.append(vals)
    cache = cache.to(kv_dtype)  # values were rounded to kv_dtype above: exact
    return cache.to(device), table.to(device), dense


def ref_mla(q, dense, q_pos, sm_scale, kv_scale=1.0):
    """Absorbed MLA for one sequence: q [n, H, 576], dense [L, 576] (unscaled), query j
    sees cache rows 0..q_pos[j].  Returns float32 [n, H, 512]."""
    q = q.float().cpu()
    kv = dense.float().cpu() * kv_scale
    out = torch.zeros(q.shape[0], q.shape[1], 512)
    for j in range(q.shape[0]):
        n = int(q_pos[j]) + 1
        if n <= 0:
            continue
        s = torch.einsum("hd,ld->hl", q[j], kv[:n]) * sm_scale
        out[j] = torch.softmax(s, dim=-1) @ kv[:n, :512]
    return out


def ref_mha(q, k, v, qo, kvp, sm_scale, causal):
    q, k, v = q.float().cpu(), k.float().cpu(), v.float().cpu()
    qo, kvp = qo.cpu().tolist(), kvp.cpu().tolist()
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2])
    for b in range(len(qo) - 1):
        qs, qe, ks, ke = qo[b], qo[b + 1], kvp[b], kvp[b + 1]
        ql, kl = qe - qs, ke - ks
        if ql == 0 or kl == 0:
            continue
        s = torch.einsum("qhd,khd->hqk", q[qs:qe], k[ks:ke]) * sm_scale
        if causal:
            i = torch.arange(ql)[:, None]
            j = torch.arange(kl)[None, :]
            s = s.masked_fill(j > kl - ql + i, float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        out[qs:qe] = torch.einsum("hqk,khd->qhd", p, v[ks:ke])
    return out


def assert_close(out, ref, tol=1.5e-2):
    out = out.float().cpu()
    assert not torch.isnan(out).any(), "output has NaN (unwritten or read a poisoned slot)"
    err = (out - ref).norm() / ref.norm().clamp_min(1e-6)
    assert err < tol, f"relative error {err:.3e} >= {tol}"
    assert (out - ref).abs().max() < 0.1, f"max abs error {(out - ref).abs().max():.3e}"


def run_decode_case(lens, H, page_size, kv_dtype, *, q_dtype=torch.bfloat16, seed=0,
                    kv_scale=1.0, **kw):
    cache, table, dense = make_paged_kv(lens, page_size, kv_dtype, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), H, 576, generator=g).to(q_dtype).to(DEV)
    out = torch.full((len(lens), H, 512), float("nan"), dtype=q_dtype, device=DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    sm = 1.0 / math.sqrt(192)
    mla_decode(q, cache, table, sl, out, sm_scale=sm, kv_scale=kv_scale, **kw)
    scale = float(kv_scale)
    # the shipped config over an fp8 cache from 33 heads computes with q rounded per row
    # (declared): the reference rounds it the same way
    rounded = "cfg" not in kw and decode_rounds_q(H, kv_dtype)
    qr = round_q(q, DType.FP8_E4M3, "row") if rounded else q
    ref = torch.stack([ref_mla(qr[b:b + 1], dense[b], [lens[b] - 1], sm, scale)[0]
                       for b in range(len(lens))])
    assert_close(out, ref)
    return out


# ----------------------------------------------------------------------------------------
# mla_decode
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("force", [1, 2, 3, None])
def test_decode_bf16(page_size, force):
    run_decode_case([1, 37, 70, 16], 3, page_size, torch.bfloat16, max_splits=3,
                    force_num_splits=force)


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_fp8(page_size):
    # The interpreter converts float8_e4m3fn fine (checked with triton 3.9), so no skip.
    run_decode_case([9, 45], 2, page_size, FP8, kv_scale=0.37, max_splits=2,
                    force_num_splits=2)


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_fp8_tensor_scale_fp16_q(splits):
    # the kernel reads a scale tensor twice (the scores at the top, the output after the
    # loop): a scale of 0.5 read wrong at either place is off by far more than the tolerance
    run_decode_case([33, 70], 4, 16, FP8, q_dtype=torch.float16,
                    kv_scale=torch.tensor([0.5], dtype=torch.float32, device=DEV),
                    max_splits=splits, force_num_splits=splits)


def test_decode_page64_fp16():
    run_decode_case([64, 70, 3], 2, 64, torch.float16, q_dtype=torch.float16,
                    max_splits=2, force_num_splits=2)


def test_decode_empty_sequence_gives_zeros():
    out = run_decode_case([0, 20], 2, 16, torch.bfloat16, max_splits=2, force_num_splits=2)
    assert torch.all(out[0].float() == 0)


def test_decode_device_split_count_and_varying_lengths():
    """One workspace, one static split count, lengths changing between calls.

    With min_chunk=16 (tests only; the public path uses 256) sequence lengths decide on the
    device how many of the 4 splits each one uses; the workspace is NaN-poisoned each time
    so a merge that read an unwritten split would produce NaN.
    """
    H, ps = 2, 16
    cfg = decode_config(H, torch.bfloat16)
    ws = mla_decode_workspace(3, H, 4, DEV)
    for lens in ([5, 70, 33], [64, 1, 17], [3, 2, 69]):
        cache, table, dense = make_paged_kv(lens, ps, torch.bfloat16, seed=sum(lens),
                                            pages_per_seq=5)
        q = torch.randn(3, H, 576).bfloat16().to(DEV)
        out = torch.full((3, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
        ws.partial_out.fill_(float("nan"))
        ws.partial_lse.fill_(float("nan"))
        sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
        _mla_decode_impl(q, cache, table, sl, out, sm_scale=0.1, kv_scale=1.0, num_splits=4,
                         min_chunk=16, workspace=ws, cfg=cfg._replace(block_n=16))
        ref = torch.stack([ref_mla(q[b:b + 1], dense[b], [lens[b] - 1], 0.1)[0]
                           for b in range(3)])
        assert_close(out, ref)


# Every decode code path on a few heads (the rest of a head block masked): the mma.sync
# path (16 / 32-head blocks, warps split the tokens) and the un-chained wgmma path of 64+
# heads (isolate_qk); a 16-bit cache and fp8, converted where the compiler puts it or
# loaded twice with fp16 dots (fp8_two_loads); page size 16 with one-page tiles (a page
# holds a 16-token tile), the per-token gather at that page size (page_tiles off) and
# page size 1; with and without splits.
#
# Combinations that launch the same kernel as another case are left out on every device:
# fp8_two_loads with a 16-bit cache (the launch passes `is_fp8 and cfg.fp8_two_loads`:
# h16's kernel) and page_tiles=False at page size 1 (one-page tiles need a page of at
# least a tile, so page size 1 gathers per token either way: h64_isolate's kernel).
# Under the Triton interpreter h32 is skipped: with 3 heads it is h16's program with 29
# instead of 13 masked head rows (num_warps means nothing to the interpreter); compiled,
# it is another mma layout and runs.
_DECODE_VARIANTS = [
    ("h16", DecodeConfig(16, 16, 4, 2)),
    ("h16_two_loads", DecodeConfig(16, 16, 4, 2, fp8_two_loads=True)),
    ("h32", DecodeConfig(32, 16, 8, 2)),
    ("h64_isolate", DecodeConfig(64, 16, 8, 2, isolate_qk=True)),
    ("h64_isolate_gather", DecodeConfig(64, 16, 8, 2, isolate_qk=True, page_tiles=False)),
    ("h64_fp8_scores", DecodeConfig(64, 16, 8, 2, isolate_qk=True, fp8_scores=True)),
    ("h16_fp8_scores_t", DecodeConfig(16, 16, 4, 2, fp8_scores=True, fp8_scores_t=True)),
]


def _decode_variant_cases() -> list[object]:
    cases = []
    for ps in (16, 1):
        for kv in ("bf16", "fp8"):
            for name, cfg in _DECODE_VARIANTS:
                if (cfg.fp8_two_loads or cfg.fp8_scores) and kv != "fp8":
                    continue
                if not cfg.page_tiles and ps < cfg.block_n:
                    continue
                marks = [INTERPRETER_SKIP("h32 interprets as h16 with more masked heads")] \
                    if name == "h32" else []
                cases.append(pytest.param(cfg, kv, ps, id=f"{ps}-{kv}-{name}", marks=marks))
    return cases


@pytest.mark.parametrize("cfg,kv,ps", _decode_variant_cases())
def test_decode_kernel_variants(cfg, kv, ps):
    lens, H = [3, 50, 33], 3
    kv_dtype = torch.bfloat16 if kv == "bf16" else FP8
    scale = 1.0 if kv == "bf16" else 0.6
    cache, table, dense = make_paged_kv(lens, ps, kv_dtype, seed=5)
    q = torch.randn(3, H, 576).bfloat16().to(DEV)
    # fp8 score dots compute with q rounded per head row (declared), so the reference too
    qr = round_q(q, DType.FP8_E4M3, "row") if cfg.fp8_scores else q
    ref = torch.stack([ref_mla(qr[b:b + 1], dense[b], [lens[b] - 1], 0.1, scale)[0]
                       for b in range(3)])
    ws = mla_decode_workspace(3, H, 3, DEV)
    for splits in (1, 3):
        out = torch.full((3, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
        _mla_decode_impl(q, cache, table, torch.tensor(lens, dtype=torch.int32, device=DEV),
                         out, sm_scale=0.1, kv_scale=scale, num_splits=splits,
                         min_chunk=cfg.block_n, workspace=ws, cfg=cfg)
        assert_close(out, ref)


def test_decode_configs_by_head_count_and_cache_dtype():
    """The shipped defaults (issue 20 sweeps): what each head class and cache dtype gets."""
    assert decode_config(16, torch.bfloat16) == DecodeConfig(16, 64, 4, 3, ctas_per_sm=2)
    assert decode_config(16, FP8) == DecodeConfig(16, 64, 4, 2, ctas_per_sm=2,
                                                  fp8_scores=True, fp8_scores_t=True)
    assert decode_config(128, torch.bfloat16).page_tiles
    # an fp8 tile gets its second shared buffer at five stages, a 16-bit one at three
    assert decode_config(64, FP8) == DecodeConfig(64, 64, 8, 5, isolate_qk=True, min_chunk=64,
                                                  page_tiles=True, fp8_scores=True)
    assert decode_config(64, torch.bfloat16) == decode_config(64, FP8)._replace(
        num_stages=3, fp8_scores=False)
    assert decode_config(128, FP8).page_tiles and decode_config(128, FP8).fp8_scores
    assert decode_config(128, "fp8_e4m3") == decode_config(128, FP8)
    # fp8 score dots (q rounded: declared up to FP8_SCORES_T_MAX_HEADS and from
    # FP8_SCORES_MIN_HEADS up) exactly there, and the declaration's ranges say the same
    ranges = fp8_decode_head_ranges()
    for heads in range(1, 129):
        assert decode_rounds_q(heads, FP8) == (heads <= FP8_SCORES_T_MAX_HEADS
                                               or heads >= FP8_SCORES_MIN_HEADS)
        assert [r for lo, hi, r in ranges if lo <= heads <= hi] == \
            [decode_rounds_q(heads, FP8)]
        assert not decode_rounds_q(heads, torch.bfloat16)
    # pages of whole 64-token tiles: the 16-head fp8 tile gets five stages (a second
    # shared buffer) at one program per SM; page 1 and the 16-bit cache keep theirs
    assert decode_config(16, FP8, 64) == DecodeConfig(16, 64, 4, 5, ctas_per_sm=1,
                                                      fp8_scores=True, fp8_scores_t=True)
    assert decode_config(16, FP8, 128) == decode_config(16, FP8, 64)
    assert decode_config(16, FP8, 32) == decode_config(16, FP8)
    assert decode_config(16, torch.bfloat16, 64) == decode_config(16, torch.bfloat16)
    assert decode_config(128, FP8, 64) == decode_config(128, FP8)
    for heads in (8, 16, 32, 64, 128):  # one split sizing per head class ...
        bf = decode_config(heads, torch.bfloat16)
        for f8 in (decode_config(heads, FP8), decode_config(heads, FP8, 64)):
            assert (bf.block_h, bf.min_chunk) == (f8.block_h, f8.min_chunk)
            # ... whose 16-bit split count bounds every config's (estimates without a dtype)
            assert bf.ctas_per_sm >= f8.ctas_per_sm
        for B, L in ((1, 32768), (32, 8192), (128, 4096)):
            most = default_max_splits(B, heads, L, 132)
            assert most == default_max_splits(B, heads, L, 132, torch.bfloat16, 64)
            assert most >= default_max_splits(B, heads, L, 132, FP8, 64)
    # the split count follows the config that runs: fewer where one program fills an SM
    assert default_max_splits(128, 16, 4096, 132, FP8, 64) == 1
    assert default_max_splits(128, 16, 4096, 132, FP8, 1) == 2


@pytest.mark.parametrize("page_size", [16, 1])
def test_decode_min_chunk_not_a_tile_multiple(page_size):
    """A split floor that is not a multiple of the KV tile is rounded up to one: tiles
    must start at tile multiples, or a 16-token tile would straddle two 16-token pages
    (here a 40-token floor would start the second split of the 70-token sequence at 40)."""
    lens, H = [70, 5, 40], 3
    cache, table, dense = make_paged_kv(lens, page_size, torch.bfloat16, seed=8)
    q = torch.randn(3, H, 576).bfloat16().to(DEV)
    ref = torch.stack([ref_mla(q[b:b + 1], dense[b], [lens[b] - 1], 0.1)[0]
                       for b in range(3)])
    ws = mla_decode_workspace(3, H, 4, DEV)
    out = torch.full((3, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
    _mla_decode_impl(q, cache, table, torch.tensor(lens, dtype=torch.int32, device=DEV), out,
                     sm_scale=0.1, kv_scale=1.0, num_splits=4, min_chunk=40, workspace=ws,
                     cfg=decode_config(H)._replace(block_n=16))
    assert_close(out, ref)


def test_decode_parts_launch_each_kernel():
    """parts=("decode",) then ("merge",) gives what one call gives (timing probes)."""
    lens, H = [70, 5, 40], 3
    cache, table, dense = make_paged_kv(lens, 16, torch.bfloat16, seed=4)
    q = torch.randn(3, H, 576).bfloat16().to(DEV)
    ref = torch.stack([ref_mla(q[b:b + 1], dense[b], [lens[b] - 1], 0.1)[0]
                       for b in range(3)])
    ws = mla_decode_workspace(3, H, 4, DEV)
    out = torch.full((3, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kw = dict(sm_scale=0.1, kv_scale=1.0, num_splits=4, min_chunk=16, workspace=ws,
              cfg=decode_config(H)._replace(block_n=16))
    _mla_decode_impl(q, cache, table, sl, out, parts=("decode",), **kw)
    assert torch.isnan(out.float()).all(), "decode alone must leave out to the merge"
    _mla_decode_impl(q, cache, table, sl, out, parts=("merge",), **kw)
    assert_close(out, ref)


@pytest.mark.parametrize("merge_cfg", [(4, 512, 8), (1, 512, 8), (1, 128, 16), (4, 128, 2),
                                       (1, 64, 128)])
def test_decode_merge_variants(merge_cfg):
    """Every merge-kernel shape the host may pick (heads per program, columns, splits
    per step), with 3 heads so that a 4-head program has a masked head."""
    lens, H = [70, 5, 40], 3
    cache, table, dense = make_paged_kv(lens, 16, torch.bfloat16, seed=9)
    q = torch.randn(3, H, 576).bfloat16().to(DEV)
    ref = torch.stack([ref_mla(q[b:b + 1], dense[b], [lens[b] - 1], 0.1)[0]
                       for b in range(3)])
    ws = mla_decode_workspace(3, H, 5, DEV)
    out = torch.full((3, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
    _mla_decode_impl(q, cache, table, torch.tensor(lens, dtype=torch.int32, device=DEV), out,
                     sm_scale=0.1, kv_scale=1.0, num_splits=5, min_chunk=16, workspace=ws,
                     cfg=decode_config(H)._replace(block_n=16), merge_cfg=merge_cfg)
    assert_close(out, ref)


def test_default_max_splits_heuristic():
    assert default_max_splits(128, 128, 4096, 132) == 1
    assert default_max_splits(1, 128, 32768, 132) == 66
    assert default_max_splits(1, 16, 32768, 132) == 128  # capped by 256-token chunks
    assert default_max_splits(8, 128, 1024, 132) == 8  # 128-token chunks at H >= 64
    assert default_max_splits(64, 64, 2048, 132) == 2
    assert default_max_splits(1, 16, 100, 132) == 1


# ----------------------------------------------------------------------------------------
# mla_extend
# ----------------------------------------------------------------------------------------

def run_extend_case(prefix, ext, H, page_size, kv_dtype, *, kv_scale=1.0, seed=0,
                    max_extend_len=None, q_gain=None, round_q_fp8=False, **split):
    lens = [p + e for p, e in zip(prefix, ext)]
    cache, table, dense = make_paged_kv(lens, page_size, kv_dtype, seed=seed)
    T = sum(ext)
    q = torch.randn(T + 2, H, 576, generator=torch.Generator().manual_seed(seed + 7))
    if q_gain is not None:  # one gain per head: rows whose own scales differ widely
        q = q * torch.tensor(q_gain)[None, :, None]
    q = q.bfloat16().to(DEV)
    qo = torch.tensor([0] + list(torch.tensor(ext).cumsum(0).tolist()), dtype=torch.int32,
                      device=DEV)
    out = torch.full((T + 2, H, 512), float("nan"), dtype=torch.bfloat16, device=DEV)
    sm = 1.0 / math.sqrt(192)
    mla_extend(q, cache, table, torch.tensor(lens, dtype=torch.int32, device=DEV),
               torch.tensor(prefix, dtype=torch.int32, device=DEV), qo, out, sm_scale=sm,
               kv_scale=kv_scale, max_extend_len=max_extend_len, round_q_fp8=round_q_fp8,
               **split)
    qr = round_q(q, DType.FP8_E4M3, "row") if round_q_fp8 else q
    refs, start = [], 0
    for b in range(len(ext)):
        pos = [prefix[b] + i for i in range(ext[b])]
        refs.append(ref_mla(qr[start:start + ext[b]], dense[b], pos, sm, kv_scale))
        start += ext[b]
    assert_close(out[:T], torch.cat(refs))
    assert torch.isnan(out[T:].float()).all(), "rows past qo_indptr[B] must stay untouched"
    return out[:T].float().cpu(), torch.cat(refs)


@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_with_prefix(page_size):
    run_extend_case([0, 5, 33], [3, 1, 17], 3, page_size, torch.bfloat16)


def test_extend_no_prefix_bound_larger_than_lengths():
    run_extend_case([0, 0], [20, 7], 2, 16, torch.bfloat16, max_extend_len=40)


def test_extend_fp8_page64():
    run_extend_case([40, 0], [9, 12], 2, 64, FP8, kv_scale=0.8)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_extend_rounds_q_per_row_when_asked(num_splits):
    """round_q_fp8 (a verify step of a decode whose kernel takes fp8 score dots): q is
    rounded to fp8 with one power-of-two scale per (query, head) row, as the oracle's
    "row" rounding does; heads whose |q| differ 2**10-fold each keep their own scale."""
    case = dict(prefix=[40, 3], ext=[4, 2], H=3, page_size=16, kv_dtype=FP8, kv_scale=0.8,
                q_gain=[1024.0, 1.0, 1.0 / 256], num_splits=num_splits, min_chunk=1)
    out, ref = run_extend_case(**case, round_q_fp8=True)
    exact, _ = run_extend_case(**case)
    # the rounded q shows: the exact-q output is farther from the rounded oracle
    assert (out - ref).abs().max() < (exact - ref).abs().max() / 2


# Split-KV extend.  min_chunk=1 lets these short sequences use several 64-token chunks:
# later chunks hold rows that see nothing of them (causal), and num_splits beyond the
# chunks a block needs leaves empty splits, which the merge must ignore.
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_split_kv_matches_reference(page_size):
    run_extend_case([0, 5, 70], [3, 1, 17], 3, page_size, torch.bfloat16, num_splits=4,
                    min_chunk=1)


def test_extend_split_kv_with_a_workspace_and_more_splits_than_chunks():
    T, H = 7 + 40, 2
    ws = mla_extend_workspace(T + 2, H, 9, DEV)
    run_extend_case([100, 0], [7, 40], H, 16, torch.bfloat16, num_splits=9, min_chunk=1,
                    workspace=ws)


def test_extend_split_kv_partials_are_finite():
    """A row with nothing visible in a split (causal) leaves a zero partial and an LSE of
    -inf there, never NaN: every program writes every valid row of its split."""
    # prefix 40 + 32 new tokens: one query block (positions 40..71) whose KV [0, 72) splits
    # at 64 (the KV tile), so the rows at positions 40..63 see nothing of the second split
    T, H, splits = 32 + 40, 2, 5
    ws = mla_extend_workspace(T + 2, H, splits, DEV)
    ws.partial_out.fill_(float("nan"))
    ws.partial_lse.fill_(float("nan"))
    run_extend_case([40, 0], [32, 40], H, 16, torch.bfloat16, num_splits=splits, min_chunk=1,
                    workspace=ws)
    assert torch.isfinite(ws.partial_out[:T, :splits]).all()
    assert not torch.isnan(ws.partial_lse[:T, :splits]).any()
    assert torch.isinf(ws.partial_lse[:T, :splits]).any()  # some split saw nothing


def test_extend_split_floor_not_a_tile_multiple_page64():
    """min_chunk 100 is rounded up to 128 (two 64-token tiles): an unrounded second split
    would start at token 100 and its tile would run past the end of a 64-token page."""
    run_extend_case([150], [20], 2, 64, torch.bfloat16, num_splits=3, min_chunk=100)


def test_extend_split_kv_fp8():
    run_extend_case([60, 3], [5, 30], 2, 16, FP8, kv_scale=0.7, num_splits=3, min_chunk=1)


# Extend tile shapes (ExtendConfig): one query x 4 heads, two queries x 2 heads; a 16-bit
# and an fp8 cache; page 16 (one page per 16-token tile) and 1 (per-token gathers); with
# and without KV splits.  Compiled, all 16 combinations run.  Under the interpreter the
# half of them with an even count of "second" values (q2h2, fp8, page 1, 3 splits): a
# 2^(4-1) fraction in which every three of the four factors still meet in all 8 of their
# combinations, so only the four-way combination is halved.
_EXTEND_VARIANTS = {"h4": ExtendConfig(4, 1, 16, 8, 2), "q2h2": ExtendConfig(2, 2, 16, 4, 3)}


def _extend_variant_cases() -> list[object]:
    cases = []
    for splits in (1, 3):
        for page_size in (16, 1):
            for kv in ("bf16", "fp8"):
                for name, cfg in _EXTEND_VARIANTS.items():
                    odd = (name == "q2h2") + (kv == "fp8") + (page_size == 1) + (splits == 3)
                    marks = [INTERPRETER_SKIP("each 3 factors meet in the other half")] \
                        if odd % 2 else []
                    cases.append(pytest.param(cfg, kv, page_size, splits, marks=marks,
                                              id=f"{splits}-{page_size}-{kv}-{name}"))
    return cases


@pytest.mark.parametrize("cfg,kv,page_size,splits", _extend_variant_cases())
def test_extend_config_variants(monkeypatch, cfg, kv, page_size, splits):
    monkeypatch.setattr(extend_mod, "_extend_config", lambda num_heads: cfg)
    kv_dtype, scale = (torch.bfloat16, 1.0) if kv == "bf16" else (FP8, 0.7)
    run_extend_case([20, 0], [9, 17], 3, page_size, kv_dtype, kv_scale=scale,
                    num_splits=splits, min_chunk=1)


def test_extend_split_kv_refuses_a_small_workspace():
    with pytest.raises(ValueError, match="workspace"):
        run_extend_case([10], [4], 2, 16, torch.bfloat16, num_splits=4,
                        workspace=mla_extend_workspace(6, 2, 2, DEV))
    with pytest.raises(ValueError, match="num_splits"):
        run_extend_case([10], [4], 2, 16, torch.bfloat16, num_splits=0)


def test_default_extend_splits_heuristic():
    # B=1, 16 new tokens: 16 query blocks x 2 head blocks at 128 heads fill 32 of 132 SMs
    assert default_extend_splits(1, 16, 128, 32768, 132) == 4
    # 16 heads: 4 queries per block, 4 programs
    assert default_extend_splits(1, 16, 16, 32768, 132) == 33
    # capped by 256-token chunks of the longest sequence
    assert default_extend_splits(1, 16, 16, 1000, 132) == 4
    # a long extend fills the GPU by itself
    assert default_extend_splits(1, 4096, 128, 32768, 132) == 1
    assert default_extend_splits(8, 64, 128, 4096, 132) == 1


# ----------------------------------------------------------------------------------------
# mha_prefill
# ----------------------------------------------------------------------------------------

def run_mha_case(q_lens, kv_lens, H, dqk, dv, causal, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    Tq, Tk = sum(q_lens), sum(kv_lens)
    q = torch.randn(Tq, H, dqk, generator=g).to(dtype).to(DEV)
    k = torch.randn(Tk, H, dqk, generator=g).to(dtype).to(DEV)
    v = torch.randn(Tk, H, dv, generator=g).to(dtype).to(DEV)
    qo = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32,
                      device=DEV)
    kvp = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), dtype=torch.int32,
                       device=DEV)
    out = torch.full((Tq, H, dv), float("nan"), dtype=dtype, device=DEV)
    sm = 1.0 / math.sqrt(dqk)
    mha_prefill(q, k, v, qo, kvp, out, sm_scale=sm, causal=causal)
    assert_close(out, ref_mha(q, k, v, qo, kvp, sm, causal))


def test_mha_prefill_causal_with_prefix():
    run_mha_case([5, 40, 1], [5, 70, 30], 2, 192, 128, True)


def test_mha_prefill_noncausal_fp16():
    run_mha_case([17, 3], [17, 50], 2, 192, 128, False, dtype=torch.float16)


def test_mha_prefill_dims_128():
    run_mha_case([33], [45], 2, 128, 128, True)


def test_mha_prefill_validation():
    q = torch.zeros(4, 2, 192, dtype=torch.bfloat16, device=DEV)
    k = torch.zeros(4, 2, 192, dtype=torch.bfloat16, device=DEV)
    v = torch.zeros(4, 2, 128, dtype=torch.bfloat16, device=DEV)
    out = torch.zeros(4, 2, 128, dtype=torch.bfloat16, device=DEV)
    ind = torch.tensor([0, 4], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="qo_indptr.*int32"):
        mha_prefill(q, k, v, ind.long(), ind, out, sm_scale=1.0)
    with pytest.raises(ValueError, match="kv_indptr.*int32"):
        mha_prefill(q, k, v, ind, ind.long(), out, sm_scale=1.0)
    with pytest.raises(ValueError, match="k:"):
        mha_prefill(q, k[:, :, :128], v, ind, ind, out, sm_scale=1.0)
    with pytest.raises(ValueError, match="v:"):
        mha_prefill(q, k, v[:3], ind, ind, out, sm_scale=1.0)
    with pytest.raises(ValueError, match="out:"):
        mha_prefill(q, k, v, ind, ind, out[:, :, :64], sm_scale=1.0)
    with pytest.raises(ValueError, match="k:.*dtype"):
        mha_prefill(q, k.half(), v, ind, ind, out, sm_scale=1.0)


# ----------------------------------------------------------------------------------------
# Validation of the MLA entry points
# ----------------------------------------------------------------------------------------

def _mla_inputs():
    cache, table, _ = make_paged_kv([4, 6], 16, torch.bfloat16)
    q = torch.zeros(2, 2, 576, dtype=torch.bfloat16, device=DEV)
    out = torch.zeros(2, 2, 512, dtype=torch.bfloat16, device=DEV)
    sl = torch.tensor([4, 6], dtype=torch.int32, device=DEV)
    return q, cache, table, sl, out


def test_decode_refuses_int64_and_bad_shapes():
    q, cache, table, sl, out = _mla_inputs()
    with pytest.raises(ValueError, match="seq_lens.*int32"):
        mla_decode(q, cache, table, sl.long(), out, sm_scale=1.0, max_splits=1)
    with pytest.raises(ValueError, match="page_table.*int32"):
        mla_decode(q, cache, table.long(), sl, out, sm_scale=1.0, max_splits=1)
    with pytest.raises(ValueError, match="q:.*576"):
        mla_decode(q[:, :, :512], cache, table, sl, out, sm_scale=1.0, max_splits=1)
    with pytest.raises(ValueError, match="kv_cache"):
        mla_decode(q, cache.float(), table, sl, out, sm_scale=1.0, max_splits=1)
    with pytest.raises(ValueError, match="out:"):
        mla_decode(q, cache, table, sl, out[:1], sm_scale=1.0, max_splits=1)
    with pytest.raises(ValueError, match="workspace"):
        mla_decode(q, cache, table, sl, out, sm_scale=1.0, max_splits=4,
                   workspace=mla_decode_workspace(2, 2, 2, DEV))
    with pytest.raises(ValueError, match="force_num_splits"):
        mla_decode(q, cache, table, sl, out, sm_scale=1.0, max_splits=2, force_num_splits=3)


def test_extend_refuses_int64():
    q, cache, table, sl, out = _mla_inputs()
    qo = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEV)
    pre = sl - 1
    for name, args in [
        ("qo_indptr", (q, cache, table, sl, pre, qo.long(), out)),
        ("prefix_lens", (q, cache, table, sl, pre.long(), qo, out)),
        ("seq_lens", (q, cache, table, sl.long(), pre, qo, out)),
        ("page_table", (q, cache, table.long(), sl, pre, qo, out)),
    ]:
        with pytest.raises(ValueError, match=f"{name}.*int32"):
            mla_extend(*args, sm_scale=1.0, max_extend_len=1)
