"""FlashMLABackend on an sm90 GPU with the real library, as an engine drives it (marker ``gpu``).

Created through the registry (entry point, availability, declaration), run
eagerly and through attnreg's GraphRunner, against a float64 oracle.  The
conformance suite proves the same claims claim by claim; these are the
engine-shaped end-to-end runs.
"""

from __future__ import annotations

import pytest
import torch
from attnreg.registry import DType
from attnreg.runtime import GraphRunner, MLAConfig, decode_batch
from attnreg.testing.workload import round_q

from attnreg_flashmla.declaration import BACKEND_NAME, capture_bytes

pytestmark = pytest.mark.gpu

DEV = "cuda"
SCALE = 192 ** -0.5


def _setup(registry, heads, kv_dtype="bf16", num_pages=400):
    cfg = MLAConfig(num_heads=heads, page_size=64, kv_dtype=kv_dtype, device=DEV,
                    max_context_len=8192)
    backend = registry.create(BACKEND_NAME, cfg)
    pool = cfg.make_pool(num_pages, scale=0.5 if kv_dtype == "fp8_e4m3" else 1.0)
    gen = torch.Generator(device=DEV).manual_seed(heads)
    rows = torch.randn(pool.num_slots, pool.row_dim, generator=gen, device=DEV)
    pool.write(torch.arange(pool.num_slots, dtype=torch.int32, device=DEV),
               rows[:, :512], rows[:, 512:])
    return backend, pool


def _oracle(q, pool, batch, q_compute=None):
    qf = round_q(q, q_compute).double()
    table = batch.page_table.long()
    outs = []
    for b, length in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(length, device=DEV)
        keys = pool.read_slots(table[b, pos // 64] * 64 + pos % 64).double()
        scores = torch.einsum("hd,ld->hl", qf[b], keys) * SCALE
        outs.append(torch.einsum("hl,ld->hd", torch.softmax(scores, -1), keys[:, :512]))
    return torch.stack(outs).float()


def _close(out, want):
    # the conformance suite's bf16 tolerance: atol 2e-2 + rtol 2e-2
    return bool(((out.float() - want).abs() <= 2e-2 + 2e-2 * want.abs()).all())


@pytest.mark.parametrize("heads,kv_dtype", [(16, "bf16"), (128, "bf16"), (16, "fp8_e4m3"),
                                            (128, "fp8_e4m3")])
def test_eager_decode_through_the_registry(registry, heads, kv_dtype):
    backend, pool = _setup(registry, heads, kv_dtype)
    batch = decode_batch(pool, [1, 64, 65, 1000, 4097], shuffle=3)
    q = torch.randn(5, heads, 576, device=DEV).bfloat16()
    out = backend.forward_decode(q, None, None, pool, batch)
    compute = DType.FP8_E4M3 if kv_dtype == "fp8_e4m3" else None
    assert _close(out, _oracle(q, pool, batch, compute))


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_one_graph_replays_other_lengths_and_zeroes_padding(registry, kv_dtype):
    heads, bs = 16, 8
    backend, pool = _setup(registry, heads, kv_dtype)
    backend.init_cuda_graph_state(bs, bs, max_seq_len=8192)
    q = torch.zeros(bs, heads, 576, dtype=torch.bfloat16, device=DEV)
    out = torch.zeros(bs, heads, 512, dtype=torch.bfloat16, device=DEV)
    backend.init_forward_metadata_capture(bs, bs)
    graph = GraphRunner(DEV).capture(
        lambda: backend.forward_decode(q, None, None, pool, None, out=out))
    compute = DType.FP8_E4M3 if kv_dtype == "fp8_e4m3" else None
    for lens in ([8000, 3, 64, 65, 1, 700, 4096, 2], [5, 6000], [1] * 8, [3000] * 5):
        batch = decode_batch(pool, lens, shuffle=len(lens))
        real = torch.randn(len(lens), heads, 576, device=DEV).bfloat16()
        backend.init_forward_metadata_replay(bs, bs, batch)
        q[:len(lens)].copy_(real)
        q[len(lens):].fill_(100.0)  # stale rows of padding
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _close(out[:len(lens)], _oracle(real, pool, batch, compute)), lens
        assert torch.count_nonzero(out[len(lens):]) == 0, lens
        pool.free(sorted({p for row in batch.page_table.tolist() for p in row if p}))


def test_capture_memory_is_what_the_declaration_estimates(registry):
    heads, bs = 128, 64
    backend, pool = _setup(registry, heads)
    q = torch.zeros(bs, heads, 576, dtype=torch.bfloat16, device=DEV)
    out = torch.zeros(bs, heads, 512, dtype=torch.bfloat16, device=DEV)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    backend.init_cuda_graph_state(bs, bs, max_seq_len=8192)
    backend.init_forward_metadata_capture(bs, bs)
    GraphRunner(DEV).capture(lambda: backend.forward_decode(q, None, None, pool, None, out=out))
    torch.cuda.synchronize()
    state = backend.graph_state
    measured = torch.cuda.max_memory_allocated() - start - state.base_bytes
    declared = capture_bytes(state.capture_shape)
    assert 0.8 * declared <= measured <= 1.25 * declared, (measured, declared)
