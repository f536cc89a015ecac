"""One rank of the data-parallel fault test:
``python _sync_fault_worker.py RANK WORLD INIT_FILE OUT_DIR TIMEOUT [BACKEND]``.

BACKEND is ``gloo`` (default) or ``nccl`` (one GPU per rank).

In order, every rank of one gloo group runs:

1. ``busy_prefill``: every rank has a prefill batch (the control: it replays);
2. ``idle_prefill``: the same, but rank :data:`IDLE_RANK` has no batch;
3. ``idle_decode``: a decode step with rank :data:`IDLE_RANK` idle;
4. ``mismatch``: rank :data:`ODD_RANK` built its gate from a plan with other
   decode buckets; every rank syncs a decode batch of 3;
5. ``absent``: the last rank never calls ``sync``; the others call it with
   ``timeout=TIMEOUT`` and time how long the error took.

Each rank writes ``OUT_DIR/rankN.json`` and leaves with ``os._exit``: after
step 5 the group is unusable by design, so it is never torn down.  The absent
rank stays alive (without calling anything) until the others have written
their results, so that they meet a silent rank, not a closed connection.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from attnreg.graph_policy import (
    GraphConfig,
    ReplayBatch,
    ReplayGate,
    SyncError,
    resolve,
    sync,
)

IDLE_RANK = 3
ODD_RANK = 5
DEFAULT_BUCKETS = (1, 2, 4, 8)
ODD_BUCKETS = (1, 3, 5, 7)
#: Generous for the steps that must succeed (8 processes share a few cores).
STEP_TIMEOUT = 60.0


def make_gate(buckets: tuple[int, ...] = DEFAULT_BUCKETS) -> ReplayGate:
    plan = resolve("cuda:sm90", "deepseek-v3", "triton",
                   GraphConfig(decode_batch_sizes=buckets, prefill_num_tokens=(64, 128, 256)),
                   assume_installed=True)
    return ReplayGate(plan)


def outcome(call) -> dict[str, object]:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    try:
        a = call()
    except SyncError as exc:
        return {"error": str(exc), "fingerprints": list(exc.fingerprints),
                "missing_ranks": None if exc.missing_ranks is None else list(exc.missing_ranks),
                "timeout_s": exc.timeout_s, "elapsed_s": time.monotonic() - start}
    return {"replay": a.replay, "bucket": a.bucket, "forward_mode": a.forward_mode.value,
            "idle_ranks": list(a.idle_ranks), "fingerprint": a.fingerprint,
            "elapsed_s": time.monotonic() - start}


def prefill(rank: int, idle: bool) -> ReplayBatch:
    if idle:
        return ReplayBatch("prefill", 0)
    n = 40 + rank
    return ReplayBatch("prefill", 1, prefix_lens=[0], extend_lens=[n], seq_lens=[n])


def decode(rank: int, idle: bool) -> ReplayBatch:
    if idle:
        return ReplayBatch("decode", 0)
    size = rank % 4 + 1
    return ReplayBatch("decode", size, seq_lens=[100 + rank] * size)


def main() -> None:
    rank, world, init_file, out_dir, timeout = sys.argv[1:6]
    backend = sys.argv[6] if len(sys.argv) > 6 else "gloo"
    r, n, t = int(rank), int(world), float(timeout)
    out = Path(out_dir)
    if backend == "nccl":
        import torch

        torch.cuda.set_device(r)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=r, world_size=n,
                            timeout=timedelta(seconds=120))
    gate = make_gate()
    result: dict[str, object] = {}
    result["busy_prefill"] = outcome(lambda: sync(gate.facts(prefill(r, False)),
                                                  timeout=STEP_TIMEOUT))
    result["idle_prefill"] = outcome(lambda: sync(gate.facts(prefill(r, r == IDLE_RANK)),
                                                  timeout=STEP_TIMEOUT))
    result["idle_decode"] = outcome(lambda: sync(gate.facts(decode(r, r == IDLE_RANK)),
                                                 timeout=STEP_TIMEOUT))
    mine = make_gate(ODD_BUCKETS) if r == ODD_RANK else gate
    batch = ReplayBatch("decode", 3, seq_lens=[10, 20, 30])
    result["mismatch"] = outcome(lambda: sync(mine.facts(batch), timeout=STEP_TIMEOUT))
    absent = n - 1
    if r == absent:  # never calls sync: waits, silent, until every other rank is done
        deadline = time.monotonic() + 3 * t + 60
        while time.monotonic() < deadline and \
                not all((out / f"rank{o}.json").exists() for o in range(absent)):
            time.sleep(0.1)
        result["absent"] = {"skipped": True}
    else:
        result["absent"] = outcome(lambda: sync(gate.facts(decode(r, False)), timeout=t))
    tmp = out / f"rank{r}.tmp"
    tmp.write_text(json.dumps(result))
    tmp.rename(out / f"rank{r}.json")
    sys.stdout.flush()
    os._exit(0)  # the group is unusable after the timeout: do not tear it down


if __name__ == "__main__":
    main()
