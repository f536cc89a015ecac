"""Probe: the Triton decode kernel at 64-128 heads, with Triton's warp specialization and with
one program for all 128 heads (issue 31, item 4: within 1.10x of raw FlashMLA).

Usage (a CUDA GPU)::

    PYTHONPATH=src python3 scripts/probe_triton_wide_heads.py --out wide_heads.json

For every P1 shape with 64+ heads (benchmarks/triton_decode_tuning.py's SHAPES), bf16, page
sizes 1 and 64, it times by CUDA-graph replay with the L2 flushed (``triton.testing.do_bench``,
median, decode + merge):

* ``default``: ``decode_config`` as shipped;
* ``ws``: the same config with the KV tile loop as ``tl.range(..., warp_specialize=True)``
  (Triton partitions the loop into producer (loads) and consumer (MMA, softmax) warps where
  it can); ``ws plain``: the same without ``isolate_qk`` (its ``if`` regions in the loop);
* ``h128 ...``: one program for all 128 heads (``block_h`` 128), so a KV tile crosses from
  L2 into shared memory once per sequence instead of twice, with 8 or 16 warps.

The warp-specialized variants run a copy of ``_triton_kernels/decode.py`` with that one loop
header changed, written beside it for the run and removed after (the shipped kernel has no
such switch).  Each output is checked against a float32 reference (``err``, max abs over every
sequence, the output NaN-filled first) before it is timed; a variant that does not compile or run records its error.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
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
KERNELS = ROOT / "src" / "attnreg" / "backends" / "_triton_kernels"
WS_MODULE = "_probe_decode_ws"
LOOP = "    for n0 in range(start, end, BLOCK_N):\n"
WS_LOOP = "    for n0 in tl.range(start, end, BLOCK_N, warp_specialize=True):\n"


def write_ws_module() -> Path:
    """The decode module with its tile loop warp-specialized, beside the original."""
    src = (KERNELS / "decode.py").read_text()
    if src.count(LOOP) != 1:
        raise SystemExit("decode.py: the tile loop header is not where the probe expects it")
    path = KERNELS / f"{WS_MODULE}.py"
    path.write_text(src.replace(LOOP, WS_LOOP))
    return path


def module(ws: bool):
    name = "attnreg.backends._triton_kernels." + (WS_MODULE if ws else "decode")
    return importlib.import_module(name)


def variants(H: int):
    """(label, warp-specialized module?, DecodeConfig) of every variant at H heads."""
    from attnreg.backends._triton_kernels import decode as dec

    base = dec.decode_config(H)
    out = [("default", False, base), ("ws", True, base),
           ("ws plain", True, base._replace(isolate_qk=False))]
    if H >= 128:
        wide = base._replace(block_h=128, isolate_qk=False, ctas_per_sm=1)
        out += [("h128 w8 n32 s2", False, wide._replace(num_warps=8, block_n=32, num_stages=2)),
                ("h128 w16 n64 s2", False, wide._replace(num_warps=16, num_stages=2)),
                ("h128 w16 n32 s3", False, wide._replace(num_warps=16, block_n=32)),
                ("h128 w16 n64 s2 isolate", False, wide._replace(num_warps=16, num_stages=2,
                                                                  isolate_qk=True))]
    return out


def run(mod, q, cache, table, sl, out, cfg, splits, ws):
    return mod._mla_decode_impl(q, cache, table, sl, out, sm_scale=0.1, kv_scale=1.0,
                                num_splits=splits, min_chunk=max(cfg.block_n, cfg.min_chunk),
                                workspace=ws, cfg=cfg)


def _compile(job):
    import torch
    H, ws_mod, cfg_t, ps, split = job
    try:
        mod = module(ws_mod)
        cfg = mod.DecodeConfig(*cfg_t)
        q, cache, table, sl, out = make_inputs(1, 512, H, page_size=ps)
        s = 2 if split else 1
        ws = mod.mla_decode_workspace(1, H, s, "cuda") if split else None
        run(mod, q, cache, table, sl, out, cfg, s, ws)
        torch.cuda.synchronize()
        k = mod._LAST_LAUNCH.get("decode")
        return job, (f"ok regs={getattr(k, 'n_regs', '?')} spills={getattr(k, 'n_spills', '?')} "
                     f"smem={getattr(getattr(k, 'metadata', None), 'shared', '?')}")
    except Exception as e:  # noqa: BLE001 (a probe records every failure)
        return job, f"{type(e).__name__}: {str(e)[:300]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=14)
    args = ap.parse_args(argv)
    shapes = [s for s in SHAPES if s[2] >= 64]
    import torch
    import triton

    from attnreg.backends._triton_kernels import decode as dec
    path = write_ws_module()
    try:
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        meta = dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                    triton=triton.__version__,
                    date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    command="PYTHONPATH=src python3 scripts/probe_triton_wide_heads.py "
                            + " ".join(sys.argv[1:]))
        jobs = {(128 if H >= 128 else 64, ws_mod, tuple(cfg), ps, split)
                for (_B, _L, H) in shapes for _lab, ws_mod, cfg in variants(H)
                for ps in PAGES for split in (True, False)}
        compiled = compile_report(_compile, jobs, args.workers)
        meta["kernels"] = [[list(j), st] for j, st in sorted(compiled.items())]
        rows = []
        for (B, L, H) in shapes:
            for ps in PAGES:
                for lab, ws_mod, cfg in variants(H):
                    rec = dict(B=B, L=L, H=H, page=ps, variant=lab, cfg=list(cfg))
                    try:
                        mod = module(ws_mod)
                        q, cache, table, sl, out = make_inputs(B, L, H, page_size=ps)
                        splits = dec.splits_for_config(cfg, B, H, L, num_sms)
                        ws = mod.mla_decode_workspace(B, H, splits, "cuda") if splits > 1 else None
                        out.fill_(float("nan"))
                        run(mod, q, cache, table, sl, out, cfg, splits, ws)
                        torch.cuda.synchronize()
                        rec["err"] = max_abs_error(out, reference(q, cache, table, sl, 0.1))
                        rec["splits"] = splits
                        rec["us"] = bench(graph_of(lambda: run(mod, q, cache, table, sl, out,  # noqa: B023
                                                               cfg, splits, ws)).replay)
                    except Exception as e:  # noqa: BLE001
                        rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    rows.append(rec)
                    print(f"B={B:4d} L={L:6d} H={H:4d} p{ps:<3d} {lab:24s} "
                          + (f"{rec['us']:8.1f} us err {rec['err']:.4f}" if "us" in rec
                             else rec.get("error", "")), flush=True)
                torch.cuda.empty_cache()
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    finally:
        path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
