"""Where the host time of one replay's metadata goes, per backend (cProfile, top entries).

    python scripts/profile_replay_metadata.py --backend flashinfer_mla --out prof.txt

Builds the session benchmark's decode session (8 layers are not needed: 1), B=64, L=2048,
128 heads, page size 64, and profiles 200 calls of the session's replay-metadata step for a
batch built in the session's index layout and for one built without it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from attnreg.registry import ForwardMode, get_registry
from attnreg.runtime import GraphSession, MLAConfig, decode_batch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="flashinfer_mla")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default="-")
    args = ap.parse_args()
    b, seq, ps = args.batch, 2048, 64
    cfg = MLAConfig(num_heads=128, page_size=ps, max_context_len=seq + 4, device="cuda")
    backend = get_registry().create(args.backend, cfg)
    pool = cfg.make_pool(b * -(-(seq + 4) // ps) + 2, num_layers=1)
    pages = pool.allocate([seq + 4] * b, shuffle=7)
    ses = GraphSession(backend, pool, phase="decode", mode="full", buckets=(1, 8, b),
                       max_seq_len=seq + 4)
    ses.capture()
    key = (ForwardMode.DECODE, b)
    packed = decode_batch(pool, [seq] * b, pages=pages[:b], layout=ses.index_layout)
    plain = decode_batch(pool, [seq] * b, pages=pages[:b])
    out = io.StringIO()
    steps = (("replay metadata", "packed", lambda: ses._replay_metadata(key, packed)),
             ("replay metadata", "plain", lambda: ses._replay_metadata(key, plain)),
             ("gate (decide)", "packed", lambda: ses.decide(packed)),
             ("step (run)", "packed", lambda: ses.run(packed)))
    for what, name, fn in steps:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        xs = []
        for _ in range(200):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            xs.append((time.perf_counter() - t0) * 1e6)
        xs.sort()
        out.write(f"== {args.backend} {name} batch B={b}: {what} median "
                  f"{xs[len(xs) // 2]:.1f} us (min {xs[0]:.1f})\n")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    text = out.getvalue()
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
        print("\n".join(line for line in text.split("\n") if line.startswith("==")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
