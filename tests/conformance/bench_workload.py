"""How long the suite's host side takes to build one wide decode workload and its oracle.

Not a test (not collected): ``python tests/conformance/bench_workload.py [--device cuda]``
prints the wall and process CPU time of :func:`make_pool` + :func:`make_workload` (prefix writes, the
batch, the float64 oracle) for a decode batch of 256 sequences (the cuda
``wide_decode`` lengths), at 16 and 128 heads, best of three.
"""

from __future__ import annotations

import argparse
import time

import torch

from attnreg.registry import DType, ForwardMethod, Phase
from attnreg.testing.batches import BatchSpec
from attnreg.testing.claims import Combo
from attnreg.testing.workload import make_config, make_pool, make_workload


def wide(n: int) -> BatchSpec:
    return BatchSpec(f"wide_{n}", Phase.DECODE, tuple(((37 * i) % 700, 1) for i in range(n)),
                     "bench")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    spec = wide(args.sequences)
    for heads, kv in ((16, DType.BF16), (128, DType.BF16), (16, DType.FP8_E4M3)):
        combo = Combo(ForwardMethod.MLA, Phase.DECODE, DType.BF16, kv, 16, heads, (576, 512))
        config = make_config(combo, args.device)
        best = cpu = float("inf")
        for _ in range(args.repeat):
            if args.device == "cuda":
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            pool = make_pool(config, [spec])
            make_workload(config, pool, spec, ForwardMethod.MLA, seed=1)
            if args.device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
            cpu = min(cpu, time.process_time() - c0)
        print(f"{args.device} decode bs={args.sequences} heads={heads} kv={kv}: "
              f"pool + workload + oracle {best:.3f} s wall, {cpu:.3f} s process CPU (best "
              f"of {args.repeat}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()
