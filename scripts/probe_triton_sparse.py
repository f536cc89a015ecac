"""Probe the triton sparse decode (mla_sparse_decode) on a GPU, against the torch reference:
eager and replayed in a CUDA graph (indices changed between replays), top-k 16 / 40 / 2048,
16 / 64 / 128 heads, page sizes 1 / 64.  Prints one line per case and the worst error."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from attnreg.backends._triton_kernels import mla_sparse_decode  # noqa: E402
from attnreg.backends.reference import sparse_attention_with_lse  # noqa: E402
from attnreg.runtime import MLAKVPool  # noqa: E402


def indices(rows: int, top_k: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    idx = torch.randint(0, slots, (rows, top_k), generator=gen, dtype=torch.int32)
    idx[0, ::3] = -1                 # -1 scattered
    idx[-1] = -1                     # a row of only -1
    if top_k > 1:
        idx[1 % rows, 1] = idx[1 % rows, 0]   # a slot twice
    return idx.cuda()


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    ok = True
    for ps in (1, 64):
        pool = MLAKVPool(64, ps, device="cuda") if ps == 64 else MLAKVPool(4096, 1, device="cuda")
        layer = pool.layer(0)
        layer.buffer.copy_(torch.randn(layer.buffer.shape, generator=gen).to(layer.buffer))
        for heads in (16, 64, 128):
            for top_k in (16, 40, 2048):
                rows = 5
                q = torch.randn(rows, heads, 576, generator=gen).bfloat16().cuda()
                out = torch.empty(rows, heads, 512, dtype=torch.bfloat16, device="cuda")
                lse = torch.empty(rows, heads, device="cuda")
                idx = indices(rows, top_k, layer.num_slots, gen)
                for how in ("eager", "graph"):
                    if how == "graph":
                        static = idx.clone()
                        mla_sparse_decode(q, layer.buffer, static, out, sm_scale=0.05, lse=lse)
                        g = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(g):
                            mla_sparse_decode(q, layer.buffer, static, out, sm_scale=0.05,
                                              lse=lse)
                        idx = indices(rows, top_k, layer.num_slots, gen)   # new indices
                        static.copy_(idx)
                        out.fill_(float("nan"))
                        g.replay()
                    else:
                        mla_sparse_decode(q, layer.buffer, idx, out, sm_scale=0.05, lse=lse)
                    torch.cuda.synchronize()
                    ref, ref_lse = sparse_attention_with_lse(q, layer, idx, 0.05)
                    err = (out.float() - ref).abs().max().item()
                    fin = torch.isfinite(ref_lse)
                    lerr = (lse - ref_lse)[fin].abs().max().item()
                    lse_ok = bool((torch.isinf(lse) == ~fin).all())
                    good = err < 0.05 and lerr < 1e-3 and lse_ok and bool((out[-1] == 0).all())
                    ok &= good
                    worst = max(worst, err)
                    print(f"page {ps} heads {heads} top-k {top_k} {how}: out err {err:.4f} "
                          f"lse err {lerr:.2e} {'ok' if good else 'FAIL'}")
    print("worst", worst, "ALL OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
