"""sync(): one all_gather, the same answer on every rank, mixed forward modes refused
on every rank (gloo processes on CPU).  Also covers vote(), the bool-only AND."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnreg.graph_policy import (
    PACKED_WIDTH,
    BatchFacts,
    SyncError,
    pack,
    unpack,
)
from attnreg.registry import ForwardMode

WORKER = Path(__file__).with_name("_sync_worker.py")
TRIALS = 1000


def _run(world: int, tmp_path: Path, mode: str, trials: int = 0, timeout: float = 240,
         backend: str = "gloo") -> list[dict]:  # type: ignore[type-arg]
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1")
    init_file = tmp_path / "store"
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), str(init_file),
                               str(outs[r]), str(world), str(trials), mode, backend],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    errors = []
    for r, p in enumerate(procs):
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"rank {r} hung (no answer in {timeout} s)")
        if p.returncode != 0:
            errors.append(f"rank {r}: {err[-2000:]}")
    assert not errors, "\n".join(errors)
    return [json.loads(o.read_text()) for o in outs]


def _two_gpus() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.parametrize("world, backend", [
    (2, "gloo"), (4, "gloo"),
    pytest.param(2, "nccl", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _two_gpus(), reason="NCCL sync needs two CUDA GPUs")]),
])
def test_every_rank_gets_the_same_agreed_answer(world: int, backend: str,
                                                tmp_path: Path) -> None:
    # 1000 draws at two ranks; at four a quarter of them: the draws are the same kind
    # (a trial costs each rank an all_gather), what four ranks add is more than one
    # other rank to agree with and the plural in the mismatch message, and the outcome
    # checks below fail if the draws missed one
    trials = TRIALS if world == 2 else TRIALS // 4
    per_rank = _run(world, tmp_path, "trials", trials, backend=backend)
    disagreements = [t for t in range(trials)
                     if len({json.dumps(r["got"][t]) for r in per_rank}) != 1]
    assert disagreements == []
    # ... and it is the answer every rank computed from all ranks' facts.
    assert all(r["got"] == r["expected"] for r in per_rank)
    outcomes = per_rank[0]["got"]
    assert {o[0] for o in outcomes} == {True, False, "error"}  # replay, eager, refused
    assert all("disagree on the forward mode" in o[1] for o in outcomes if o[0] == "error")
    # vote(): every rank gets the AND of the local eligibilities.
    for r in per_rank:
        assert all(got == want for got, want in r["votes"])
    assert {v[1] for v in per_rank[0]["votes"]} == {True, False}
    # Then rank 0 syncs a decode batch and the others a verify batch: every rank raises
    # the same error naming the ranks, none hangs (_run fails on a timeout).
    verify_ranks = ", ".join(str(r) for r in range(1, world))
    for r in per_rank:
        kind, message = r["mismatch"]
        assert kind == "error", r["mismatch"]
        plural = "s" if world > 2 else ""
        assert "decode on rank 0" in message
        assert f"target_verify on rank{plural} {verify_ranks}" in message


def test_sync_without_a_process_group_is_local_and_imports_no_torch() -> None:
    code = ("import sys; from attnreg.graph_policy import BatchFacts, sync; "
            "from attnreg.registry import ForwardMode; "
            "a = sync(BatchFacts(True, ForwardMode.DECODE, 3, 3, 4, 100)); "
            "assert a.replay and a.bucket == 4 and a.num_tokens == (3,); "
            "assert 'torch' not in sys.modules; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_pack_is_a_fixed_width_int_row_and_unpack_checks_it() -> None:
    facts = BatchFacts(True, ForwardMode.TARGET_VERIFY, 4, 8, 4, 900)
    row = pack(facts)
    assert len(row) == PACKED_WIDTH and all(isinstance(v, int) for v in row)
    agreed = unpack([row, row])
    assert (agreed.replay, agreed.bucket, agreed.forward_mode) == \
        (True, 4, ForwardMode.TARGET_VERIFY)
    with pytest.raises(SyncError, match="rank 1 sent 3 ints"):
        unpack([row, row[:3]])
    with pytest.raises(SyncError, match="rank 0 packed format 99"):
        unpack([(99, *row[1:])])


def test_idle_ranks_follow_the_busy_ones() -> None:
    busy = BatchFacts(True, ForwardMode.TARGET_VERIFY, 3, 6, 4, 50)
    idle = BatchFacts(True, ForwardMode.DECODE, 0, 0, 1, 0)  # its own mode is not compared
    agreed = unpack([pack(idle), pack(busy)])
    assert agreed.replay and agreed.bucket == 4 and agreed.forward_mode is \
        ForwardMode.TARGET_VERIFY
    nobody = unpack([pack(idle), pack(idle)])
    assert not nobody.replay and nobody.bucket is None


def test_one_ineligible_rank_keeps_every_rank_eager() -> None:
    ok = BatchFacts(True, ForwardMode.DECODE, 3, 3, 4, 10)
    no = BatchFacts(False, ForwardMode.DECODE, 9, 9, None, 10)
    agreed = unpack([pack(ok), pack(no), pack(ok)])
    assert not agreed.replay and agreed.bucket is None and agreed.ineligible_ranks == (1,)


def _gate(buckets: tuple[int, ...] = (1, 2, 4, 8), **kwargs: object):  # type: ignore[no-untyped-def]
    from attnreg.graph_policy import GraphConfig, ReplayGate, resolve

    plan = resolve("cuda:sm90", "deepseek-v3", "triton", GraphConfig(decode_batch_sizes=buckets),
                   assume_installed=True)
    return ReplayGate(plan, **kwargs)  # type: ignore[arg-type]


def test_rows_from_gates_with_different_plans_are_refused_naming_both_fingerprints() -> None:
    from attnreg.graph_policy import ReplayBatch

    batch = ReplayBatch("decode", 3, seq_lens=[5, 6, 7])
    # The case: the largest bucket, 4, would be agreed, and rank 1 never captured 4.
    ours, theirs = _gate(), _gate((1, 3, 5, 7))
    assert (ours.bucket_for(batch), theirs.bucket_for(batch)) == (4, 3)
    a, b = ours.fingerprint.digest, theirs.fingerprint.digest
    with pytest.raises(SyncError) as info:
        unpack([pack(ours.facts(batch)), pack(theirs.facts(batch)), pack(ours.facts(batch))])
    assert f"fingerprint {a} on ranks 0, 2; {b} on rank 1" in str(info.value)
    assert info.value.fingerprints == (a, b, a)
    # facts built by hand carry none, and may not be mixed with a gate's
    hand = BatchFacts(True, ForwardMode.DECODE, 3, 3, 4, 7)
    with pytest.raises(SyncError, match=f"fingerprint {a} on rank 0; none on rank 1"):
        unpack([pack(ours.facts(batch)), pack(hand)])
    agreed = unpack([pack(ours.facts(batch))] * 2)
    assert agreed.fingerprint == a and agreed.replay and agreed.bucket == 4


def test_the_fingerprint_covers_the_gate_settings_and_the_cost_profile() -> None:
    from attnreg.graph_policy import HiddenCapture

    base = _gate().fingerprint
    assert _gate().fingerprint == base and len(base.digest) == 12  # stable across builds
    assert _gate(captured_hidden=HiddenCapture.FULL).fingerprint.differences(base) == \
        ("captured_hidden",)
    assert _gate(eager_logprob_tail=True).fingerprint.differences(base) == \
        ("eager_logprob_tail",)
    assert dict(base.fields)["pack_version"] == "2"
    assert base.as_int() < 2 ** 48 and f"{base.as_int():012x}" == base.digest


def test_an_idle_rank_forces_eager_in_a_prefill_step_and_pads_in_a_decode_step() -> None:
    busy = BatchFacts(True, ForwardMode.EXTEND, 2, 100, 128, 300)
    idle = BatchFacts(True, ForwardMode.EXTEND, 0, 0, 64, 0)
    prefill = unpack([pack(busy), pack(idle), pack(busy)])
    assert not prefill.replay and prefill.bucket is None and prefill.idle_ranks == (1,)
    assert unpack([pack(busy), pack(busy)]).replay  # the idle rank was the reason
    verify = BatchFacts(True, ForwardMode.TARGET_VERIFY, 3, 6, 4, 50)
    decode_idle = BatchFacts(True, ForwardMode.DECODE, 0, 0, 1, 0)
    step = unpack([pack(verify), pack(decode_idle)])
    assert step.replay and step.bucket == 4 and step.idle_ranks == (1,)


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf")])
def test_sync_refuses_a_timeout_that_is_not_positive(timeout: float) -> None:
    from attnreg.graph_policy import DEFAULT_SYNC_TIMEOUT_S, sync

    assert DEFAULT_SYNC_TIMEOUT_S == 60.0
    with pytest.raises(ValueError, match="positive, finite number of seconds"):
        sync(BatchFacts(True, ForwardMode.DECODE, 1, 1, 1, 1), timeout=timeout)
