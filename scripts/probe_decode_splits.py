"""Triton decode at 64+ heads and small batches: the split floor ``min_chunk`` (128 tokens
now) against 64, the kernel and merge captured in a graph (do_bench, L2 flushed, median).

    PYTHONPATH=src python3 scripts/probe_decode_splits.py

Issue 26: at B=1, L=2048, H=128 the decode kernel takes 14 us per layer for 34 programs of
~2 tiles each, on 132 SMs; shorter chunks fill more of the device.  Prints one line per
(shape, KV dtype, min_chunk): splits, us, max error against a float32 reference;
``--fp8``: the fp8 cache only.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from benchmarks.triton_decode_tuning import (  # noqa: E402
    bench,
    graph_of,
    make_inputs,
    max_abs_error,
    reference,
    run_cfg,
)


def main() -> int:
    from attnreg.backends._triton_kernels import decode as dec
    from attnreg.backends._triton_kernels.decode import mla_decode_workspace
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    worst = 0.0
    fp8_only = "--fp8" in sys.argv
    shapes = ((1, 2052, 128), (8, 2052, 128), (1, 1024, 128), (1, 4100, 128),
              (64, 2052, 128), (1, 2052, 64), (8, 1024, 128), (1, 32768, 128))
    for (B, L, H), ps, kv in ((s, p, k) for s in shapes for p in (1, 64)
                              for k in ((torch.float8_e4m3fn,) if fp8_only
                                        else (None, torch.float8_e4m3fn))):
        q, cache, table, sl, out = make_inputs(B, L, H, page_size=ps, kv_dtype=kv)
        want = reference(q, cache, table, sl, 0.1)
        base = dec.decode_config(H, kv)
        for mc in (128, 64):
            cfg = base._replace(min_chunk=mc)
            splits = dec.splits_for_config(cfg, B, H, L, sms)
            ws = mla_decode_workspace(B, H, splits, q.device) if splits > 1 else None

            def call(cfg=cfg, splits=splits, ws=ws):
                run_cfg(q, cache, table, sl, out, cfg, splits, ws=ws)
            out.fill_(float("nan"))
            call()
            torch.cuda.synchronize()
            err = max_abs_error(out, want)
            worst = max(worst, err)
            g = graph_of(call)
            us = bench(g.replay)
            print(f"B={B:3d} L={L:6d} H={H:3d} page={ps:2d} kv={'fp8' if kv else 'bf16'} "
                  f"min_chunk={mc:3d} "
                  f"splits={splits:3d} {us:7.1f} us err {err:.1e}", flush=True)
    print(f"worst error {worst:.1e}")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
