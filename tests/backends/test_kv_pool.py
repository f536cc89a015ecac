"""MLAKVPool: slot layout, writes, fp8 quantisation, page bookkeeping, canaries;
and the batch builders' index tensors."""

from __future__ import annotations

import pytest
import torch

from attnreg.registry import ForwardMode, UnsupportedError
from attnreg.runtime import (
    FP8_E4M3_MAX,
    PADDING_PAGE,
    ForwardBatch,
    MLAKVPool,
    decode_batch,
    extend_batch,
)
from attnreg.testing.kv_canary import Canary


def rows(n: int, seed: int = 0, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, 512, generator=gen) * scale).bfloat16(), \
        (torch.randn(n, 64, generator=gen) * scale).bfloat16()


def i32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize("page_size", [1, 16, 32, 64])
def test_write_puts_each_token_at_its_page_and_row(page_size: int) -> None:
    pool = MLAKVPool(8, page_size)
    pages = pool.allocate([page_size * 2 + 3], shuffle=3)[0]
    positions = list(range(page_size * 2 + 3))
    latent, rope = rows(len(positions))
    pool.write(i32(pool.slots(pages, positions)), latent, rope)
    for t in positions:
        page, row = pages[t // page_size], t % page_size
        assert torch.equal(pool.buffer[page, row, :512], latent[t])
        assert torch.equal(pool.buffer[page, row, 512:], rope[t])


@pytest.mark.parametrize("kv_dtype,torch_dtype", [("bf16", torch.bfloat16),
                                                   ("fp16", torch.float16),
                                                   ("fp32", torch.float32)])
def test_half_pools_store_values_unscaled(kv_dtype: str, torch_dtype: torch.dtype) -> None:
    pool = MLAKVPool(4, 16, kv_dtype=kv_dtype)
    assert pool.buffer.shape == (4, 16, 576) and pool.buffer.dtype == torch_dtype
    latent, rope = rows(5)
    slots = i32([17, 18, 19, 40, 63])
    pool.write(slots, latent, rope)
    want = torch.cat([latent, rope], dim=-1).to(torch_dtype).float()
    assert torch.equal(pool.read_slots(slots), want)
    assert torch.equal(pool.dequantized().view(64, 576)[slots.long()], want)


def test_fp8_pool_quantises_with_its_scale_and_saturates() -> None:
    scale = 0.01
    pool = MLAKVPool(4, 16, kv_dtype="fp8_e4m3", scale=scale)
    assert pool.buffer.dtype == torch.float8_e4m3fn
    latent, rope = rows(4, scale=2.0)
    latent[0, 0] = 1000.0  # 1e5 after scaling: far beyond e4m3's 448
    slots = i32([16, 17, 18, 19])
    pool.write(slots, latent, rope)
    back = pool.read_slots(slots)
    assert torch.isfinite(back).all(), "overflow must saturate, not become NaN"
    assert back[0, 0].item() == pytest.approx(FP8_E4M3_MAX * scale)
    exact = torch.cat([latent, rope], dim=-1).float()
    ok = exact.abs() < FP8_E4M3_MAX * scale
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values; subnormals
    # (below 2^-6 * scale) have an absolute error <= 2^-10 * scale.
    err = (back - exact).abs()
    bound = torch.maximum(exact.abs() * 2 ** -4, torch.full_like(exact, 2 ** -10 * scale))
    assert bool((err[ok] <= bound[ok] * 1.0001).all())
    assert torch.equal(back, pool.quantize_roundtrip(exact))
    raw = pool.buffer.view(64, 576)[16].float()
    assert torch.equal(raw * scale, back[0]), "dequantised = stored * scale"


def test_scale_is_only_for_fp8_and_must_be_positive() -> None:
    with pytest.raises(ValueError, match="only meaningful for an fp8 pool"):
        MLAKVPool(4, 1, kv_dtype="bf16", scale=0.5)
    with pytest.raises(ValueError, match="positive finite"):
        MLAKVPool(4, 1, kv_dtype="fp8_e4m3", scale=0.0)


def test_write_refuses_int64_slots_and_wrong_shapes() -> None:
    pool = MLAKVPool(4, 16)
    latent, rope = rows(2)
    with pytest.raises(UnsupportedError, match="slots must be int32"):
        pool.write(torch.tensor([16, 17]), latent, rope)
    with pytest.raises(UnsupportedError, match=r"latent must be \[N, 512\]"):
        pool.write(i32([16, 17]), latent[:, :500], rope)
    with pytest.raises(UnsupportedError, match=r"rope must be \[N=2, 64\]"):
        pool.write(i32([16, 17]), latent, rope[:1])


def test_page_zero_is_reserved_and_allocation_is_bounded() -> None:
    pool = MLAKVPool(5, 4)
    pages = pool.allocate([4, 5, 3])
    assert all(PADDING_PAGE not in p for p in pages)
    assert [len(p) for p in pages] == [1, 2, 1]
    with pytest.raises(ValueError, match="0 free pages, 1 needed"):
        pool.allocate([1])
    pool.free(pages[1])
    assert len(pool.allocate([8])[0]) == 2
    with pytest.raises(ValueError, match="not an allocatable page.*page 0 is reserved"):
        pool.free([PADDING_PAGE])


def test_free_refuses_double_frees_and_foreign_pages_and_frees_nothing_then() -> None:
    pool = MLAKVPool(10, 1)
    (a, b) = pool.allocate([3, 2])
    assert pool.num_free_pages == 4
    pool.free(a)
    with pytest.raises(ValueError, match="page 1 is already free .double free."):
        pool.free([a[0]])
    with pytest.raises(ValueError, match="page 10 is not an allocatable page"):
        pool.free([b[0], 10])
    with pytest.raises(ValueError, match=f"page {b[0]} is already free"):
        pool.free([b[0], b[0]])  # listed twice in one call
    assert pool.num_free_pages == 7, "a refused free() frees nothing"
    pool.free(b)
    assert pool.num_free_pages == 9


def test_fresh_pools_hand_out_ascending_pages_and_reuse_freed_ones_first() -> None:
    pool = MLAKVPool(12, 1)
    first = pool.allocate([3, 2])
    assert first == [[1, 2, 3], [4, 5]]
    pool.free(first[0])
    assert pool.allocate([3]) == [[1, 2, 3]]
    assert pool.allocate([2]) == [[6, 7]]


def test_shuffled_allocation_is_a_permutation_and_reproducible() -> None:
    a = MLAKVPool(33, 1).allocate([32], shuffle=5)[0]
    b = MLAKVPool(33, 1).allocate([32], shuffle=5)[0]
    assert a == b and sorted(a) == list(range(1, 33)) and a != sorted(a)


def test_page_table_is_int32_and_padded_with_the_padding_page() -> None:
    pool = MLAKVPool(8, 16)
    table = pool.page_table([[3, 5], [7]], width=4)
    assert table.dtype == torch.int32
    assert table.tolist() == [[3, 5, 0, 0], [7, 0, 0, 0]]
    with pytest.raises(ValueError, match="wider than 1"):
        pool.page_table([[3, 5]], width=1)


def test_canaries_flag_only_stray_writes() -> None:
    pool = MLAKVPool(6, 16, kv_dtype="fp8_e4m3", scale=0.05)
    canary = Canary.fill(pool)
    latent, rope = rows(3)
    written = [20, 21, 40]
    pool.write(i32(written), latent, rope)
    assert canary.corrupted_slots(written) == []
    assert canary.corrupted_slots([20, 21]) == [40]
    pool.write(i32([pool.padding_slot]), latent[:1], rope[:1])  # padding page: ignored
    assert canary.corrupted_slots(written) == []
    pool.buffer.view(96, 576)[70, 5] = 0.0  # one stray byte elsewhere
    assert canary.corrupted_slots(torch.tensor(written)) == [70]


def test_the_pool_is_storage_and_an_allocator_only() -> None:
    pool = MLAKVPool(4, 2)
    assert not any(hasattr(pool, name) for name in ("fill_canary", "corrupted_slots"))


@pytest.mark.parametrize(("seq_lens", "needle"), [
    ([-100, 200], r"seq_lens\[0\] is -100, below 0"),
    ([-1], r"seq_lens\[0\] is -1, below 0"),
    ([3, True], r"seq_lens\[1\] is True \(bool\), not an integer"),
    ([2.0], r"seq_lens\[0\] is 2.0 \(float\), not an integer"),
    (["4"], r"seq_lens\[0\] is '4' \(str\), not an integer"),
])
def test_allocate_refuses_negative_and_non_integer_lengths_and_takes_nothing(
        seq_lens: list[object], needle: str) -> None:
    pool = MLAKVPool(num_pages=64, page_size=16, kv_lora_rank=1, rope_dim=1)
    with pytest.raises(ValueError, match=needle):
        pool.allocate(seq_lens)  # type: ignore[arg-type]
    assert pool.num_free_pages == 63
    assert pool.allocate([17]) == [[1, 2]], "a refused allocate left the free list as it was"


@pytest.mark.parametrize(("pages", "needle"), [
    ([3.7], r"pages\[0\] is 3.7 \(float\), not an integer"),
    ([True], r"pages\[0\] is True \(bool\), not an integer"),
    ([2, "1"], r"pages\[1\] is '1' \(str\), not an integer"),
])
def test_free_refuses_non_integer_pages_and_frees_nothing(pages: list[object],
                                                          needle: str) -> None:
    pool = MLAKVPool(8, 4)
    pool.allocate([12])  # pages 1, 2, 3
    with pytest.raises(ValueError, match=needle):
        pool.free(pages)  # type: ignore[arg-type]
    assert pool.num_free_pages == 4
    pool.free([1, 2, 3])  # still owned: nothing was freed by the refused call
    assert pool.num_free_pages == 7


def test_integer_scalars_of_other_types_are_accepted() -> None:
    pool = MLAKVPool(8, 4)
    pages = pool.allocate([torch.tensor(5), 3])
    assert pages == [[1, 2], [3]]
    pool.free([torch.tensor(1)])
    assert pool.num_free_pages == 5


def test_write_accepts_what_slots_returns() -> None:
    pool = MLAKVPool(4, 4, kv_dtype="fp32")
    pages = pool.allocate([6])
    slots = pool.slots(pages[0], range(6))
    latent, rope = rows(6)
    pool.write(slots, latent, rope)
    assert torch.equal(pool.read_slots(i32(slots))[:, :512], latent.float())
    with pytest.raises(ValueError, match=r"slots\[0\] is -1"):
        pool.write([-1] + slots[1:], latent, rope)


def test_decode_batch_writes_the_last_position() -> None:
    pool = MLAKVPool(16, 4)
    batch = decode_batch(pool, [1, 6])
    assert batch.forward_mode is ForwardMode.DECODE
    assert batch.seq_lens.tolist() == [1, 6] and batch.prefix_lens.tolist() == [0, 5]
    assert batch.extend_lens.tolist() == [1, 1] and batch.qo_indptr.tolist() == [0, 1, 2]
    table = batch.page_table.tolist()
    assert batch.out_cache_loc.tolist() == [table[0][0] * 4, table[1][1] * 4 + 1]
    for name in ("seq_lens", "prefix_lens", "extend_lens", "qo_indptr", "kv_indptr",
                 "page_table", "out_cache_loc"):
        assert getattr(batch, name).dtype == torch.int32, name


def test_builders_reject_inconsistent_input() -> None:
    pool = MLAKVPool(16, 4)
    with pytest.raises(ValueError, match="each is >= 1"):
        decode_batch(pool, [0])
    with pytest.raises(ValueError, match="needs 2 pages"):
        extend_batch(pool, [0], [5], pages=[[1]])
    with pytest.raises(ValueError, match="exactly one new token"):
        ForwardBatch.build("decode", [0], [2], pool.page_table([[1]]), [4, 5])
    with pytest.raises(ValueError, match="must list 2 slots"):
        ForwardBatch.build("extend", [0], [2], pool.page_table([[1]]), [4])
