"""Probe: the triton absorbed extend's pipeline stages over bf16 and fp8 caches.

Usage (a CUDA GPU; ``--small`` with ``TRITON_INTERPRET=1 ... --device cpu`` checks the
script itself on tiny shapes)::

    PYTHONPATH=src python3 scripts/probe_triton_extend_stages.py --out extend_stages.json

An offline sm90 compile (Triton 3.6) gives the extend kernel's KV tile over an fp8 cache
one shared buffer at its three stages (185 KB: the tile is read into registers for the
conversion, so the next tile's copy waits for this one's last read) and two at five
(222 KB); over a bf16 cache it has two at three.  For prefix + extend lengths of P9
(one sequence, 128 heads, page size 1) this times ``mla_extend`` with the shipped
``extend_config`` and with five stages, by CUDA-graph replay with the L2 flushed
(``triton.testing.do_bench``, median, us), after checking every query row against a
float32 reference (``err``, max abs; the output is filled with NaN first, so a row no
program wrote counts as wrong).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: (prefix, extend) of P9 (benchmarks/prefill.py), one sequence
SHAPES = ((0, 512), (4096, 512), (4096, 4096), (32768, 512))
SMALL = ((0, 7), (5, 9))
HEADS, SMALL_HEADS = 128, 2
#: query rows the reference takes at a time (all 4096 rows' [H, rows, L] scores at once
#: would take 17 GB)
REF_CHUNK = 64


def reference(q, cache, prefix: int, extend: int, sm_scale: float):
    """float32 causal attention of every query row over cache rows 0..L-1: ``[E, H, 512]``."""
    import torch

    kv = cache.reshape(-1, cache.shape[-1])[:prefix + extend].float()
    keys = torch.arange(prefix + extend, device=q.device)
    outs = []
    for start in range(0, extend, REF_CHUNK):
        qr = q[start:start + REF_CHUNK].float()                          # [rows, H, 576]
        scores = (qr.permute(1, 0, 2) @ kv.T) * sm_scale                  # [H, rows, L]
        pos = prefix + start + torch.arange(qr.shape[0], device=q.device)  # row positions
        scores = scores.masked_fill(keys[None, None, :] > pos[None, :, None], float("-inf"))
        outs.append((scores.softmax(-1) @ kv[:, :512]).permute(1, 0, 2))  # [rows, H, 512]
    return torch.cat(outs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a check of the script)")
    args = ap.parse_args(argv)
    import torch

    from attnreg.backends._triton_kernels import extend as ex
    from benchmarks.triton_decode_tuning import bench, graph_of, max_abs_error

    dev = args.device
    shapes, heads = (SMALL, SMALL_HEADS) if args.small else (SHAPES, HEADS)
    shipped = ex._extend_config
    meta = dict(device=torch.cuda.get_device_name(0) if dev == "cuda" else dev,
                torch=torch.__version__,
                date_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                command="PYTHONPATH=src python3 scripts/probe_triton_extend_stages.py "
                        "--out extend_stages.json" + (" --small" if args.small else ""))
    rows_out = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for prefix, extend in shapes:
        tokens = prefix + extend
        i32 = dict(dtype=torch.int32, device=dev)
        table = torch.arange(tokens, **i32).view(1, tokens)
        seq_lens, prefix_lens = torch.tensor([tokens], **i32), torch.tensor([prefix], **i32)
        qo = torch.tensor([0, extend], **i32)
        q = torch.randn(extend, heads, 576, generator=gen, device=dev).bfloat16()
        out = torch.empty(extend, heads, 512, dtype=torch.bfloat16, device=dev)
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count \
            if dev == "cuda" else 132
        splits = ex.default_extend_splits(1, extend, heads, tokens, num_sms)
        for kv_name, kv_dtype in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
            cache = torch.randn(tokens, 1, 576, generator=gen, device=dev).to(kv_dtype)
            ref = reference(q, cache, prefix, extend, 0.05)
            base = shipped(heads)
            for label, stages in (("shipped", base.num_stages), ("5 stages", 5)):
                cfg = base._replace(num_stages=stages)
                rec = dict(prefix=prefix, extend=extend, heads=heads, kv=kv_name,
                           variant=label, cfg=list(cfg), splits=splits)
                ex._extend_config = lambda h, cfg=cfg: cfg
                ws = ex.mla_extend_workspace(extend, heads, splits, dev) if splits > 1 else None

                def call(cache=cache, ws=ws):
                    return ex.mla_extend(q, cache, table, seq_lens, prefix_lens, qo, out,
                                         sm_scale=0.05, max_extend_len=extend,
                                         num_splits=splits, workspace=ws)
                try:
                    out.fill_(float("nan"))
                    call()
                    rec["err"] = max_abs_error(out, ref)
                    if dev == "cuda":
                        torch.cuda.synchronize()
                        rec["us"] = bench(graph_of(call).replay)
                except Exception as e:  # noqa: BLE001 (a probe records every failure)
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                finally:
                    ex._extend_config = shipped
                rows_out.append(rec)
                print(f"P={prefix:6d} E={extend:5d} {kv_name:4s} {label:9s} "
                      + (f"{rec.get('us', float('nan')):9.1f} us err {rec['err']:.4f}"
                         if "err" in rec else rec["error"]), flush=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows_out), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
