"""GPU tests of the Triton MLA kernels: larger shapes and CUDA-graph capture / replay.

Skipped without CUDA (see tests/conftest.py).  Same references as the CPU tests.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from attnreg.backends._triton_kernels import (
    _launch,
    default_max_splits,
    mla_decode,
    mla_decode_workspace,
    mla_extend,
    mla_extend_workspace,
)
from attnreg.backends._triton_kernels import decode as decode_mod
from attnreg.backends._triton_kernels import extend as extend_mod
from attnreg.backends._triton_kernels.decode import DecodeConfig, _mla_decode_impl
from attnreg.backends._triton_kernels.extend import ExtendConfig
from attnreg.registry import GraphMode
from attnreg.runtime import GraphRunner

from .test_triton_kernels import (
    FP8,
    assert_close,
    make_paged_kv,
    ref_mla,
    run_decode_case,
    run_extend_case,
    run_mha_case,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("H", [16, 64, 128])
@pytest.mark.parametrize("page_size", [1, 64])
def test_decode_large(H, page_size):
    lens = [1, 300, 2049, 5000]
    run_decode_case(lens, H, page_size, torch.bfloat16, max_splits=8)
    run_decode_case(lens, H, page_size, torch.bfloat16, max_splits=8, force_num_splits=1)


@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("page_size", [16, 64])
def test_decode_fp8_large(H, page_size):
    run_decode_case([777, 4096], H, page_size, FP8, kv_scale=0.25, max_splits=8)


# The fp8 decode configs at their real tile sizes (the CPU tests run them with 16-token
# tiles): the shipped 16- and 64-head configs (page 64: one-page tiles at 16 heads, the
# per-token gather at 64), and the 64-head one with one-page tiles.
@pytest.mark.parametrize("cfg", [
    DecodeConfig(16, 32, 4, 3, ctas_per_sm=2, fp8_two_loads=True),  # the 16-head default
    DecodeConfig(64, 64, 8, 3, isolate_qk=True, min_chunk=128, page_tiles=False),  # 64+
    DecodeConfig(64, 64, 8, 3, isolate_qk=True, min_chunk=128),
], ids=["h16_default", "h64_default", "h64_page_tiles"])
@pytest.mark.parametrize("page_size", [1, 64])
def test_decode_fp8_variants_large(cfg, page_size):
    lens, H = [777, 4096, 1], (16 if cfg.block_h == 16 else 128)
    cache, table, dense = make_paged_kv(lens, page_size, FP8, seed=3)
    q = torch.randn(3, H, 576).bfloat16().cuda()
    ref = torch.stack([ref_mla(q[b:b + 1], dense[b], [lens[b] - 1], 0.07, 0.25)[0]
                       for b in range(3)])
    ws = mla_decode_workspace(3, H, 8, "cuda")
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    for splits in (1, 8):
        out = torch.full((3, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        _mla_decode_impl(q, cache, table, sl, out, sm_scale=0.07, kv_scale=0.25,
                         num_splits=splits, min_chunk=cfg.block_n, workspace=ws, cfg=cfg)
        assert_close(out, ref)


class _CountJit:
    """Wraps a @triton.jit kernel and counts its JIT launches."""

    def __init__(self, fn):
        self.fn, self.launches = fn, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.fn[grid]


@pytest.mark.parametrize("H,kv,page_size", [(16, "bf16", 1), (128, "bf16", 64),
                                            (16, "fp8", 64), (128, "fp8", 16)])
@pytest.mark.parametrize("misaligned", [False, True])
@pytest.mark.parametrize("splits", [1, 8])
def test_direct_launch_matches_the_jit_launch(monkeypatch, H, kv, page_size, misaligned,
                                              splits):
    """The cached host path (the compiled kernel launched directly after the first JIT
    launch) writes bit for bit what the JIT launch writes, split or not, aligned q or not."""
    if not _launch.direct_launch_enabled():
        pytest.skip(f"direct launches are off here (triton {_launch.triton.__version__})")
    lens = [1, 700, 3000]
    kv_dtype = torch.bfloat16 if kv == "bf16" else FP8
    cache, table, _ = make_paged_kv(lens, page_size, kv_dtype, seed=11)
    B, n = len(lens), len(lens) * H * 576
    buf = torch.randn(n + 1, device="cuda").to(torch.bfloat16)
    q = (buf[1:] if misaligned else buf[:n]).view(B, H, 576)
    sl = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = torch.tensor([0.3], device="cuda") if kv == "fp8" else 1.0
    ws = mla_decode_workspace(B, H, splits, "cuda") if splits > 1 else None

    def run():
        out = torch.full((B, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        mla_decode(q, cache, table, sl, out, sm_scale=0.07, kv_scale=scale,
                   max_splits=splits, workspace=ws)
        return out

    with monkeypatch.context() as m:
        m.setattr(_launch, "_RT", None)  # every launch through the JIT
        jit = run()
    m = monkeypatch
    m.setattr(decode_mod, "_PLANS", {})
    m.setattr(_launch, "_COMPILED", {})
    counters = {name: _CountJit(getattr(decode_mod, name))
                for name in ("_mla_decode_kernel", "_mla_merge_kernel")}
    for name, counter in counters.items():
        m.setattr(decode_mod, name, counter)
    outs = [run() for _ in range(3)]  # a JIT launch, then two direct ones
    torch.cuda.synchronize()
    assert counters["_mla_decode_kernel"].launches == 1
    assert counters["_mla_merge_kernel"].launches == (1 if splits > 1 else 0)
    assert not torch.isnan(jit.float()).any()
    for out in outs:
        assert torch.equal(out, jit)


@pytest.mark.parametrize("cfg", [
    ExtendConfig(64, 1, 64, 8, 3),  # the default at 64+ heads
    ExtendConfig(64, 1, 32, 8, 2), ExtendConfig(32, 2, 64, 8, 2),
], ids=lambda c: "_".join(str(int(v)) for v in c))
def test_extend_config_variants_large(monkeypatch, cfg):
    monkeypatch.setattr(extend_mod, "_extend_config", lambda num_heads: cfg)
    run_extend_case([0, 100, 1000], [300, 64, 129], 128, 16, torch.bfloat16)
    run_extend_case([513, 0], [1, 200], 128, 1, FP8, kv_scale=0.5, num_splits=3)


@pytest.mark.parametrize("page_size", [1, 32])
def test_decode_fp16_page32(page_size):
    run_decode_case([100, 1500], 32, page_size, torch.float16, q_dtype=torch.float16,
                    max_splits=4)


@pytest.mark.parametrize("H", [16, 128])
def test_extend_large(H):
    run_extend_case([0, 100, 1000], [300, 64, 129], H, 16, torch.bfloat16)
    run_extend_case([513, 0], [1, 200], H, 1, FP8, kv_scale=0.5)


def test_mha_prefill_large():
    run_mha_case([300, 1, 129], [1000, 1, 129], 16, 192, 128, True)
    run_mha_case([257], [300], 8, 128, 128, False)


def _graph(fn):
    """``fn`` captured by the project's one graph runner (two side-stream warm-ups)."""
    return GraphRunner("cuda", warmup=2).capture(fn, GraphMode.FULL)


