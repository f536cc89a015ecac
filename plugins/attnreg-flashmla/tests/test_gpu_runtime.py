"""FlashMLABackend on an sm90 GPU with the real library, as an engine drives it (marker ``gpu``).

Created through the registry (entry point, availability, declaration), run
eagerly and through attnreg's GraphRunner, against a float64 oracle.  The
conformance suite proves the same claims claim by claim; these are the
engine-shaped end-to-end runs.
"""

from __future__ import annotations

import pytest
import torch
from attnreg.registry import DType, ForwardMode
from attnreg.runtime import GraphRunner, MLAConfig, decode_batch, verify_batch
from attnreg.testing.workload import TOLERANCES, round_q

from attnreg_flashmla.declaration import BACKEND_NAME, capture_bytes

pytestmark = pytest.mark.gpu

DEV = "cuda"
SCALE = 192 ** -0.5


def _setup(registry, heads, kv_dtype="bf16", num_pages=400, num_layers=1):
    cfg = MLAConfig(num_heads=heads, page_size=64, kv_dtype=kv_dtype, device=DEV,
                    max_context_len=8192)
    backend = registry.create(BACKEND_NAME, cfg)
    fp8 = kv_dtype == "fp8_e4m3"
    scales = [0.5 / (layer + 1) for layer in range(num_layers)] if fp8 else 1.0
    pool = cfg.make_pool(num_pages, scale=scales, num_layers=num_layers)
    slots = torch.arange(pool.num_slots, dtype=torch.int32, device=DEV)
    for layer in range(num_layers):
        gen = torch.Generator(device=DEV).manual_seed(heads + 1000 * layer)
        rows = torch.randn(pool.num_slots, pool.row_dim, generator=gen, device=DEV)
        pool.write(slots, rows[:, :512], rows[:, 512:], layer_id=layer)
    return backend, pool


