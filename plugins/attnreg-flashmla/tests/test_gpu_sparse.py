"""The sparse (DSA) kernels on an sm90 GPU with the real library (marker ``gpu``).

Engine-shaped: the backend created through the registry, a pool of DeepSeek-V3.2's
656-byte ``fp8_ds_mla`` rows for the sparse fp8 decode kernel and one of bf16 rows for
the sparse prefill kernel, top-k up to 2048 over sequences of up to 8192 tokens, run
eagerly and replayed from one CUDA graph with other indices each time, against the
float64 sparse oracle (:func:`attnreg.testing.sparse.oracle_sparse`) over the rows as
the pool stores them.  ``scripts/probe_flashmla_sparse.py`` and the conformance suite
(``attnreg conformance --backend flashmla -k sparse``) prove the declared claims.
"""

from __future__ import annotations

import pytest
import torch
from attnreg.registry import DType, Phase, UnsupportedError
from attnreg.runtime import GraphRunner, MLAConfig, decode_batch, extend_batch
from attnreg.testing.batches import BatchSpec
from attnreg.testing.sparse import oracle_sparse
from attnreg.testing.workload import compare

from attnreg_flashmla.declaration import BACKEND_NAME

pytestmark = pytest.mark.gpu

DEV = "cuda"
SCALE = 192 ** -0.5
FORMATS = {"fp8_ds_mla": "fp8_e4m3", "bf16": "bf16"}


def _setup(registry, heads, fmt, num_pages=300):
    cfg = MLAConfig(num_heads=heads, page_size=64, kv_dtype=FORMATS[fmt], device=DEV,
                    max_context_len=8192)
    backend = registry.create(BACKEND_NAME, cfg)
    pool = cfg.make_pool(num_pages, kv_format=fmt if fmt != "bf16" else None)
    # standard normal rows, as the conformance suite's workloads (its tolerance is set
    # for them); each 128-value block still gets its own scale
    gen = torch.Generator(device=DEV).manual_seed(heads)
    rows = torch.randn(pool.num_slots, pool.row_dim, generator=gen, device=DEV)
    slots = torch.arange(pool.num_slots, dtype=torch.int32, device=DEV)
    pool.write(slots, rows[:, :512], rows[:, 512:])
    return backend, pool


