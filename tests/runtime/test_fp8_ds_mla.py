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


# -- a pool of fp8_ds_mla rows ------------------------------------------------------------

def _packed_pool(num_pages: int = 6, page_size: int = 16, **kw):  # type: ignore[no-untyped-def]
    from attnreg.runtime import MLAKVPool

    return MLAKVPool(num_pages, page_size, kv_format="fp8_ds_mla", **kw)


def test_a_packed_pool_stores_656_byte_rows_and_reads_them_unpacked() -> None:
    pool = _packed_pool(num_layers=2)
    layer = pool.layer(1)
    assert pool.buffer.dtype == torch.uint8 and pool.buffer.shape == (6, 16, 656)
    assert (layer.row_format, layer.row_bytes, layer.row_dim) == ("fp8_ds_mla", 656, 576)
    assert pool.kv_dtype.value == "fp8_e4m3" and not pool.is_fp8 and pool.scale == 1.0
    x = rows(5)
    slots = torch.tensor([17, 18, 40, 41, 95], dtype=torch.int32)
    pool.write(slots, x[:, :512], x[:, 512:], layer_id=1)
    # the bytes are pack_fp8_ds_mla's, in the layer written, at those slots only
    flat = layer.buffer.view(-1, 656)
    assert torch.equal(flat[slots.long()], pack_fp8_ds_mla(x))
    assert not bool(pool.layer(0).buffer.any())
    back = pool.read_slots(slots, layer_id=1)
    assert torch.equal(back, unpack_fp8_ds_mla(pack_fp8_ds_mla(x)))
    assert torch.equal(back, pool.quantize_roundtrip(x, layer_id=1))
    assert torch.equal(pool.dequantized(layer_id=1).view(-1, 576)[slots.long()], back)


def test_a_packed_pool_refuses_a_per_layer_scale_and_a_contradicting_dtype() -> None:
    with pytest.raises(ValueError, match="carry their own scales"):
        _packed_pool(scale=0.5)
    with pytest.raises(ValueError, match="contradicts"):
        _packed_pool(kv_dtype="bf16")
    with pytest.raises(ValueError, match="multiple of 128"):
        _packed_pool(kv_lora_rank=200)
    assert _packed_pool(kv_dtype="fp8_e4m3").kv_format is SparseKVFormat.FP8_DS_MLA


def test_wrap_views_an_engines_byte_buffers_without_a_copy() -> None:
    from attnreg.runtime import MLAKVPool

    engine = [torch.zeros(64, 656, dtype=torch.uint8), torch.zeros(64, 656, dtype=torch.uint8)]
    pool = MLAKVPool.wrap(engine, 16, kv_format="fp8_ds_mla")
    assert (pool.num_pages, pool.num_layers) == (4, 2)
    assert pool.layer(1).buffer.data_ptr() == engine[1].data_ptr()
    fp8 = torch.zeros(32, 656, dtype=torch.float8_e4m3fn)       # engines keep fp8 storage too
    assert MLAKVPool.wrap([fp8], 16, kv_format="fp8_ds_mla").buffer.data_ptr() == fp8.data_ptr()
    with pytest.raises(ValueError, match="not a whole number of pages"):
        MLAKVPool.wrap([torch.zeros(65, 656, dtype=torch.uint8)], 16, kv_format="fp8_ds_mla")


def test_the_canary_and_the_ledger_read_packed_rows() -> None:
    from attnreg.testing.integrity import guarded_pool
    from attnreg.testing.kv_canary import Canary

    pool = _packed_pool()
    canary = Canary.fill(pool)
    assert bool(torch.isfinite(pool.dequantized()).all())       # the fill unpacks finite
    assert torch.equal(pool.dequantized()[2, 3], torch.full((576,), -3.0))
    x = rows(2)[:1]
    pool.write([37], x[:, :512], x[:, 512:])
    assert canary.corrupted_slots() == [37] and canary.corrupted_slots([37]) == []

    guarded = guarded_pool(4, 16, num_layers=1, kv_dtype="fp8_e4m3", device="cpu",
                           kv_lora_rank=512, rope_dim=64, scale=1.0, kv_format="fp8_ds_mla")
    assert guarded.buffer.shape == (4, 16, 656)
    assert torch.equal(guarded.dequantized()[1, 1], torch.full((576,), -3.0))


# -- what reads them, and what refuses them ---------------------------------------------------

def _reference(kv_dtype: str = "fp8_e4m3"):  # type: ignore[no-untyped-def]
    from attnreg.registry import get_registry
    from attnreg.runtime import MLAConfig

    config = MLAConfig(num_heads=2, page_size=16, kv_dtype=kv_dtype, device="cpu")
    return get_registry().create("reference", config, platform="cpu"), config


