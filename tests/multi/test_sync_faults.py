"""Data-parallel agreement under faults, 8 gloo ranks on the CPU (issue 26, item 5).

The same test runs over NCCL with one GPU per rank where 8 GPUs are present
(``-m gpu``; there no rank can name the missing one).

One launch of 8 processes (tests/multi/_sync_fault_worker.py) runs, in order:
an idle rank in a prefill step and in a decode step (the documented vote),
one rank whose plan has other decode buckets (every rank raises SyncError
naming both fingerprints and the field that differs), and one rank that never
calls sync (every other rank raises SyncError within the timeout; the group's
rank 0 names the missing rank).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))  # the worker module, for its constants

from _sync_fault_worker import (  # noqa: E402
    IDLE_RANK,
    ODD_BUCKETS,
    ODD_RANK,
    make_gate,
)

WORKER = Path(__file__).with_name("_sync_fault_worker.py")
WORLD = 8
#: The timeout the absent-rank step runs with: short, so the test stays fast.
TIMEOUT = 3.0
#: How much later than the timeout an error may come on a loaded machine.
SLACK = 10.0


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture(scope="module", params=[
    "gloo",
    pytest.param("nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(
        _gpus() < WORLD, reason=f"NCCL sync faults need {WORLD} CUDA GPUs")]),
])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory,
             backend: str) -> list[dict]:  # type: ignore[type-arg]
    tmp = tmp_path_factory.mktemp(f"sync_faults_{backend}")
    # NVLink multicast stays off on the lent machines (docs/multi_gpu.md)
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(WORLD),
                               str(tmp / "store"), str(tmp), str(TIMEOUT), backend],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD)]
    deadline = time.monotonic() + 300
    errors = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {r} hung")
        if p.returncode != 0:
            errors.append(f"rank {r} exited {p.returncode}: {err[-2000:]}")
    assert not errors, "\n".join(errors)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _same_on_every_rank(per_rank: list[dict], step: str) -> dict:  # type: ignore[type-arg]
    answers = [{k: v for k, v in r[step].items() if k != "elapsed_s"} for r in per_rank]
    assert all(a == answers[0] for a in answers), answers
    return answers[0]


def test_every_busy_prefill_step_replays(per_rank: list[dict]) -> None:  # type: ignore[type-arg]
    got = _same_on_every_rank(per_rank, "busy_prefill")
    assert got["replay"] is True and got["bucket"] == 64 and got["idle_ranks"] == []
    assert got["fingerprint"] == make_gate().fingerprint.digest


def test_an_idle_rank_keeps_a_prefill_step_eager_on_every_rank(
        per_rank: list[dict]) -> None:  # type: ignore[type-arg]
    got = _same_on_every_rank(per_rank, "idle_prefill")
    assert got["replay"] is False and got["bucket"] is None
    assert got["idle_ranks"] == [IDLE_RANK] and got["forward_mode"] == "extend"


def test_an_idle_rank_pads_a_decode_step_to_the_busy_ranks_bucket(
        per_rank: list[dict]) -> None:  # type: ignore[type-arg]
    got = _same_on_every_rank(per_rank, "idle_decode")
    # busy ranks hold 1..4 requests: every rank, the idle one too, replays bucket 4
    assert got["replay"] is True and got["bucket"] == 4
    assert got["idle_ranks"] == [IDLE_RANK] and got["forward_mode"] == "decode"


def test_a_rank_with_another_plan_makes_every_rank_raise_naming_both_fingerprints(
        per_rank: list[dict]) -> None:  # type: ignore[type-arg]
    ours, theirs = make_gate().fingerprint.digest, make_gate(ODD_BUCKETS).fingerprint.digest
    assert ours != theirs
    got = _same_on_every_rank(per_rank, "mismatch")
    message = got["error"]
    assert f"fingerprint {ours} on ranks 0, 1, 2, 3, 4, 6, 7; {theirs} on rank {ODD_RANK}" \
        in message
    assert got["fingerprints"] == [theirs if r == ODD_RANK else ours for r in range(WORLD)]
    # ... and which facts differ, as each side has them
    assert "decode.batch_sizes: 1,3,5,7 vs 1,2,4,8" in message


def test_a_rank_that_never_calls_sync_makes_the_others_raise_within_the_timeout(
        per_rank: list[dict], backend: str) -> None:  # type: ignore[type-arg]
    absent = WORLD - 1
    assert per_rank[absent]["absent"] == {"skipped": True}
    for r in range(absent):
        got = per_rank[r]["absent"]
        assert "error" in got, (r, got)
        assert got["timeout_s"] == TIMEOUT and f"timed out after {TIMEOUT:g} s" in got["error"]
        assert TIMEOUT * 0.9 <= got["elapsed_s"] <= TIMEOUT + SLACK, (r, got["elapsed_s"])
    if backend == "nccl":  # NCCL cannot tell who is missing
        assert all("nccl cannot tell which ranks are missing" in per_rank[r]["absent"]["error"]
                   and per_rank[r]["absent"]["missing_ranks"] is None for r in range(absent))
        return
    # gloo's monitored barrier tells the group's rank 0 who is missing
    assert per_rank[0]["absent"]["missing_ranks"] == [absent]
    assert f"rank {absent} never called sync" in per_rank[0]["absent"]["error"]
    for r in range(1, absent):
        assert "rank 0's SyncError names it" in per_rank[r]["absent"]["error"]
