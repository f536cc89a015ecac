"""Log-sum-exp outputs, their merge, and chunked-prefix MHA (``MHA_CHUNKED_KV``)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from attnreg.backends.reference import attention_with_lse
from attnreg.registry import ForwardMethod, GraphMode, UnsupportedError, get_registry
from attnreg.runtime import (
    MLAConfig,
    decode_batch,
    extend_batch,
    merge_attention_states,
)

H = 2


def test_merging_two_key_sets_gives_attention_over_both() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, H, 32, generator=g)
    k, v = torch.randn(10, H, 32, generator=g), torch.randn(10, H, 16, generator=g)
    full, full_lse = attention_with_lse(q, k, v, 0.3, causal=False)
    a, a_lse = attention_with_lse(q, k[:4], v[:4], 0.3, causal=False)
    b, b_lse = attention_with_lse(q, k[4:], v[4:], 0.3, causal=False)
    out, lse = merge_attention_states(a, a_lse, b, b_lse)
    assert torch.allclose(out, full, atol=1e-5) and torch.allclose(lse, full_lse, atol=1e-5)
    # an empty side (-inf) leaves the other unchanged; both empty: 0 and -inf
    none = torch.full_like(a_lse, float("-inf"))
    out, lse = merge_attention_states(a, a_lse, torch.zeros_like(b), none)
    assert torch.allclose(out, a) and torch.equal(lse, a_lse)
    out, lse = merge_attention_states(torch.zeros_like(a), none, torch.zeros_like(b), none)
    assert bool((out == 0).all()) and bool(torch.isinf(lse).all())


def test_the_lse_is_a_natural_log_of_the_scaled_scores() -> None:
    q, k = torch.ones(1, 1, 4), torch.ones(2, 1, 4)
    _, lse = attention_with_lse(q, k, torch.zeros(2, 1, 3), 0.5, causal=False)
    assert lse.item() == pytest.approx(math.log(2 * math.exp(0.5 * 4)))


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_decode_and_extend_return_the_lse_beside_the_output(backend_name: str) -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    reg = get_registry()
    backend, oracle = reg.create(backend_name, cfg), reg.create("reference", cfg)
    pool = cfg.make_pool(12)
    pool.buffer.copy_(torch.randn(pool.buffer.shape).bfloat16())
    step = decode_batch(pool, [9, 40])
    q = torch.randn(2, H, 576).bfloat16()
    plain = backend.forward_decode(q, None, None, pool, step)
    out, lse = backend.forward_decode(q, None, None, pool, step, return_lse=True)
    assert torch.equal(out, plain) and lse.dtype == torch.float32 and lse.shape == (2, H)
    buf = torch.empty(2, H)
    out2, lse2 = backend.forward_decode(q, None, None, pool, step, lse=buf)
    assert lse2 is buf and torch.allclose(buf, lse)
    # the reference's LSE is the definition
    _, want = oracle.forward_decode(q, None, None, pool, step, return_lse=True)
    assert torch.allclose(lse, want, atol=1e-3)
    with pytest.raises(UnsupportedError, match="lse tensor"):
        backend.forward_decode(q, None, None, pool, step, lse=torch.empty(2, H + 1))


def test_an_lse_request_is_refused_where_no_kernel_declares_it() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    reg = get_registry()
    caps = reg.declaration("reference", "cpu")
    no_lse = dataclasses.replace(caps, kernels=tuple(
        dataclasses.replace(k, lse=False) for k in caps.kernels))
    backend = type(reg.create("reference", cfg))(cfg, capabilities=no_lse)
    pool = cfg.make_pool(4)
    step = decode_batch(pool, [3])
    q = torch.zeros(1, H, 576, dtype=torch.bfloat16)
    backend.forward_decode(q, None, None, pool, step)            # without it: fine
    with pytest.raises(UnsupportedError, match="declares an LSE output"):
        backend.forward_decode(q, None, None, pool, step, return_lse=True)


# -- chunked-prefix MHA --------------------------------------------------------------

class Decompress:
    """A fixed projection of cached rows to MHA K / V (an engine's kv_b_proj)."""

    def __init__(self, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.w = torch.randn(576, H * (192 + 128), generator=g) / 24
        self.calls: list[int] = []

    def __call__(self, latent: torch.Tensor, rope: torch.Tensor):  # type: ignore[no-untyped-def]
        self.calls.append(latent.shape[0])
        x = torch.cat([latent, rope], -1).float() @ self.w
        return (x[:, :H * 192].reshape(-1, H, 192).to(latent.dtype),
                x[:, H * 192:].reshape(-1, H, 128).to(latent.dtype))


def _chunked_case(pool, prefixes, extends, seed=0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    batch = extend_batch(pool, prefixes, extends)
    t = batch.num_tokens
    q = torch.randn(t, H, 192, generator=g).bfloat16()
    k = torch.randn(t, H, 192, generator=g).bfloat16()
    v = torch.randn(t, H, 128, generator=g).bfloat16()
    return batch, q, k, v


def _full_mha(pool, batch, q, k, v, decompress):  # type: ignore[no-untyped-def]
    """What chunked-prefix MHA must equal: MHA over the decompressed prefix + new k / v."""
    ks, vs, start = [], [], 0
    for b, (p, e) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
        slots = (batch.page_table[b].long()[torch.arange(p) // pool.page_size] * pool.page_size
                 + torch.arange(p) % pool.page_size).to(torch.int32)
        rows = pool.read_slots(slots, dtype=q.dtype)
        kp, vp = decompress(rows[:, :512], rows[:, 512:])
        ks += [kp, k[start:start + e]]
        vs += [vp, v[start:start + e]]
        start += e
    oracle = get_registry().create("reference", MLAConfig(num_heads=H, page_size=pool.page_size))
    return oracle.forward_extend(q, None, None, None, batch, method="mha", k=torch.cat(ks),
                                 v=torch.cat(vs), return_lse=True)


def test_prefix_chunks_cover_every_prefix_token_once() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    pool = cfg.make_pool(20)
    batch = extend_batch(pool, [20, 0, 45], [3, 2, 1], shuffle=4)
    chunks = batch.prefix_chunks(16, 16)
    assert [c.kv_lens_cpu for c in chunks] == [(16, 0, 16), (4, 0, 16), (0, 0, 13)]
    for b, p in enumerate((20, 0, 45)):
        want = [int(batch.page_table[b, t // 16]) * 16 + t % 16 for t in range(p)]
        got = []
        for c in chunks:
            got += c.slots[c.kv_indptr[b]:c.kv_indptr[b + 1]].tolist()
        assert got == want


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize("chunk", [5, 16, None])
def test_chunked_prefix_mha_equals_mha_over_the_whole_prefix(backend_name: str,
                                                             chunk: int | None) -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    backend = get_registry().create(backend_name, cfg)
    pool = cfg.make_pool(20, num_layers=2)
    for layer in pool.layers:
        layer.buffer.copy_(torch.randn(layer.buffer.shape).bfloat16())
    batch, q, k, v = _chunked_case(pool, [20, 0, 33], [3, 2, 4])
    dec = Decompress()
    backend.init_forward_metadata(batch)
    out, lse = backend.forward_extend(q, None, None, pool, batch, method="mha_chunked_kv",
                                      k=k, v=v, decompress=dec, chunk_tokens=chunk,
                                      return_lse=True, layer_id=1)
    chunks = len(batch.prefix_chunks(chunk or 33, 16))
    assert len(dec.calls) == chunks, "one decompression per prefix chunk"
    pool_l1 = cfg.make_pool(20)
    pool_l1.buffer.copy_(pool.layer(1).buffer)
    want, want_lse = _full_mha(pool_l1, batch, q, k, v, dec)
    assert torch.allclose(out.float(), want.float(), atol=2e-2)
    assert torch.allclose(lse, want_lse, atol=1e-3)


def test_chunked_prefix_mha_is_eager_only_and_needs_its_inputs() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    backend = get_registry().create("triton", cfg)
    pool = cfg.make_pool(20)
    batch, q, k, v = _chunked_case(pool, [20, 4], [3, 2])
    with pytest.raises(UnsupportedError, match="pass pool= and decompress="):
        backend.forward_extend(q, None, None, pool, batch, method="mha_chunked_kv", k=k, v=v)
    with pytest.raises(UnsupportedError, match="decompress returned"):
        backend.forward_extend(q, None, None, pool, batch, method="mha_chunked_kv", k=k, v=v,
                               decompress=lambda lat, rope: (k[:1], v[:1]))
    with pytest.raises(UnsupportedError, match="only the MHA_CHUNKED_KV method"):
        backend.forward_extend(q, None, None, pool, batch, method="mha", k=k, v=v,
                               chunk_tokens=8)
    backend.init_cuda_graph_state(2, 8, max_seq_len=64, graph_modes={"prefill": "breakable"})
    backend.init_forward_metadata_capture(2, 5, batch=batch)
    from attnreg.graph_policy.capture import capturing
    with capturing(GraphMode.BREAKABLE), pytest.raises(UnsupportedError, match="pins mla"):
        backend.forward_extend(q, None, None, pool, None, method=ForwardMethod.MHA_CHUNKED_KV,
                               k=k, v=v, decompress=Decompress())
