"""Host time of one ``GraphSession.run`` and its parts on a CPU, kernels stubbed (issue 26).

    .venv/bin/python scripts/probe_session_step_cpu.py [--batch 64] [--profile]

The session benchmark's triton decode session at dry-run sizes (2 heads, page 16,
40-token sequences; 8 layers; buckets 1, 8 and the batch), its Triton launches replaced
by no-ops (``benchmarks.host_overhead.stub_triton_launches``) and the graph replay by a
no-op, so what is timed is the session's Python and torch host work around the two CUDA
calls of a step (the index copy runs, as a CPU memcpy).  Best of 5 rounds of 20,000
calls, per call; first for a batch packed into the session's index buffer (no copy),
then for one built in its index layout.  The device's host runs this Python several times slower: the H200
figure is the session benchmark's (``python -m benchmarks --only session``).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks import session_step  # noqa: E402
from benchmarks._backends import PREFILL_VARIANTS  # noqa: E402
from benchmarks._harness import RunContext  # noqa: E402
from benchmarks.host_overhead import stub_triton_launches  # noqa: E402

CALLS, ROUNDS = 20_000, 5


def per_call_us(fn) -> float:  # type: ignore[no-untyped-def]
    best = float("inf")
    for _ in range(ROUNDS):
        t0 = time.perf_counter_ns()
        for _ in range(CALLS):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / CALLS / 1e3)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="also print cProfile's top entries")
    args = ap.parse_args()
    torch.set_num_threads(1)
    stub_triton_launches()
    from attnreg.runtime import graph_runner

    ctx = RunContext(out_dir=Path("."), dry_run=True)
    variant = next(v for v in PREFILL_VARIANTS if v.label == "triton")
    b = args.batch
    steps = session_step._Steps(ctx, variant, (1, 8, b), 40, 2, 8, 16,
                                {"decode": 1, "target_verify": 4})
    graph_runner.CapturedGraph.replay = lambda self: None  # type: ignore[method-assign]
    session, batch = steps.session, steps._load("decode", b)
    key = (batch.forward_mode, b)
    state = session.backend.graph_state
    from attnreg.runtime import decode_batch
    held = decode_batch(steps.pool, [steps.seq_len] * b, pages=steps.pages[:b],
                        layout=session.index_buffer)
    for _ in range(1000):
        session.run(held)
    rows = {
        "GraphSession.run, in the buffer": lambda: session.run(held),
        "  replay metadata, in the buffer": lambda: session._replay_metadata(key, held),
    }
    for name, fn in rows.items():  # before any copied batch overwrites the buffer
        print(f"{name:32s} {per_call_us(fn):6.2f} us")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(CALLS):
            session.run(held)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(15)
    for _ in range(1000):
        session.run(batch)
    rows = {
        "GraphSession.run": lambda: session.run(batch),
        "  decide (the gate)": lambda: session.decide(batch),
        "  replay (metadata + launch)": lambda: session.replay(batch, bucket=b),
        "    replay metadata": lambda: session._replay_metadata(key, batch),
        "      the index copy alone": lambda: state.flat.copy_(batch.packed.flat),
    }
    for name, fn in rows.items():
        print(f"{name:32s} {per_call_us(fn):6.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
