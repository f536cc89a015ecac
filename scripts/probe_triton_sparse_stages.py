"""Probe: the triton sparse decode's pipeline stages (the KV tile's shared buffers).

Usage (a CUDA GPU)::

    PYTHONPATH=src python3 scripts/probe_triton_sparse_stages.py --out sparse_stages.json

Triton 3.6 gives a KV tile that is read into registers (the 16-head kernel's mma.sync
operands) one shared buffer below five stages (offline sm90 compile: 1 x 32 x 512 at the
default two stages, 2 x 32 x 512 at five, 94 KB), so the next tile's gather waits for this
tile's last read.  For 16 / 64 / 128 heads, top-k 2048, page sizes 1 and 64, this times
``mla_sparse_decode`` with the shipped config and with 3 and 5 stages by CUDA-graph
replay with the L2 flushed (``triton.testing.do_bench``, median, us), each output first
checked against the torch reference (``err``, max abs over every row; the output is
filled with NaN first, so a row no program wrote counts as wrong).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: (rows, heads): decode rows of one step at DeepSeek-V3.2's 128 heads over 1 / 8 ranks
SHAPES = ((32, 16), (128, 16), (32, 64), (128, 128), (8, 128))
TOP_K = 2048
SLOTS = 1 << 18


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch

    from attnreg.backends._triton_kernels import sparse_decode as sd
    from attnreg.backends.reference import sparse_attention_with_lse
    from attnreg.runtime import MLAKVPool
    from benchmarks.triton_decode_tuning import bench, graph_of, max_abs_error

    shipped = sd._config
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                command="PYTHONPATH=src python3 scripts/probe_triton_sparse_stages.py "
                        "--out sparse_stages.json")
    rows_out = []
    gen = torch.Generator().manual_seed(0)
    for ps in (1, 64):
        pool = MLAKVPool(SLOTS // ps, ps, device="cuda")
        layer = pool.layer(0)
        layer.buffer.copy_(torch.randn(layer.buffer.shape, generator=gen).to(layer.buffer))
        for rows, heads in SHAPES:
            q = torch.randn(rows, heads, 576, generator=gen).bfloat16().cuda()
            idx = torch.randint(0, layer.num_slots, (rows, TOP_K), generator=gen,
                                dtype=torch.int32).cuda()
            out = torch.empty(rows, heads, 512, dtype=torch.bfloat16, device="cuda")
            ref, _ = sparse_attention_with_lse(q, layer, idx, 0.05)
            bh, bn, warps, stages = shipped(heads)
            for label, st in (("shipped", stages), ("3 stages", 3), ("5 stages", 5)):
                rec = dict(rows=rows, heads=heads, page=ps, top_k=TOP_K, variant=label,
                           cfg=[bh, bn, warps, st])
                sd._config = lambda h, cfg=(bh, bn, warps, st): cfg
                sd._PLANS.clear()
                try:
                    out.fill_(float("nan"))
                    sd.mla_sparse_decode(q, layer.buffer, idx, out, sm_scale=0.05)
                    torch.cuda.synchronize()
                    rec["err"] = max_abs_error(out, ref)
                    rec["us"] = bench(graph_of(lambda: sd.mla_sparse_decode(
                        q, layer.buffer, idx, out, sm_scale=0.05)).replay)
                except Exception as e:  # noqa: BLE001 (a probe records every failure)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                finally:
                    sd._config = shipped
                    sd._PLANS.clear()
                rows_out.append(rec)
                print(f"page {ps:2d} rows {rows:4d} heads {heads:4d} {label:9s} "
                      + (f"{rec['us']:8.1f} us err {rec['err']:.4f}" if "us" in rec
                         else rec["error"]), flush=True)
        torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows_out), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
