"""benchmarks/multi_gpu.py on the cpu: gloo ranks agree on every vote and replay path.

The same script runs issue 9's NCCL check on a multi-GPU machine (docs/multi_gpu.md);
here two gloo processes run its vote and replay-gate parts, and the
tensor-parallel conformance part with a small head count on a single claim.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "multi_gpu.py"
if str(ROOT) not in sys.path:  # `benchmarks` is a top-level folder, not an installed package
    sys.path.insert(0, str(ROOT))

from benchmarks.multi_gpu import (  # noqa: E402
    MULTICAST_OFF,
    DecodeStep,
    count_path_disagreements,
    count_vote_disagreements,
    draw_replay_batch,
)

pytest.importorskip("torch")


def _run(tmp_path: Path, *args: str, timeout: float = 240) -> tuple[int, str, dict]:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *args],
                          capture_output=True, text=True, timeout=timeout, check=False)
    summary = out / "summary.json"
    data = json.loads(summary.read_text()) if summary.exists() else {}
    return proc.returncode, proc.stdout + proc.stderr, data


def test_two_gloo_ranks_agree_on_every_vote_and_replay_path(tmp_path: Path) -> None:
    code, out, data = _run(tmp_path, "--nprocs", "2", "--backend", "gloo", "--trials", "200",
                           "--gate-steps", "16", "--heads", "2",
                           "-k", "eager/decode/mla/bf16-bf16/p16 and not sm_scale")
    assert code == 0, out
    workers = data["workers"]
    vote = workers["vote"]
    assert vote["trials"] == 200 and vote["disagreements"] == 0
    assert vote["seen_by_ranks"] == [0, 0]  # what each rank counted through the collective
    assert vote["and_true"] > 0 and vote["and_false"] > 0  # both outcomes exercised
    gate = workers["gate"]
    assert gate["steps"] == 16
    assert gate["paths"] == gate["vote_not_the_and"] == gate["path_not_the_vote"] == 0
    assert gate["graph_steps"] > 0 and gate["eager_steps"] > 0
    assert gate["replay_mismatches"] == 0
    assert gate["setup"]["decode_mode"] == "full" and gate["setup"]["real_graphs"] is False
    assert set(gate["rules"]) - {"gate.ok"}, "no blocker fired: the gate was not exercised"
    # every worker saw the multicast-off variables before importing torch
    assert all(r["env"] == MULTICAST_OFF for r in workers["ranks"])
    rows = data["conformance"]
    assert [r["rank"] for r in rows] == [0, 1]
    for row in rows:
        assert row["exit_code"] == 0 and row["refuted"] == 0 and row["verified"] == 1
        assert row["claim_head_counts"] == [2] and row["header_heads"] == [2]
        assert (tmp_path / "out" / row["report"]).exists()
    assert "PASSED" in (tmp_path / "out" / "summary.md").read_text()


def test_a_rank_whose_gate_disagrees_with_the_plan_fails_the_run(tmp_path: Path) -> None:
    # on a cpu plan decode graphs are disabled, so the clean batches the workers
    # planted are refused: the run must fail, name the cause, and not hang
    code, out, data = _run(tmp_path, "--nprocs", "2", "--backend", "gloo", "--trials", "20",
                           "--gate-steps", "4", "--skip-conformance", "--plan-platform", "cpu",
                           timeout=120)
    assert code == 1, out
    assert data["failures"] and "vote" not in data["workers"]
    assert "gate.phase_disabled" in out


@pytest.mark.parametrize("args", [
    ("--nprocs", "2", "--backend", "nccl", "--device", "cpu"),
    ("--nprocs", "3", "--backend", "gloo"),  # 128 heads do not split over 3 ranks
    ("--nprocs", "2", "--backend", "gloo", "--trials", "0"),
])
def test_bad_input_exits_2(tmp_path: Path, args: tuple[str, ...]) -> None:
    code, out, _ = _run(tmp_path, *args, timeout=60)
    assert code == 2, out
    assert "multi_gpu: error:" in out


def test_vote_check_counts_a_rank_that_differs_and_a_result_that_is_not_the_and() -> None:
    # per rank, per trial: [local eligibility, vote result]
    agree = [[[1, 1], [0, 0]], [[1, 1], [1, 0]]]
    assert count_vote_disagreements(agree)["disagreements"] == 0
    one_differs = [[[1, 1], [0, 0]], [[1, 0], [1, 0]]]
    got = count_vote_disagreements(one_differs)
    assert got["disagreements"] == 1 and got["ranks_differ"] == 1
    agree_but_wrong = [[[1, 1], [0, 1]], [[1, 1], [1, 1]]]  # trial 1: AND is false
    got = count_vote_disagreements(agree_but_wrong)
    assert got["disagreements"] == 1 and got["ranks_differ"] == 0


def test_path_check_counts_ranks_that_ran_different_paths() -> None:
    # per rank, per step: [eligible, vote, path ran (1 graph, 0 eager), replay mismatch]
    ok = [[[1, 1, 1, 0], [0, 0, 0, 0]], [[1, 1, 1, 0], [1, 0, 0, 0]]]
    got = count_path_disagreements(ok)
    assert got["paths"] == got["vote_not_the_and"] == got["path_not_the_vote"] == 0
    assert got["graph_steps"] == 1 and got["eager_steps"] == 1
    split = [[[1, 1, 1, 0]], [[1, 1, 0, 0]]]  # rank 1 ran eagerly despite the vote
    got = count_path_disagreements(split)
    assert got["paths"] == 1 and got["path_not_the_vote"] == 1


def test_replay_matches_eager_and_the_comparison_sees_other_inputs() -> None:
    import torch

    step = DecodeStep(torch, "cpu", heads=2, max_bs=2, max_seq=32, seed=1)
    q, latent, rope, lens = step.inputs(2)
    replayed = step.replay(q, latent, rope, lens)
    eager = step.eager(q, latent, rope, lens)
    assert torch.allclose(replayed.float(), eager.float(), atol=2e-2, rtol=2e-2)
    q2, latent2, rope2, lens2 = step.inputs(1)
    other = step.replay(q2, latent2, rope2, lens2)
    assert other.shape[0] == 1
    assert not torch.allclose(other.float(), eager[:1].float(), atol=2e-2, rtol=2e-2)


def test_the_planted_blocker_is_the_rule_that_fires() -> None:
    from attnreg.graph_policy import GraphConfig, ReplayGate, resolve

    plan = resolve("cuda:sm90", "deepseek-v3", "triton", GraphConfig(decode_batch_sizes=(1, 4)),
                   assume_installed=True)
    gate = ReplayGate(plan)
    seen = set()
    for s in range(200):
        batch, planted = draw_replay_batch(3, s, 0, 4)
        assert gate.can_replay(batch)[1].rule == planted
        seen.add(planted)
    assert len(seen) == 7  # gate.ok and all six blockers
