"""One rank of the vote test: ``python _vote_worker.py RANK WORLD INIT_FILE OUT SEED TRIALS``.

Every rank draws all ranks' eligibilities from the same seeded generator, so
each one knows the expected AND and checks vote() against it.
"""

from __future__ import annotations

import json
import random
import sys

import torch.distributed as dist

from attnreg.graph_policy import vote


def main() -> None:
    rank, world, init_file, out, seed, trials = sys.argv[1:7]
    rank_i, world_i = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank_i,
                            world_size=world_i)
    group = dist.new_group(list(range(world_i)), backend="gloo")
    results = []
    for trial in range(int(trials)):
        rng = random.Random(int(seed) * 1_000_003 + trial)
        # Vary the odds so that both outcomes are common for any world size.
        p_true = rng.choice((0.5, 0.8, 0.95))
        votes = [rng.random() < p_true for _ in range(world_i)]
        got = vote(votes[rank_i], group=group if trial % 2 else None)
        results.append([votes[rank_i], got, all(votes)])
    dist.barrier()
    dist.destroy_process_group()
    with open(out, "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main()
