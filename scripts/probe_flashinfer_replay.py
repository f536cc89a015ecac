"""Where the replay metadata of flashinfer_mla's decode graph goes at B=64 (issue 26), on a
CUDA device with flashinfer installed.

    python scripts/probe_flashinfer_replay.py

The session benchmark's shape (8 layers, 128 heads, page 64, sequences of 2048 tokens,
buckets 1, 8, 64), a batch built in the session's index layout.  Host wall clock after
``torch.cuda.synchronize()``, median of 200 samples, of: the session's replay metadata
call; attnreg's plan inputs for the captured shape (the in-place form the replay uses,
and the compacted one it replaced); flashinfer's own ``plan()`` of the captured wrapper
alone.  Then cProfile's top entries of the replay metadata call.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from attnreg.registry import get_registry  # noqa: E402
from attnreg.runtime import GraphSession, MLAConfig, decode_batch  # noqa: E402


def host_us(fn, samples: int = 200) -> float:  # type: ignore[no-untyped-def]
    out = []
    for _ in range(samples):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def main() -> int:
    b, seq, ps, heads, layers = 64, 2048, 64, 128, 8
    cfg = MLAConfig(num_heads=heads, page_size=ps, max_context_len=seq + 4, device="cuda")
    backend = get_registry().create("flashinfer_mla", cfg)
    pool = cfg.make_pool(b * -(-(seq + 4) // ps) + 2, num_layers=layers)
    pages = pool.allocate([seq + 4] * b, shuffle=7)
    ses = GraphSession(backend, pool, phase="decode", mode="full", buckets=(1, 8, b),
                       layers=layers, max_seq_len=seq + 4)
    ses.capture()
    batch = decode_batch(pool, [seq] * b, pages=pages[:b], layout=ses.index_layout)
    key = (batch.forward_mode, b)
    for _ in range(50):
        ses._replay_metadata(key, batch)
    kernels = backend.kernels
    md = backend.graph_state.captured[(batch.forward_mode, b, b)]
    planned = md.plan.mla

    def in_place():  # type: ignore[no-untyped-def]
        return kernels.graph_plan_inputs(batch.seq_lens_cpu, batch.extend_lens_cpu,
                                         md.page_table, b, b)

    def compacted():  # type: ignore[no-untyped-def]
        return kernels.plan_inputs(batch.seq_lens_cpu, batch.extend_lens_cpu,
                                   batch.page_table, pad_to=(b, b))

    inputs = in_place()
    rows = {
        "replay metadata (session)": lambda: ses._replay_metadata(key, batch),
        "plan inputs, in place": in_place,
        "plan inputs, compacted": compacted,
        "flashinfer plan() alone": lambda: kernels._plan(
            planned.wrapper, inputs, causal=planned.causal, q_dtype=planned.q_dtype,
            kv_dtype=planned.kv_dtype),
    }
    for name, fn in rows.items():
        print(f"{name:28s} {host_us(fn):8.1f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        ses._replay_metadata(key, batch)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
