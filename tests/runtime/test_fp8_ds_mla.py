"""The ``fp8_ds_mla`` row (656 bytes: 512 e4m3 latent, 4 float32 scales, 64 bf16 rope)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.registry import SparseKVFormat  # noqa: E402
from attnreg.runtime.sparse import pack_fp8_ds_mla, unpack_fp8_ds_mla  # noqa: E402


def rows(n: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    out = torch.randn(n, 576, generator=gen)
    out[:, 128:256] *= 50.0        # tiles of different magnitudes: one scale each
    out[1, :128] = 0.0             # an all-zero tile
    return out


def test_the_row_is_656_bytes_in_the_declared_order() -> None:
    x = rows()
    packed = pack_fp8_ds_mla(x)
    assert packed.dtype == torch.uint8 and packed.shape == (5, SparseKVFormat.FP8_DS_MLA.row_bytes)
    scales = packed[:, 512:528].contiguous().view(torch.float32)
    expected = x[:, :512].reshape(5, 4, 128).abs().amax(-1) / 448.0
    expected[1, 0] = 1.0
    assert torch.equal(scales, expected)
    rope = packed[:, 528:].contiguous().view(torch.bfloat16)
    assert torch.equal(rope, x[:, 512:].to(torch.bfloat16))


def test_unpack_inverts_pack_up_to_e4m3_rounding() -> None:
    x = rows()
    back = unpack_fp8_ds_mla(pack_fp8_ds_mla(x))
    tile_max = x[:, :512].reshape(5, 4, 128).abs().amax(-1, keepdim=True)
    err = (back[:, :512] - x[:, :512]).reshape(5, 4, 128).abs()
    assert bool((err <= tile_max / 448.0 * 16 + 1e-6).all())   # e4m3: 3 mantissa bits
    assert bool((err <= 0.0625 * x[:, :512].reshape(5, 4, 128).abs() + tile_max / 448 / 8).all())
    assert torch.equal(back[1, :128], torch.zeros(128))
    assert torch.equal(back[:, 512:], x[:, 512:].to(torch.bfloat16).float())


def test_a_wrong_scale_block_is_visible() -> None:
    # reading tile 1's values with tile 0's scale (the planted FP8 defect of issue 32)
    x = rows()
    packed = pack_fp8_ds_mla(x)
    swapped = packed.clone()
    swapped[:, 512:516] = packed[:, 516:520]
    assert not torch.allclose(unpack_fp8_ds_mla(swapped)[:, :128], x[:, :128], atol=0.5)
