"""GPU tests of the Triton MLA kernels: larger shapes and CUDA-graph capture / replay.

Skipped without CUDA (see tests/conftest.py).  Same references as the CPU tests.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from attnreg.backends._triton_kernels import (
    default_max_splits,
    mla_decode,
    mla_decode_workspace,
    mla_extend,
    mla_extend_workspace,
)
from attnreg.registry import GraphMode
from attnreg.runtime import GraphRunner

from .test_triton_kernels import (
    FP8,
    assert_close,
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
def test_decode_fp8_large(H):
    run_decode_case([777, 4096], H, 16, FP8, kv_scale=0.25, max_splits=8)


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
