"""vote(): all data-parallel ranks agree (gloo processes on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("_vote_worker.py")
TRIALS = 200


def test_vote_without_a_process_group_is_local_and_imports_no_torch() -> None:
    code = ("import sys; from attnreg.graph_policy import vote; "
            "assert vote(True) is True and vote(False) is False; "
            "assert 'torch' not in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_vote_with_torch_imported_but_no_group_is_local() -> None:
    import torch.distributed as dist

    from attnreg.graph_policy import vote

    assert not dist.is_initialized()
    assert vote(True) is True and vote(False) is False


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_the_and_of_all_ranks(world: int, tmp_path: Path) -> None:
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    init_file = tmp_path / "store"
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(init_file),
                               str(outs[r]), str(world), str(TRIALS)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    errors = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {r} timed out")
        if p.returncode != 0:
            errors.append(f"rank {r}: {err[-2000:]}")
    assert not errors, "\n".join(errors)
    per_rank = [json.loads(o.read_text()) for o in outs]
    assert all(len(r) == TRIALS for r in per_rank)
    for trial in range(TRIALS):
        agreed = {per_rank[r][trial][1] for r in range(world)}
        expected = all(per_rank[r][trial][0] for r in range(world))
        assert agreed == {expected}, (trial, [per_rank[r][trial] for r in range(world)])
        assert per_rank[0][trial][2] == expected  # the workers drew the same votes
    outcomes = {per_rank[0][t][1] for t in range(TRIALS)}
    assert outcomes == {True, False}  # both outcomes were exercised