def _oracle_with_lse(q, pool, batch, q_compute=None, layer_id=0):
    """float64 (out, lse) over one layer; new tokens causal among themselves."""
    qf = round_q(q, q_compute).double()
    table = batch.page_table.long()
    outs, lses, row = [], [], 0
    for b, (length, new) in enumerate(zip(batch.seq_lens_cpu, batch.extend_lens_cpu)):
        pos = torch.arange(length, device=DEV)
        keys = pool.read_slots(table[b, pos // 64] * 64 + pos % 64, layer_id=layer_id).double()
        scores = torch.einsum("shd,ld->shl", qf[row:row + new], keys) * SCALE
        limit = torch.arange(new, device=DEV)[:, None] + (length - new)
        scores = scores.masked_fill((pos[None, :] > limit)[:, None, :], float("-inf"))
        outs.append(torch.einsum("shl,ld->shd", torch.softmax(scores, -1), keys[:, :512]))
        lses.append(torch.logsumexp(scores, -1))
        row += new
    return torch.cat(outs).float(), torch.cat(lses).float()


def _oracle(q, pool, batch, q_compute=None, layer_id=0):
    return _oracle_with_lse(q, pool, batch, q_compute, layer_id)[0]


def _free(pool, batch):
    pool.free(sorted({p for row in batch.page_table.tolist() for p in row if p}))


def _close(out, want, compute=None):
    # the conformance suite's tolerance: bf16's, or the fp8 kernel's compute dtype's
    tol = TOLERANCES[compute or DType.BF16]
    return bool(((out.float() - want).abs() <= tol.atol + tol.rtol * want.abs()).all())


@pytest.mark.parametrize("heads,kv_dtype", [(16, "bf16"), (128, "bf16"), (16, "fp8_e4m3"),
                                            (128, "fp8_e4m3")])
def test_eager_decode_through_the_registry(registry, heads, kv_dtype):
    backend, pool = _setup(registry, heads, kv_dtype)
    batch = decode_batch(pool, [1, 64, 65, 1000, 4097], shuffle=3)
    q = torch.randn(5, heads, 576, device=DEV).bfloat16()
    out = backend.forward_decode(q, None, None, pool, batch)
    compute = DType.FP8_E4M3 if kv_dtype == "fp8_e4m3" else None
    assert _close(out, _oracle(q, pool, batch, compute), compute)


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
        assert _close(out[:len(lens)], _oracle(real, pool, batch, compute), compute), lens
        assert torch.count_nonzero(out[len(lens):]) == 0, lens
        _free(pool, batch)


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


def _lse_close(lse, want):
    # the conformance suite's LSE tolerance
    return bool(((lse - want).abs() <= 2e-3 + 2e-4 * want.abs()).all())


def test_eager_decode_returns_the_lse_and_a_graph_gives_padding_minus_infinity(registry):
    heads, bs = 128, 8
    backend, pool = _setup(registry, heads)
    batch = decode_batch(pool, [1, 64, 65, 1000, 4097], shuffle=3)
    q = torch.randn(5, heads, 576, device=DEV).bfloat16()
    out, lse = backend.forward_decode(q, None, None, pool, batch, return_lse=True)
    want_out, want_lse = _oracle_with_lse(q, pool, batch)
    assert _close(out, want_out) and _lse_close(lse, want_lse)
    _free(pool, batch)
    backend.init_cuda_graph_state(bs, bs, max_seq_len=8192)
    qg = torch.zeros(bs, heads, 576, dtype=torch.bfloat16, device=DEV)
    og = torch.zeros(bs, heads, 512, dtype=torch.bfloat16, device=DEV)
    lg = torch.zeros(bs, heads, device=DEV)
    backend.init_forward_metadata_capture(bs, bs)
    graph = GraphRunner(DEV).capture(
        lambda: backend.forward_decode(qg, None, None, pool, None, out=og, lse=lg))
    batch = decode_batch(pool, [3000, 2, 700], shuffle=4)
    real = torch.randn(3, heads, 576, device=DEV).bfloat16()
    backend.init_forward_metadata_replay(bs, bs, batch)
    qg[:3].copy_(real)
    graph.replay()
    torch.cuda.synchronize()
    want_out, want_lse = _oracle_with_lse(real, pool, batch)
    assert _close(og[:3], want_out) and _lse_close(lg[:3], want_lse)
    assert (lg[3:] == float("-inf")).all()


@pytest.mark.parametrize("heads,kv_dtype", [(16, "bf16"), (128, "bf16"), (16, "fp8_e4m3"),
                                            (128, "fp8_e4m3")])
@pytest.mark.parametrize("draft", [2, 5, 8])
def test_eager_target_verify_through_the_registry(registry, heads, kv_dtype, draft):
    backend, pool = _setup(registry, heads, kv_dtype)
    batch = verify_batch(pool, [0, 63, 1000, 4090], draft, shuffle=draft)
    q = torch.randn(4 * draft, heads, 576, device=DEV).bfloat16()
    compute = DType.FP8_E4M3 if kv_dtype == "fp8_e4m3" else None
    if compute is None:
        out, lse = backend.forward_extend(q, None, None, pool, batch, return_lse=True)
        want_out, want_lse = _oracle_with_lse(q, pool, batch)
        assert _close(out, want_out) and _lse_close(lse, want_lse)
    else:
        out = backend.forward_extend(q, None, None, pool, batch)
        assert _close(out, _oracle(q, pool, batch, compute), compute)


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3"])
def test_one_verify_graph_replays_other_lengths_and_zeroes_padded_sequences(registry, kv_dtype):
    heads, bs, draft = 16, 8, 4
    backend, pool = _setup(registry, heads, kv_dtype)
    backend.init_cuda_graph_state(bs, bs * draft, max_seq_len=8192)
    q = torch.zeros(bs * draft, heads, 576, dtype=torch.bfloat16, device=DEV)
    out = torch.zeros(bs * draft, heads, 512, dtype=torch.bfloat16, device=DEV)
    backend.init_forward_metadata_capture(bs, bs * draft, forward_mode=ForwardMode.TARGET_VERIFY)
    graph = GraphRunner(DEV).capture(
        lambda: backend.forward_extend(q, None, None, pool, None, out=out))
    compute = DType.FP8_E4M3 if kv_dtype == "fp8_e4m3" else None
    for prefixes in ([8000, 3, 64, 61, 0, 700, 4096, 2], [5, 6000], [1] * 8, [3000] * 5):
        batch = verify_batch(pool, prefixes, draft, shuffle=len(prefixes))
        rows = len(prefixes) * draft
        real = torch.randn(rows, heads, 576, device=DEV).bfloat16()
        backend.init_forward_metadata_replay(bs, bs * draft, batch)
        q[:rows].copy_(real)
        q[rows:].fill_(100.0)  # stale rows of padded sequences
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _close(out[:rows], _oracle(real, pool, batch, compute), compute), prefixes
        assert torch.count_nonzero(out[rows:]) == 0, prefixes
        _free(pool, batch)


def test_one_graph_over_three_layers_of_an_fp8_pool(registry):
    heads, bs, layers = 16, 4, 3
    backend, pool = _setup(registry, heads, "fp8_e4m3", num_layers=layers)
    backend.init_cuda_graph_state(bs, bs, max_seq_len=8192)
    qs = [torch.zeros(bs, heads, 576, dtype=torch.bfloat16, device=DEV) for _ in range(layers)]
    outs = [torch.zeros(bs, heads, 512, dtype=torch.bfloat16, device=DEV)
            for _ in range(layers)]
    backend.init_forward_metadata_capture(bs, bs)

    def step():
        for layer in range(layers):
            backend.forward_decode(qs[layer], None, None, pool, None, out=outs[layer],
                                   layer_id=layer)

    graph = GraphRunner(DEV).capture(step)
    for lens in ([4000, 3, 64, 65], [700, 1]):
        batch = decode_batch(pool, lens, shuffle=len(lens))
        real = [torch.randn(len(lens), heads, 576, device=DEV).bfloat16() for _ in range(layers)]
        backend.init_forward_metadata_replay(bs, bs, batch)
        for layer in range(layers):
            qs[layer][:len(lens)].copy_(real[layer])
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(layers):
            want = _oracle(real[layer], pool, batch, DType.FP8_E4M3, layer_id=layer)
            assert _close(outs[layer][:len(lens)], want, DType.FP8_E4M3), (lens, layer)
        _free(pool, batch)


def test_verify_capture_memory_is_what_the_declaration_estimates(registry):
    heads, bs, draft = 128, 32, 4
    backend, pool = _setup(registry, heads)
    q = torch.zeros(bs * draft, heads, 576, dtype=torch.bfloat16, device=DEV)
    out = torch.zeros(bs * draft, heads, 512, dtype=torch.bfloat16, device=DEV)
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    backend.init_cuda_graph_state(bs, bs * draft, max_seq_len=8192)
    backend.init_forward_metadata_capture(bs, bs * draft, forward_mode=ForwardMode.TARGET_VERIFY)
    GraphRunner(DEV).capture(lambda: backend.forward_extend(q, None, None, pool, None, out=out))
    torch.cuda.synchronize()
    state = backend.graph_state
    measured = torch.cuda.max_memory_allocated() - start - state.base_bytes
    declared = capture_bytes(state.capture_shape)
    assert 0.8 * declared <= measured <= 1.25 * declared, (measured, declared)