def test_dense_kernels_refuse_packed_rows_before_any_write() -> None:
    from attnreg.registry import UnsupportedError
    from attnreg.runtime import decode_batch, extend_batch

    backend, _ = _reference()
    pool = _packed_pool()
    batch = decode_batch(pool, [5, 9])
    before = pool.buffer.clone()
    q = torch.randn(2, 2, 576)
    with pytest.raises(UnsupportedError, match="dense MLA decode over fp8_ds_mla rows"):
        backend.forward_decode(q, torch.randn(2, 512), torch.randn(2, 64), pool, batch)
    ext = extend_batch(pool, [0], [3])
    with pytest.raises(UnsupportedError, match="dense MLA prefill over fp8_ds_mla rows"):
        backend.forward_extend(torch.randn(3, 2, 576), torch.randn(3, 512), torch.randn(3, 64),
                               pool, ext)
    assert torch.equal(pool.buffer, before)


def test_a_sparse_kernel_reads_only_the_rows_it_declares() -> None:
    from attnreg.registry import UnsupportedError, get_registry

    caps = get_registry().declaration("reference", "cpu")     # sparse over bf16 rows
    assert caps.check_sparse_request("decode", kv_dtype="bf16", kv_format="bf16") == []
    (reason,) = caps.check_sparse_request("decode", kv_dtype="fp8_e4m3",
                                          kv_format="fp8_ds_mla")
    assert "kv dtype fp8_e4m3 is not its bf16 rows' bf16" in reason
    import dataclasses

    from attnreg.registry import SparseKernel

    fp8 = dataclasses.replace(caps, sparse_kernels=(SparseKernel(
        frozenset(caps.sparse_kernels[0].phases), caps.sparse_kernels[0].q_dtypes,
        SparseKVFormat.FP8_DS_MLA, page_sizes=(16,), kernel="fp8 rows"),))
    # a dense fp8 pool has the format's dtype but not its rows
    (reason,) = fp8.check_sparse_request("decode", kv_dtype="fp8_e4m3", kv_format="fp8_e4m3")
    assert "the pool holds fp8_e4m3 rows; the kernel reads fp8_ds_mla rows (656 bytes)" in reason
    assert fp8.check_sparse_request("decode", kv_dtype="fp8_e4m3", kv_format="fp8_ds_mla") == []

    backend, _ = _reference()
    pool = _packed_pool()
    from attnreg.runtime import decode_batch

    batch = decode_batch(pool, [5, 9])
    backend.init_forward_metadata(batch)
    with pytest.raises(UnsupportedError, match="kv dtype fp8_e4m3 is not its bf16 rows"):
        backend.forward_sparse(torch.randn(2, 2, 576), None, None, pool, batch,
                               topk_indices=torch.full((2, 4), -1, dtype=torch.int32))


def test_a_backend_declaring_packed_rows_attends_them_like_the_oracle() -> None:
    import dataclasses

    from attnreg.backends.reference import ReferenceBackend
    from attnreg.registry import DType, ForwardMethod, Phase, SparseKernel, get_registry
    from attnreg.testing.claims import Combo
    from attnreg.testing.integrity import kv_problems
    from attnreg.testing.sparse import SPARSE_CASES, make_sparse_workload
    from attnreg.testing.workload import compare, make_config, make_pool

    caps = get_registry().declaration("reference", "cpu")
    k = caps.sparse_kernels[0]
    fp8 = dataclasses.replace(caps, sparse_kernels=(dataclasses.replace(
        k, kv_format=SparseKVFormat.FP8_DS_MLA, q_dtypes=frozenset({DType.BF16})),))
    assert isinstance(fp8.sparse_kernels[0], SparseKernel)
    for phase in (Phase.DECODE, Phase.PREFILL):
        combo = Combo(ForwardMethod.MLA, phase, DType.BF16, DType.FP8_E4M3, 16, 2, (576, 512))
        config = make_config(combo, "cpu")
        backend = ReferenceBackend(config, capabilities=fp8)
        case = SPARSE_CASES[phase][-1]
        pool = make_pool(config, [case.spec()], kv_format="fp8_ds_mla")
        assert pool.layer(0).row_format == "fp8_ds_mla"
        sw = make_sparse_workload(config, pool, case, seed=9)
        backend.init_forward_metadata(sw.work.batch)
        out = backend.forward_sparse(sw.work.q, sw.work.latent_new, sw.work.rope_new, pool,
                                     sw.work.batch, topk_indices=sw.indices)
        assert compare(out, sw.expected, DType.BF16, sw.spec) is None
        assert kv_problems(pool, [sw.work], "packed") == []
