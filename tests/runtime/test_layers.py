"""One pool for every layer: per-layer buffers and FP8 scales, ``layer_id`` on every
forward, one plan per step shared by all layers, and pools over an engine's buffers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnreg.backends.declarations.triton_sizing import decode_rounds_q
from attnreg.registry import ForwardMethod, UnsupportedError, get_registry
from attnreg.runtime import (
    ForwardBatch,
    GraphRunner,
    MLAConfig,
    MLAKVPool,
    decode_batch,
    extend_batch,
)
from attnreg.testing.kv_canary import Canary
from attnreg.testing.workload import round_q

H = 2


def rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 512, generator=g).bfloat16(), torch.randn(n, 64, generator=g).bfloat16()


def i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def test_layers_have_their_own_buffers_and_fp8_scales() -> None:
    pool = MLAKVPool(6, 16, num_layers=3, kv_dtype="fp8_e4m3", scale=[0.5, 0.25, 1.0])
    assert pool.scales == (0.5, 0.25, 1.0)
    assert len({b.data_ptr() for b in pool.buffers}) == 3
    assert [float(layer.scale_tensor) for layer in pool.layers] == [0.5, 0.25, 1.0]
    latent, rope = rows(2, 0)
    slots = i32([16, 17])
    for layer_id in range(3):
        pool.write(slots, latent * (layer_id + 1), rope, layer_id=layer_id)
    for layer_id in range(3):
        layer = pool.layer(layer_id)
        want = layer.quantize_roundtrip(torch.cat([latent * (layer_id + 1), rope], -1).float())
        assert torch.equal(pool.read_slots(slots, layer_id=layer_id), want)
        raw = layer.buffer.view(-1, 576)[16].float()
        assert torch.equal(raw * layer.scale, want[0]), "each layer dequantises by its scale"
    # layer 0 is what the one-layer names read
    assert pool.buffer is pool.layer(0).buffer and pool.kv_scale == 0.5


def test_a_float_scale_applies_to_every_layer_and_a_list_must_match() -> None:
    assert MLAKVPool(4, 1, num_layers=2, kv_dtype="fp8_e4m3", scale=0.5).scales == (0.5, 0.5)
    with pytest.raises(ValueError, match="2 values for 3 layers"):
        MLAKVPool(4, 1, num_layers=3, kv_dtype="fp8_e4m3", scale=[0.5, 0.5])
    with pytest.raises(ValueError, match="layer 1: scale must be a positive finite"):
        MLAKVPool(4, 1, num_layers=2, kv_dtype="fp8_e4m3", scale=[0.5, 0.0])


def test_set_scale_updates_the_device_tensor_in_place() -> None:
    pool = MLAKVPool(4, 1, num_layers=2, kv_dtype="fp8_e4m3")
    tensor = pool.layer(1).scale_tensor
    pool.layer(1).set_scale(0.125)
    assert pool.scales == (1.0, 0.125) and tensor is pool.layer(1).scale_tensor
    assert float(tensor) == 0.125, "a graph that captured the tensor reads the new scale"


def test_writes_and_reads_of_an_fp8_layer_use_its_device_scale() -> None:
    """The pool's own KV write runs inside captured graphs: it must read the scale from
    ``scale_tensor`` (read at every replay), not the host float (frozen at capture), or a
    ``set_scale`` after capture leaves the graph's writes at the old scale.  Here the host
    float is made wrong on purpose: every result must follow the tensor."""
    pool = MLAKVPool(4, 16, kv_dtype="fp8_e4m3", scale=0.5)
    layer = pool.layer(0)
    layer.scale = 99.0  # not what set_scale does: only the host copy, made wrong
    latent, rope = rows(3, 1)
    slots = i32([16, 17, 18])
    layer.write(slots, latent, rope)
    x = torch.cat([latent, rope], -1).float()
    stored = (x / 0.5).to(torch.float8_e4m3fn)
    assert torch.equal(layer.buffer.view(-1, 576)[16:19], stored)
    assert torch.equal(layer.read_slots(slots), stored.float() * 0.5)
    assert torch.equal(layer.dequantized().view(-1, 576)[16:19], stored.float() * 0.5)
    assert torch.equal(layer.quantize_roundtrip(x), stored.float() * 0.5)


@pytest.mark.parametrize("scale", [0.5, 0.0123, 3.7])
def test_quantize_roundtrip_is_what_a_write_then_a_read_gives(scale: float) -> None:
    """Bit for bit at any scale (the suite's oracle and integrity checks rely on it), not
    only at powers of two."""
    pool = MLAKVPool(4, 16, kv_dtype="fp8_e4m3", scale=scale)
    latent, rope = rows(16, 2)
    slots = i32(list(range(16, 32)))
    pool.write(slots, latent, rope)
    want = pool.layer(0).quantize_roundtrip(torch.cat([latent, rope], -1))
    assert torch.equal(pool.read_slots(slots), want)


@pytest.mark.gpu
def test_a_captured_kv_write_reads_a_scale_set_after_capture() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (none detected)")
    pool = MLAKVPool(4, 16, kv_dtype="fp8_e4m3", scale=0.5, device="cuda")
    layer = pool.layer(0)
    latent, rope = (t.cuda() for t in rows(4, 3))
    slots = i32([16, 17, 18, 19]).cuda()
    graph = GraphRunner("cuda").capture(lambda: layer.write(slots, latent, rope))
    layer.set_scale(2.0)
    graph.replay()
    torch.cuda.synchronize()
    x = torch.cat([latent, rope], -1).float()
    assert torch.equal(layer.read_slots(slots), layer.quantize_roundtrip(x)), \
        "the replayed write quantised with the scale of capture time"


def test_unknown_layers_are_refused_with_the_range() -> None:
    pool = MLAKVPool(4, 16, num_layers=2)
    with pytest.raises(IndexError, match=r"layer_id 2 is not a layer of this pool \(0..1\)"):
        pool.layer(2)
    cfg = MLAConfig(num_heads=H, page_size=16)
    backend = get_registry().create("reference", cfg)
    batch = decode_batch(pool, [3])
    q = torch.zeros(1, H, 576, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="layer_id 5"):
        backend.forward_decode(q, None, None, pool, batch, layer_id=5)


def test_canaries_cover_every_layer() -> None:
    pool = MLAKVPool(4, 16, num_layers=2)
    canary = Canary.fill(pool)
    pool.layer(1).buffer.view(-1, 576)[33] = 0.0
    assert canary.corrupted_slots() == [33]
    assert canary.corrupted_slots(layer_id=0) == []
    assert canary.corrupted_slots([33]) == []


def test_wrap_views_an_engines_per_layer_buffers_without_copying() -> None:
    # sglang's MLATokenToKVPool: one [num_slots, 1, 576] tensor per layer, slot 0 padding
    page_size, slots = 16, 16 * 5
    engine = [torch.zeros(slots, 1, 576, dtype=torch.bfloat16) for _ in range(3)]
    pool = MLAKVPool.wrap(engine, page_size, scale=1.0)
    assert (pool.num_layers, pool.num_pages, pool.page_size) == (3, 5, 16)
    latent, rope = rows(1, 1)
    pool.write(i32([40]), latent, rope, layer_id=2)
    assert torch.equal(engine[2][40, 0, :512], latent[0]), "the pool writes the engine's tensor"
    assert pool.buffers[2].data_ptr() == engine[2].data_ptr()


def test_wrap_takes_uint8_fp8_storage_and_refuses_what_does_not_fit() -> None:
    fp8 = [torch.zeros(32, 576, dtype=torch.uint8) for _ in range(2)]
    pool = MLAKVPool.wrap(fp8, 16, kv_dtype="fp8_e4m3", scale=[0.5, 2.0])
    assert pool.dtype == torch.float8_e4m3fn and pool.scales == (0.5, 2.0)
    with pytest.raises(ValueError, match="cannot tell the KV dtype"):
        MLAKVPool.wrap(fp8, 16)
    with pytest.raises(ValueError, match="not a whole number of pages"):
        MLAKVPool.wrap([torch.zeros(20, 576, dtype=torch.bfloat16)], 16)
    bad = [torch.zeros(32, 576, dtype=torch.bfloat16), torch.zeros(32, 576, dtype=torch.float16)]
    with pytest.raises(ValueError, match="buffer of layer 1: dtype torch.float16"):
        MLAKVPool.wrap(bad, 16)


def test_batch_from_an_engines_token_table() -> None:
    pool = MLAKVPool(10, 16)
    pages = pool.allocate([20, 40])
    built = extend_batch(pool, [12, 30], [8, 10], pages=pages)
    token_table = torch.zeros(2, 48, dtype=torch.int64)   # sglang's req_to_token rows
    for b, owned in enumerate(pages):
        token_table[b, :len(owned) * 16] = torch.tensor(pool.slots(owned, range(len(owned) * 16)))
    loc = built.out_cache_loc.long()
    batch = ForwardBatch.from_token_table("extend", [12, 30], [8, 10], token_table, loc, 16)
    assert torch.equal(batch.page_table[:, :3], built.page_table)
    assert batch.out_cache_loc.dtype == torch.int32
    assert torch.equal(batch.out_cache_loc, built.out_cache_loc)


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
def test_one_plan_per_step_serves_every_layer(backend_name: str) -> None:
    cfg = MLAConfig(num_heads=H, page_size=16, kv_dtype="fp8_e4m3")
    reg = get_registry()
    backend = reg.create(backend_name, cfg)
    oracle = reg.create("reference", cfg)
    pool = cfg.make_pool(12, num_layers=3, scale=[0.5, 0.25, 1.0])
    for layer in pool.layers:
        layer.buffer.copy_(torch.randn(layer.buffer.shape).to(layer.buffer.dtype))
    step = decode_batch(pool, [40, 3, 90])
    q = torch.randn(3, H, 576).bfloat16()
    backend.init_forward_metadata(step)
    planned = backend.forward_metadata
    outs = [backend.forward_decode(q, None, None, pool, step, layer_id=i) for i in range(3)]
    assert backend.forward_metadata is planned, "the layers reused the step's plan"
    # triton's decode over an fp8 cache computes with q rounded per head row (declared)
    rounded = backend_name == "triton" and decode_rounds_q(H, cfg.kv_dtype)
    q_ref = round_q(q, "fp8_e4m3", "row") if rounded else q
    for i, out in enumerate(outs):
        want = oracle.forward_decode(q_ref, None, None, pool, step, layer_id=i)
        assert torch.allclose(out.float(), want.float(), atol=2e-2), f"layer {i}"
    assert not torch.allclose(outs[0].float(), outs[1].float(), atol=2e-2)


def test_new_rows_go_to_the_forwarded_layer_only() -> None:
    cfg = MLAConfig(num_heads=H, page_size=16)
    backend = get_registry().create("reference", cfg)
    pool = cfg.make_pool(6, num_layers=2)
    canary = Canary.fill(pool)
    batch = extend_batch(pool, [0], [3])
    latent, rope = rows(3, 2)
    q = torch.randn(3, H, 576).bfloat16()
    backend.forward_extend(q, latent, rope, pool, batch, method=ForwardMethod.MLA, layer_id=1)
    assert canary.corrupted_slots(batch.out_cache_loc, layer_id=1) == []
    assert canary.corrupted_slots(layer_id=0) == [], "layer 0 was not written"
    held = pool.read_slots(batch.out_cache_loc, layer_id=1)
    assert torch.equal(held, torch.cat([latent, rope], -1).float())


def test_a_third_party_hook_reads_the_layer_through_the_pool_argument() -> None:
    # The hooks receive the layer view: code written against pool.buffer / pool.kv_scale
    # reads the forwarded layer without knowing about layers.
    cfg = MLAConfig(num_heads=H, page_size=16)
    reg = get_registry()
    caps = dataclasses.replace(reg.declaration("reference", "cpu"))
    seen = []
    ref_cls = type(reg.create("reference", cfg))

    class Spy(ref_cls):  # type: ignore[misc, valid-type]
        def _forward_decode_impl(self, q, pool, md, out, **kw):  # type: ignore[no-untyped-def]
            seen.append(pool.buffer.data_ptr())
            super()._forward_decode_impl(q, pool, md, out, **kw)

    spy = Spy(cfg, capabilities=caps)
    pool = cfg.make_pool(6, num_layers=2)
    batch = decode_batch(pool, [5])
    q = torch.zeros(1, H, 576, dtype=torch.bfloat16)
    spy.forward_decode(q, None, None, pool, batch, layer_id=1)
    assert seen == [pool.layer(1).buffer.data_ptr()]