@pytest.mark.parametrize("H", [16, 128])
@pytest.mark.parametrize("force", [None, 1])
def test_decode_cuda_graph_replay_varied_lengths(H, force):
    """Capture once at one set of lengths, replay with longer and shorter ones and new
    contents: each replay must match the reference (split count decided on device)."""
    B, ps, max_len = 3, 16, 6000
    max_pages = math.ceil(max_len / ps)
    npages = B * max_pages + 4
    cache = torch.empty(npages, ps, 576, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(B, max_pages, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(B, dtype=torch.int32, device="cuda")
    q = torch.empty(B, H, 576, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(B, H, 512, dtype=torch.bfloat16, device="cuda")
    splits = default_max_splits(B, H, max_len, torch.cuda.get_device_properties(0)
                                .multi_processor_count)
    ws = mla_decode_workspace(B, H, splits, "cuda")

    def fill(lens, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        cache.copy_(torch.randn(cache.shape, generator=g, device="cuda").to(cache.dtype))
        perm = torch.randperm(npages, generator=g, device="cuda")[:B * max_pages]
        table.copy_(perm.view(B, max_pages).to(torch.int32))
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=g, device="cuda").to(q.dtype))

    def dense(b, L):
        t = torch.arange(L, device="cuda")
        return cache[table[b, t // ps].long(), t % ps].float()

    fill([1000, 2000, 3000], 0)
    g = _graph(lambda: mla_decode(q, cache, table, seq_lens, out, sm_scale=0.07,
                                  max_splits=splits, workspace=ws, force_num_splits=force))
    for i, lens in enumerate(([6000, 1, 4097], [17, 5999, 256], [300, 300, 300])):
        fill(lens, i + 1)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        ref = torch.stack([ref_mla(q[b:b + 1], dense(b, lens[b]), [lens[b] - 1], 0.07)[0]
                           for b in range(B)])
        assert_close(out, ref)


@pytest.mark.parametrize("splits", [1, 6])
@pytest.mark.parametrize("H", [16, 128])
def test_extend_cuda_graph_replay_varied_lengths(H, splits):
    B, ps, max_ext, max_len = 2, 16, 64, 800
    max_pages = math.ceil(max_len / ps)
    npages = B * max_pages + 4
    cache = torch.empty(npages, ps, 576, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(B, max_pages, dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(B, dtype=torch.int32, device="cuda")
    prefix = torch.zeros(B, dtype=torch.int32, device="cuda")
    qo = torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    q = torch.empty(B * max_ext, H, 576, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(B * max_ext, H, 512, dtype=torch.bfloat16, device="cuda")

    def fill(pre, ext, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        cache.copy_(torch.randn(cache.shape, generator=g, device="cuda").to(cache.dtype))
        perm = torch.randperm(npages, generator=g, device="cuda")[:B * max_pages]
        table.copy_(perm.view(B, max_pages).to(torch.int32))
        prefix.copy_(torch.tensor(pre, dtype=torch.int32))
        seq_lens.copy_(torch.tensor([p + e for p, e in zip(pre, ext)], dtype=torch.int32))
        qo.copy_(torch.tensor([0, ext[0], ext[0] + ext[1]], dtype=torch.int32))
        q.copy_(torch.randn(q.shape, generator=g, device="cuda").to(q.dtype))

    def dense(b, L):
        t = torch.arange(L, device="cuda")
        return cache[table[b, t // ps].long(), t % ps].float()

    fill([10, 20], [5, 6], 0)
    # split-KV: 6 static splits, chunks of >= 64 tokens decided on the device per replay
    ws = mla_extend_workspace(B * max_ext, H, splits, "cuda") if splits > 1 else None
    g = _graph(lambda: mla_extend(q, cache, table, seq_lens, prefix, qo, out, sm_scale=0.07,
                                  max_extend_len=max_ext, num_splits=splits, workspace=ws,
                                  min_chunk=64))
    for i, (pre, ext) in enumerate((([700, 0], [64, 33]), ([0, 3], [1, 64]),
                                    ([100, 500], [17, 2]))):
        fill(pre, ext, i + 1)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        refs, start = [], 0
        for b in range(B):
            L = pre[b] + ext[b]
            refs.append(ref_mla(q[start:start + ext[b]], dense(b, L),
                                [pre[b] + j for j in range(ext[b])], 0.07))
            start += ext[b]
        T = sum(ext)
        assert_close(out[:T], torch.cat(refs))