def _indices(batch, top_k, seed, *, per_token=False):
    """int32 [rows, top_k]: distinct visible slots of each row's sequence, unsorted, -1
    padded (and scattered) where the sequence is shorter than top_k."""
    gen = torch.Generator().manual_seed(seed)
    table = batch.page_table.cpu().long()
    out = []
    for b, (length, new) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
        for t in range(new if per_token else 1):
            visible = length - new + t + 1 if per_token else length
            pos = torch.randperm(visible, generator=gen)[:top_k]
            row = (table[b, pos // 64] * 64 + pos % 64).tolist()
            row += [-1] * (top_k - len(row))
            out.append([row[i] for i in torch.randperm(top_k, generator=gen).tolist()])
    return torch.tensor(out, dtype=torch.int32, device=DEV)


def _oracle(q, pool, indices):
    used = sorted({int(s) for s in indices.flatten().tolist() if s != -1})
    rows = pool.read_slots(torch.tensor(used, device=DEV)).double().cpu()
    slot_rows = dict(zip(used, rows))
    return oracle_sparse(q, slot_rows, indices.cpu(), 512, SCALE)


def _problem(out, want, what):
    """The conformance suite's comparison (bf16 q: its bf16 tolerance), or None."""
    spec = BatchSpec(what, Phase.DECODE, tuple((0, 1) for _ in range(out.shape[0])), what)
    return compare(out, want.float(), DType.BF16, spec)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("top_k", [128, 2048])
def test_eager_sparse_decode(registry, fmt, heads, top_k):
    backend, pool = _setup(registry, heads, fmt)
    batch = decode_batch(pool, [3000, 65, 8000, 2048], shuffle=heads + top_k)
    q = torch.randn(4, heads, 576, device=DEV).bfloat16()
    idx = _indices(batch, top_k, seed=top_k)
    idx[2] = -1                                   # a row with no key
    out = backend.forward_sparse(q, None, None, pool, batch, topk_indices=idx)
    want, _ = _oracle(q, pool, idx)
    assert _problem(out, want, f"{fmt} decode top-k {top_k}") is None
    assert bool((out[2] == 0).all())


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
@pytest.mark.parametrize("heads", [64, 128])
def test_eager_sparse_prefill(registry, fmt, heads):
    backend, pool = _setup(registry, heads, fmt)
    batch = extend_batch(pool, [1000, 0, 4000], [7, 130, 3], shuffle=heads)
    q = torch.randn(batch.num_tokens, heads, 576, device=DEV).bfloat16()
    idx = _indices(batch, 128, seed=heads, per_token=True)
    kernel_lse = fmt == "bf16"                     # the prefill kernel declares its LSE
    result = backend.forward_sparse(q, None, None, pool, batch, topk_indices=idx,
                                    return_lse=kernel_lse)
    out = result[0] if kernel_lse else result
    want, want_lse = _oracle(q, pool, idx)
    assert _problem(out, want, f"{fmt} extend") is None
    if kernel_lse:
        assert torch.allclose(result[1].cpu(), want_lse.float(), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["fp8_ds_mla", "bf16"])
def test_one_decode_graph_replays_other_indices_and_zeroes_padding(registry, fmt):
    heads, bs, top_k = 64, 8, 2048
    backend, pool = _setup(registry, heads, fmt)
    backend.init_cuda_graph_state(bs, bs, max_seq_len=8192, sparse=True)
    q = torch.zeros(bs, heads, 576, dtype=torch.bfloat16, device=DEV)
    out = torch.zeros(bs, heads, 512, dtype=torch.bfloat16, device=DEV)
    idx = torch.full((bs, top_k), -1, dtype=torch.int32, device=DEV)
    backend.init_forward_metadata_capture(bs, bs)
    graph = GraphRunner(DEV).capture(
        lambda: backend.forward_sparse(q, None, None, pool, None, out=out, topk_indices=idx))
    for i, lens in enumerate(([8000, 3, 64, 65, 1, 700, 4096, 2], [5, 6000], [3000] * 5)):
        batch = decode_batch(pool, lens, shuffle=len(lens))
        real = torch.randn(len(lens), heads, 576, device=DEV).bfloat16()
        rows = _indices(batch, top_k, seed=i)
        backend.init_forward_metadata_replay(bs, bs, batch)
        q[:len(lens)].copy_(real)
        q[len(lens):].fill_(100.0)                # stale rows of padding
        idx.fill_(-1)
        idx[:len(lens)].copy_(rows)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, _ = _oracle(real, pool, rows)
        assert _problem(out[:len(lens)], want, f"{fmt} replay {lens}") is None
        assert bool((out[len(lens):] == 0).all()), lens
        pool.free(sorted({p for row in batch.page_table.tolist() for p in row if p}))


def test_an_index_past_the_pool_never_reaches_the_kernel(registry):
    backend, pool = _setup(registry, 64, "fp8_ds_mla")
    batch = decode_batch(pool, [100, 200])
    idx = _indices(batch, 64, seed=1)
    idx[1, 5] = pool.num_slots                    # FlashMLA would read out of bounds
    with pytest.raises(UnsupportedError, match=f"top-k index {pool.num_slots}"):
        backend.forward_sparse(torch.randn(2, 64, 576, device=DEV).bfloat16(), None, None,
                               pool, batch, topk_indices=idx)


def test_a_top_k_the_bf16_kernel_does_not_take_is_refused_before_the_call(registry):
    # the sm90 prefill kernel asserts topk % 128 == 0: 64 is refused first, the fp8 one runs it
    backend, pool = _setup(registry, 64, "bf16")
    batch = decode_batch(pool, [100, 200])
    idx = _indices(batch, 64, seed=2)
    with pytest.raises(UnsupportedError, match="top-k 64 not in multiples of 128"):
        backend.forward_sparse(torch.randn(2, 64, 576, device=DEV).bfloat16(), None, None,
                               pool, batch, topk_indices=idx)
    fp8, fp8_pool = _setup(registry, 64, "fp8_ds_mla")
    batch = decode_batch(fp8_pool, [100, 200])
    q = torch.randn(2, 64, 576, device=DEV).bfloat16()
    idx = _indices(batch, 64, seed=2)
    out = fp8.forward_sparse(q, None, None, fp8_pool, batch, topk_indices=idx)
    assert _problem(out, _oracle(q, fp8_pool, idx)[0], "fp8 top-k 64") is None
