"""One rank of the sync tests:
``python _sync_worker.py RANK WORLD INIT_FILE OUT SEED TRIALS MODE [BACKEND]``.

Every rank draws all ranks' batches from the same seeded generator, so each
knows what the agreed answer must be; per trial it calls :func:`sync`
(alternating the default group and a subgroup) and, every fifth trial,
:func:`vote`, and records what it got.  In some trials the ranks draw
different forward modes on purpose: every rank must then raise
:class:`SyncError` (and the next trial must still work).  Then the pairing
of issue 18: rank 0 syncs a decode batch, every other rank a target-verify
batch; all must raise, none may hang.  MODE is ``trials`` (all of that) or
``mismatch`` (the pairing only).  BACKEND is ``gloo`` (default) or ``nccl`` (one
GPU per rank: the exchanged tensor then lives on the rank's device).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))  # _helpers, run as a script

from _helpers import declaration  # noqa: E402

from attnreg.graph_policy import (  # noqa: E402
    EngineFacts,
    GraphConfig,
    ReplayBatch,
    ReplayGate,
    SyncError,
    pack,
    resolve,
    sync,
    unpack,
    vote,
)
from attnreg.registry import ForwardMode, ForwardModeSupport, GraphMode, Phase  # noqa: E402

DRAFT = 2
MODES = (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY)


def make_gate() -> ReplayGate:
    caps = declaration("gen_verify", "cuda:sm90", forward_modes={
        (Phase.DECODE, GraphMode.FULL): (ForwardModeSupport(ForwardMode.DECODE),
                                         ForwardModeSupport(ForwardMode.TARGET_VERIFY, 4))})
    plan = resolve("cuda:sm90", "deepseek-v3", caps,
                   GraphConfig(decode_batch_sizes=(1, 2, 4, 8), prefill_num_tokens=(64, 128, 256),
                               prefill_max_requests=6),
                   engine=EngineFacts(num_draft_tokens=DRAFT, max_context_len=4096))
    return ReplayGate(plan)


def draw_batch(rng: random.Random, mode: ForwardMode) -> ReplayBatch:
    size = rng.choice((0, 1, 2, 3, 5, 8, 9))
    prefix = [rng.choice((0, 0, 17, 1000, 4095)) for _ in range(size)]
    if mode is ForwardMode.DECODE:
        new = [1] * size
    elif mode is ForwardMode.TARGET_VERIFY:
        new = [rng.choice((DRAFT, DRAFT, DRAFT, 3))] * size
    else:
        new = [rng.choice((1, 30, 64, 200)) for _ in range(size)]
    return ReplayBatch(mode, size, prefix_lens=prefix, extend_lens=new,
                       lora=rng.random() < 0.05)


def outcome(call) -> list[object]:  # type: ignore[no-untyped-def]
    try:
        a = call()
    except SyncError as exc:
        return ["error", str(exc)]
    return [a.replay, a.bucket, a.forward_mode.value, list(a.num_tokens), a.max_seq_len,
            list(a.ineligible_ranks)]


def trials(rank: int, world: int, seed: int, n: int, group: object) -> dict[str, object]:
    gate = make_gate()
    got, expected, votes = [], [], []
    for trial in range(n):
        rng = random.Random(seed * 1_000_003 + trial)
        mixed = rng.random() < 0.1  # ranks run different kinds of batch: must raise everywhere
        common = rng.choice(MODES)
        batches = [draw_batch(rng, rng.choice(MODES) if mixed else common) for _ in range(world)]
        facts = [gate.facts(b) for b in batches]
        expected.append(outcome(lambda: unpack([pack(f) for f in facts])))
        got.append(outcome(lambda: sync(facts[rank], group if trial % 2 else None)))
        if trial % 5 == 0:
            eligible = [f.eligible for f in facts]
            votes.append([vote(eligible[rank]), all(eligible)])
    return {"got": got, "expected": expected, "votes": votes}


def mismatch(rank: int) -> list[object]:
    gate = make_gate()
    mode = ForwardMode.DECODE if rank == 0 else ForwardMode.TARGET_VERIFY
    batch = ReplayBatch(mode, 2, extend_lens=[1 if rank == 0 else DRAFT] * 2,
                        prefix_lens=[10, 20])
    return outcome(lambda: sync(gate.facts(batch)))


def main() -> None:
    rank, world, init_file, out, seed, n, mode = sys.argv[1:8]
    backend = sys.argv[8] if len(sys.argv) > 8 else "gloo"
    rank_i, world_i = int(rank), int(world)
    if backend == "nccl":
        import torch

        torch.cuda.set_device(rank_i)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank_i,
                            world_size=world_i)
    group = dist.new_group(list(range(world_i)), backend=backend)
    result = trials(rank_i, world_i, int(seed), int(n), group) if mode == "trials" else {}
    result["mismatch"] = mismatch(rank_i)
    dist.barrier()  # every rank is still in step after the errors
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
