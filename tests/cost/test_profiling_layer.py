"""The MLA layer model: its decode step is the same function as its one-token extend."""

from __future__ import annotations

import pytest

from attnreg.profiling import DRY_LAYER, LayerShape, MLALayer, random_pool, rel_error

torch = pytest.importorskip("torch")


def test_decode_step_matches_a_one_token_absorbed_extend() -> None:
    from attnreg.backends.base import MLAConfig
    from attnreg.backends.batch import decode_batch, extend_batch
    from attnreg.registry import get_registry

    heads, lens = 2, [7, 12]
    cfg = MLAConfig(num_heads=heads, page_size=1, device="cpu", max_context_len=32)
    backend = get_registry().create("reference", cfg, platform="cpu")
    layer = MLALayer(torch, DRY_LAYER, heads, "cpu", seed=3, max_positions=32)
    x = torch.randn(len(lens), DRY_LAYER.hidden, dtype=torch.bfloat16)
    positions = torch.tensor([n - 1 for n in lens])

    def run(step: str) -> torch.Tensor:
        pool = random_pool(torch, cfg, sum(lens), seed=1)  # the same rows for both
        pages = pool.allocate(lens)
        if step == "decode":
            batch = decode_batch(pool, lens, pages=pages)
            backend.init_forward_metadata(batch)
            return layer.forward_decode(x, layer.rope_at(positions), backend, pool, batch)
        batch = extend_batch(pool, [n - 1 for n in lens], [1] * len(lens), pages=pages)
        backend.init_forward_metadata(batch)
        return layer.forward_absorbed(x, positions, backend, pool, batch)

    decode, extend = run("decode"), run("extend")
    assert decode.shape == x.shape
    assert rel_error(torch, decode - x, extend - x) < 2e-2
    assert float((decode - x).abs().max()) > 0.1  # the layer changed x: not a vacuous match


def test_weight_bytes_counts_every_projection_once() -> None:
    s = LayerShape(hidden=8, q_lora=4, kv_lora=2, rope=1, nope=3, v_dim=5)
    heads = 2
    params = 8 * 4 + 4 * heads * (3 + 1) + 8 * (2 + 1) + 2 * heads * (3 + 5) + heads * 5 * 8
    assert s.weight_bytes(heads) == 2 * params
    layer = MLALayer(torch, DRY_LAYER, heads, "cpu", seed=0, max_positions=4)
    read = sum(w.numel() * w.element_size() for w in
               (layer.q_a, layer.q_b, layer.kv_a, layer.kv_b, layer.o))
    assert DRY_LAYER.weight_bytes(heads) == read
