"""Tests of the example plugin, as its own repository would run them.

They need the package installed (``pip install -e .``): the first test loads
it through its entry point, exactly as attnreg does in production.
"""

from __future__ import annotations

import pytest
import torch
from attnreg import DeclarationContext, ForwardMethod, Platform, UnsupportedError, load_registry
from attnreg.registry import validate_capabilities
from attnreg.runtime import MLAConfig, decode_batch, extend_batch

from attnreg_example_backend.declaration import BACKEND_NAME, capabilities


@pytest.fixture(scope="module")
def registry():
    # autoload=True and an allowlist: independent of ATTNREG_DISABLE_PLUGIN_AUTOLOAD
    # and of whatever other plugins this environment has.
    return load_registry(autoload=True, allow=["example"])


def test_plugin_registers_through_its_entry_point(registry):
    spec = registry.get(BACKEND_NAME)
    assert (spec.plugin, spec.distribution) == ("example", "attnreg-example-backend")
    assert not [e for e in registry.errors if e.plugin == "example"]


@pytest.mark.parametrize("platform", ["cpu", "cuda:sm90", "cuda:sm100", "rocm:gfx942"])
def test_declaration_is_valid_on_every_platform(platform):
    caps = capabilities(DeclarationContext(Platform.parse(platform)))
    assert validate_capabilities(caps, BACKEND_NAME) == []


def _backends(registry, **config):
    cfg = MLAConfig(**{"num_heads": 16, "page_size": 16, **config})
    return (cfg, registry.create(BACKEND_NAME, cfg, platform="cpu"),
            registry.create("reference", cfg, platform="cpu"))


@pytest.mark.parametrize("page_size,dtype", [(16, "bf16"), (64, "fp16")])
def test_batched_decode_matches_the_reference(registry, page_size, dtype):
    cfg, example, reference = _backends(registry, page_size=page_size, kv_dtype=dtype,
                                        q_dtype=dtype)
    torch.manual_seed(0)
    pool = cfg.make_pool(64)
    pool.buffer.copy_(torch.randn_like(pool.buffer, dtype=torch.float32))
    batch = decode_batch(pool, [1, 37, 130, 16], shuffle=7)
    q = torch.randn(4, 16, 576).to(pool.dtype)
    latent, rope = torch.randn(4, 512).to(pool.dtype), torch.randn(4, 64).to(pool.dtype)
    got = example.forward_decode(q, latent, rope, pool, batch)
    want = reference.forward_decode(q, None, None, pool, batch)  # rows already written
    torch.testing.assert_close(got, want)  # bf16/fp16 tolerances: one rounding


def test_extend_then_decode_sees_the_extended_tokens(registry):
    cfg, example, reference = _backends(registry)
    pool = cfg.make_pool(32)
    torch.manual_seed(1)
    ext = extend_batch(pool, [0, 0], [20, 5])
    q = torch.randn(25, 16, 576, dtype=torch.bfloat16)
    rows = torch.randn(25, 576, dtype=torch.bfloat16)
    out = example.forward_extend(q, rows[:, :512], rows[:, 512:], pool, ext)
    assert out.shape == (25, 16, 512) and torch.isfinite(out.float()).all()
    pages = [[int(p) for p in row if p] for row in ext.page_table.tolist()]
    dec = decode_batch(pool, [21, 6], pages=pages)
    qd = torch.randn(2, 16, 576, dtype=torch.bfloat16)
    new = torch.randn(2, 576, dtype=torch.bfloat16)
    got = example.forward_decode(qd, new[:, :512], new[:, 512:], pool, dec)
    want = reference.forward_decode(qd, None, None, pool, dec)
    torch.testing.assert_close(got, want)  # bf16/fp16 tolerances: one rounding


def test_refuses_what_it_does_not_declare(registry):
    # a page size no kernel declares: refused when the backend is created
    with pytest.raises(UnsupportedError, match=r"page size 32 not in \[16, 64\]"):
        _backends(registry, page_size=32)
    # more heads than declared: refused by the forward, before this backend's code runs
    cfg, example, _ = _backends(registry, num_heads=128)
    pool = cfg.make_pool(8)
    batch = decode_batch(pool, [3])
    q = torch.zeros(1, cfg.num_heads, 576, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match=r"128 heads not in 1\.\.64"):
        example.forward_decode(q, None, None, pool, batch)


def test_refuses_the_mha_method(registry):
    cfg, example, _ = _backends(registry)
    pool = cfg.make_pool(8)
    batch = extend_batch(pool, [0], [4])
    q = torch.zeros(4, 16, 192, dtype=torch.bfloat16)
    kv = torch.zeros(4, 16, 192, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match="no mha kernel"):
        example.forward_extend(q, None, None, pool, batch, method=ForwardMethod.MHA,
                               k=kv, v=kv[..., :128])
