"""Probe: Triton decode configs over fp8 and bf16 caches, variants against the defaults.

Usage (a CUDA GPU)::

    PYTHONPATH=src python3 scripts/probe_triton_fp8_mma.py --out fp8_scores.json

For every P1 shape (benchmarks/triton_decode_tuning.py's SHAPES; with ``--tp-shapes`` also
three 32-head ones, 128 heads over tensor-parallel 4) at page sizes 1 and 64
it times, by CUDA-graph replay with the L2 flushed (``triton.testing.do_bench``, median):
the bf16 cache and the fp8 cache with their page-1 default configs (``decode_config``; at
page 64 the 16-head fp8 default is the ``fp8 s5 c1`` row, its page-1 one the "default") and the
variants of :func:`variants` (stage counts that give the KV tile a second shared buffer,
and eight warps at 16 heads).  Where a config has ``fp8_scores`` the kernel rounds q to
fp8 with one power-of-two scale per head row; each output is checked against a float32
reference with q rounded the same way (``err``, max abs over every sequence; the output is
filled with NaN first, so a row no program wrote counts as wrong) before it is timed.
Kernels are compiled in parallel worker processes first.

Earlier revisions timed other variants: at 72b60ec an fp8 P @ V (V as loaded, or from a
transposed second load) and q split into two fp8 parts, at 9ff9a6d the score dots
heads-major and tokens-major at 16 heads; benchmarks/results/probes/ holds those runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.triton_decode_tuning import (  # noqa: E402
    SHAPES,
    bench,
    compile_report,
    graph_of,
    make_inputs,
    max_abs_error,
    reference,
)

PAGES = (1, 64)
#: 32 heads (128 over tensor-parallel 4, a common deployment; no P1 shape): ``--tp-shapes``
TP_SHAPES = [(128, 4096, 32), (32, 8192, 32), (1, 32768, 32)]


def page1_stage_variants(H: int):
    """``--page1-stages``: the 16-head fp8 kernel at page 1 by pipeline depth.  Its two
    stages make each next tile's page-table reads synchronous loads in the loop (the
    16-bit kernel's three make them cp.async), which a table 8 bytes off a 16-byte
    boundary slowed by 5% (the bisect of ``probe_triton_backend_gap.py``).  Two stages
    take 115,712 bytes of shared memory, about all that two programs per SM leave each,
    so a third may cost the second program: timed with splits for two and for one."""
    import torch

    from attnreg.backends._triton_kernels import decode as dec

    bf16 = dec.decode_config(H, torch.bfloat16)
    fp8 = dec.decode_config(H, torch.float8_e4m3fn)
    return [("bf16 default", "bf16", bf16), ("fp8 default", "fp8", fp8),
            ("fp8 s3 c2", "fp8", fp8._replace(num_stages=3)),
            ("fp8 s3 c1", "fp8", fp8._replace(num_stages=3, ctas_per_sm=1)),
            ("fp8 s4 c1", "fp8", fp8._replace(num_stages=4, ctas_per_sm=1))]


def variants(H: int):
    """(label, kv dtype name, DecodeConfig) of every variant at H heads.

    The question of this revision: how many shared buffers the KV tile gets.  Triton 3.6
    gives a tile that is read into registers (V's conversion, the 16-bit dots' operands)
    one buffer below five stages, so the next tile's copy waits for the last read of this
    one and the load overlaps compute only across programs; at five stages it gets two
    (`ttg.local_alloc` counts from an offline sm90 compile).  Two buffers of an fp8 tile
    fit beside the rest at one program per SM (152-189 KB).
    """
    import torch

    from attnreg.backends._triton_kernels import decode as dec
    from attnreg.backends.declarations.triton_sizing import FP8_SCORES_MIN_HEADS

    bf16 = dec.decode_config(H, torch.bfloat16)
    fp8 = dec.decode_config(H, torch.float8_e4m3fn)
    out = [("bf16 default", "bf16", bf16), ("fp8 default", "fp8", fp8),
           ("fp8 s5 c1", "fp8", fp8._replace(num_stages=5, ctas_per_sm=1))]
    if H <= 16:
        out.append(("bf16 s5 c1", "bf16", bf16._replace(num_stages=5, ctas_per_sm=1)))
        # 8 warps: both warpgroups compute the (small) score tile, P @ V and V's
        # conversion split over twice the threads (201-222 registers, no spill)
        out.append(("fp8 w8 s5 c1", "fp8", fp8._replace(num_warps=8, num_stages=5,
                                                         ctas_per_sm=1)))
    elif H >= FP8_SCORES_MIN_HEADS:
        # a 16-bit tile's two 64-token buffers already fill shared memory (229 KB): three
        # 32-token ones at five stages (188 KB) give it the second tile in flight
        out.append(("bf16 n32 s5", "bf16", bf16._replace(block_n=32, num_stages=5)))
    else:
        # 17-32 heads: one buffer per tile at the default two stages (115 KB, two programs
        # per SM), two at five (189 KB, one program per SM)
        out.append(("bf16 s5 c1", "bf16", bf16._replace(num_stages=5, ctas_per_sm=1)))
    return out


def _dtype(name):
    import torch
    return torch.bfloat16 if name == "bf16" else torch.float8_e4m3fn


def run(q, cache, table, sl, out, cfg, splits, ws):
    from attnreg.backends._triton_kernels import decode as dec
    return dec._mla_decode_impl(q, cache, table, sl, out, sm_scale=0.1, kv_scale=1.0,
                                num_splits=splits, min_chunk=max(cfg.block_n, cfg.min_chunk),
                                workspace=ws, cfg=cfg)


def _compile(job):
    import torch

    from attnreg.backends._triton_kernels import decode as dec
    H, kvn, cfg_t, ps, split = job
    try:
        cfg = dec.DecodeConfig(*cfg_t)
        q, cache, table, sl, out = make_inputs(1, 512, H, page_size=ps, kv_dtype=_dtype(kvn))
        s = 2 if split else 1
        ws = dec.mla_decode_workspace(1, H, s, "cuda") if split else None
        run(q, cache, table, sl, out, cfg, s, ws)
        torch.cuda.synchronize()
        k = dec._LAST_LAUNCH.get("decode")
        return job, (f"ok regs={getattr(k, 'n_regs', '?')} spills={getattr(k, 'n_spills', '?')} "
                     f"smem={getattr(getattr(k, 'metadata', None), 'shared', '?')}")
    except Exception as e:  # noqa: BLE001 (a probe records every failure)
        return job, f"{type(e).__name__}: {str(e)[:300]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--min-heads", type=int, default=1, help="only shapes with >= H heads")
    ap.add_argument("--max-heads", type=int, default=1 << 30, help="only shapes with <= H heads")
    ap.add_argument("--tp-shapes", action="store_true", help="also the 32-head shapes")
    ap.add_argument("--page1-stages", action="store_true",
                    help="16-head shapes, page 1, the fp8 kernel by pipeline depth")
    args = ap.parse_args(argv)
    global SHAPES
    variants_of, pages = (page1_stage_variants, (1,)) if args.page1_stages else (variants, PAGES)
    if args.page1_stages:
        args.max_heads = min(args.max_heads, 16)
    SHAPES = [s for s in SHAPES + (TP_SHAPES if args.tp_shapes else [])
              if args.min_heads <= s[2] <= args.max_heads]
    import torch

    from attnreg.backends._triton_kernels import decode as dec
    from attnreg.registry import DType
    from attnreg.testing.workload import round_q
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                command="PYTHONPATH=src python3 scripts/probe_triton_fp8_mma.py "
                        + " ".join(sys.argv[1:]))
    jobs = set()
    for (_B, _L, H) in SHAPES:
        for _lab, kvn, cfg in variants_of(H):
            for ps in pages:
                for split in (True, False):
                    jobs.add((16 if H <= 16 else 128, kvn, tuple(cfg), ps, split))
    compiled = compile_report(_compile, jobs, args.workers)
    meta["kernels"] = [[list(j), st] for j, st in sorted(compiled.items())]
    rows = []
    for (B, L, H) in SHAPES:
        for ps in pages:
            for lab, kvn, cfg in variants_of(H):
                rec = dict(B=B, L=L, H=H, page=ps, variant=lab, cfg=list(cfg))
                try:
                    q, cache, table, sl, out = make_inputs(B, L, H, page_size=ps,
                                                           kv_dtype=_dtype(kvn))
                    splits = dec.splits_for_config(cfg, B, H, L, num_sms)
                    ws = dec.mla_decode_workspace(B, H, splits, "cuda") if splits > 1 else None
                    out.fill_(float("nan"))
                    run(q, cache, table, sl, out, cfg, splits, ws)
                    torch.cuda.synchronize()
                    qr = round_q(q, DType.FP8_E4M3, "row") if kvn == "fp8" and cfg.fp8_scores else q
                    rec["err"] = max_abs_error(out, reference(qr, cache, table, sl, 0.1))
                    rec["splits"] = splits
                    rec["us"] = bench(graph_of(lambda: run(q, cache, table, sl, out, cfg,
                                                           splits, ws)).replay)
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(rec)
                print(f"B={B:4d} L={L:6d} H={H:4d} p{ps:<3d} {lab:22s} "
                      + (f"{rec['us']:8.1f} us err {rec['err']:.3f}" if "us" in rec
                         else rec.get("error", "")), flush=True)
            torch.cuda.empty_cache()
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
