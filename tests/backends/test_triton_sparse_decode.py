"""mla_sparse_decode (the triton backend's sparse decode) against the torch reference's
sparse path: top-k below / equal to / above the visible tokens, a width that is not a
multiple of the tile, unsorted and repeated slots, -1 entries and an all -1 row; and
through the backend's forward_sparse."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
    pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from attnreg.backends._triton_kernels import mla_sparse_decode  # noqa: E402
from attnreg.backends.reference import sparse_attention_with_lse  # noqa: E402
from attnreg.runtime import MLAKVPool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(page_size: int, slots: int) -> MLAKVPool:
    pool = MLAKVPool(-(-slots // page_size), page_size, device=DEVICE)
    buf = pool.layer(0).buffer
    gen = torch.Generator().manual_seed(page_size)
    buf.copy_(torch.randn(buf.shape, generator=gen).to(buf))
    return pool


def _check(pool: MLAKVPool, idx: torch.Tensor, heads: int) -> None:
    layer = pool.layer(0)
    rows = idx.shape[0]
    gen = torch.Generator().manual_seed(rows * 7 + heads)
    q = torch.randn(rows, heads, 576, generator=gen).bfloat16().to(DEVICE)
    out = torch.full((rows, heads, 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    lse = torch.full((rows, heads), float("nan"), device=DEVICE)
    idx = idx.to(DEVICE)
    mla_sparse_decode(q, layer.buffer, idx, out, sm_scale=0.06, lse=lse)
    ref, ref_lse = sparse_attention_with_lse(q, layer, idx, 0.06)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
    empty = (idx == -1).all(dim=1)
    assert bool((out[empty] == 0).all())
    assert bool(torch.isneginf(lse[empty]).all())


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("top_k", [1, 16, 40])
def test_matches_reference(page_size: int, top_k: int) -> None:
    seq = 24                      # visible tokens: top-k below, near and above it
    pool = _pool(page_size, 64)
    gen = torch.Generator().manual_seed(top_k)
    rows = []
    for r in range(4):
        chosen = torch.randperm(seq, generator=gen)[:top_k].tolist()   # unsorted
        if r == 1 and len(chosen) >= 2:
            chosen[-1] = chosen[0]                                    # a slot twice
        chosen = [s + 3 for s in chosen] + [-1] * (top_k - len(chosen))
        order = torch.randperm(top_k, generator=gen).tolist()           # -1 scattered
        rows.append([chosen[i] for i in order])
    rows.append([-1] * top_k)                                          # no key at all
    _check(pool, torch.tensor(rows, dtype=torch.int32), heads=2)


def test_heads_above_one_block() -> None:
    pool = _pool(16, 64)
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (2, 33), generator=gen, dtype=torch.int32)
    idx[0, ::2] = -1
    _check(pool, idx, heads=20)   # two 16-head blocks, the second masked


def test_top_k_2048() -> None:
    pool = _pool(64, 256)
    gen = torch.Generator().manual_seed(2)
    idx = torch.randint(0, 256, (1, 2048), generator=gen, dtype=torch.int32)
    idx[0, 1000:1100] = -1
    _check(pool, idx, heads=2)


def test_refuses_int64_and_wrong_rows() -> None:
    pool = _pool(16, 32)
    q = torch.zeros(2, 2, 576, dtype=torch.bfloat16, device=DEVICE)
    out = torch.empty(2, 2, 512, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="int32"):
        mla_sparse_decode(q, pool.layer(0).buffer, torch.zeros(2, 4, dtype=torch.int64,
                                                              device=DEVICE), out, sm_scale=1.0)
    with pytest.raises(ValueError, match="indices"):
        mla_sparse_decode(q, pool.layer(0).buffer, torch.zeros(3, 4, dtype=torch.int32,
                                                              device=DEVICE), out, sm_scale=1.0)
