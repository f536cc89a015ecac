"""The runtime half: attnreg's gate decides sglang's prefill replay at both call sites.

sglang 0.5.23's real classes on a CPU: a ``PrefillCudaGraphRunner`` built
without capturing (its real ``can_replay_locally`` / ``can_run_graph``, the
state set as its ``__init__`` sets it for a breakable runner), real
``ForwardBatch`` objects (forward time) and ``ScheduleBatch`` objects through
``dp_attn._local_prefill_cuda_graph_vote`` and ``MLPSyncBatchInfo`` (schedule
time).  The plugin is loaded by sglang's ``load_plugins()``; "attnreg not
deciding" is the same process with server args that carry no attnreg plan,
which is what every hook then hands to sglang's own code.
"""

from __future__ import annotations

import inspect
import pickle
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest

from .conftest import SKIP_REASON

pytest.importorskip("sglang", reason=SKIP_REASON)

import torch

from attnreg.graph_policy import SyncError
from attnreg.integrations.sglang import runtime_gate, steps
from attnreg.registry.capabilities import Phase

from . import _sglang_env

LOGGER = "attnreg.integrations.sglang"


@pytest.fixture(scope="module")
def server_args(plugin_on: None, models: dict[str, Path]) -> Any:
    """DeepSeek-V3 on an H200 with triton: attnreg decides both phases (MLA pinned under
    breakable, so prefix batches may replay); sglang's config published as in a scheduler."""
    from sglang.srt.runtime_context import publish

    result = _sglang_env.run_scenario(_sglang_env.SCENARIO_BY_NAME["dsv3_triton_h200"], models)
    outcome = steps.outcome_of(result["server_args"])
    assert outcome is not None and Phase.PREFILL in outcome.decided
    with _sglang_env.simulated_gpu(90):
        publish(result["server_args"], role="scheduler")
    _ANY_SERVER[0] = result["server_args"]
    return result["server_args"]


class _NoPlan:
    """Server args without an attnreg outcome: the plugin off, or prefill a gap."""


#: The resolved server whose ModelConfig the vote reads (the same model with or
#: without attnreg's plan).
_ANY_SERVER: list[Any] = [None]


def make_runner(server_args: Any, **state: Any) -> Any:
    """sglang's PrefillCudaGraphRunner with the state its __init__ gives a breakable runner
    of a DeepSeek model (MHA companion layers), without capturing anything."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
        PrefillCudaGraphRunner,
        get_prefill_num_tokens_to_capture,
    )

    runner = PrefillCudaGraphRunner.__new__(PrefillCudaGraphRunner)
    lora_ok = state.pop("lora_batch_ok", True)
    buckets = get_prefill_num_tokens_to_capture([4, 8, 16, 32, 64, 128, 256])
    values: dict[str, Any] = dict(
        model_runner=SimpleNamespace(
            server_args=server_args, is_draft_worker=False, attn_backend=object(),
            lora_manager=SimpleNamespace(can_use_prefill_cuda_graph=lambda fb: lora_ok)),
        enable_cp_bcg_capture=False, prefill_cp_bcg_input=None,
        _qwen_bcg_hc_sidechannel=False, _qwen_bcg_mtp_draft=False, _is_full_backend=False,
        _fa4_prefill=False, _capture_req_slots=1, _captured_attn_metadata_max_bs=None,
        enable_lora=False, _capture_lora=False, prefill_backend_name=Backend.BREAKABLE,
        has_mha_companion_layers=True, _capture_chunked_prefix=False,
        capture_hidden_mode=CaptureHiddenMode.NULL, max_context_size=None, max_seq_len=None,
        capture_num_tokens=buckets, max_num_tokens=max(buckets),
        _backend_can_run_prefill_cuda_graph=None, _backend_vote_prefill_cuda_graph=None,
    )
    values.update(state)
    for name, value in values.items():
        setattr(runner, name, value)
    return runner


def forward_batch(prefix: list[int], extend: list[int], **fields: Any) -> Any:
    """sglang's ForwardBatch of an EXTEND (or ``forward_mode=``) prefill, host lengths and
    the hidden-state mode set (``ForwardBatch.init_new`` always sets it)."""
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    seq = [p + e for p, e in zip(prefix, extend)]
    tokens = sum(extend)
    values: dict[str, Any] = dict(
        forward_mode=ForwardMode.EXTEND, batch_size=len(seq),
        input_ids=torch.zeros(tokens, dtype=torch.long),
        req_pool_indices=torch.arange(len(seq)), seq_lens=torch.tensor(seq),
        out_cache_loc=torch.zeros(tokens, dtype=torch.long), seq_lens_sum=sum(seq),
        seq_lens_cpu=torch.tensor(seq), extend_prefix_lens_cpu=prefix,
        extend_seq_lens_cpu=extend, extend_num_tokens=tokens,
        capture_hidden_mode=CaptureHiddenMode.NULL)
    values.update(fields)
    return ForwardBatch(**values)


def schedule_batch(prefix: list[int], extend: list[int], mode: str = "EXTEND",
                   **fields: Any) -> Any:
    """sglang's ScheduleBatch as the scheduler holds it when it votes."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    batch = ScheduleBatch(reqs=[SimpleNamespace(beam_group=None) for _ in prefix])
    batch.forward_mode = ForwardMode[mode]
    batch.prefix_lens = prefix
    batch.extend_lens = extend
    batch.extend_num_tokens = sum(extend)
    batch.seq_lens_cpu = torch.tensor([p + e for p, e in zip(prefix, extend)])
    for name, value in fields.items():
        setattr(batch, name, value)
    return batch


def vote(runner: Any, batch: Any) -> bool:
    """The schedule-time call site, as ``prepare_mlp_sync_batch_raw`` makes it."""
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.managers.scheduler_components import dp_attn
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    model_config = model_config_of(_ANY_SERVER[0])

    tokens = 0 if batch is None else (batch.batch_size() if batch.forward_mode.is_decode()
                                      else batch.extend_num_tokens)
    return dp_attn._local_prefill_cuda_graph_vote(
        local_batch=batch, num_tokens=tokens, prefill_graph_runner=runner,
        coordinated_prefill=True, breakable_prefill=True,
        spec_algorithm=SpeculativeAlgorithm.NONE, model_config=model_config)


def rules_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage().split(": ")[2] for r in caplog.records
            if r.name == LOGGER and r.getMessage().startswith("attnreg: prefill ")]


@pytest.fixture
def debug_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level("DEBUG", logger=LOGGER)
    return caplog


def test_load_plugins_installs_the_runtime_hooks(plugin_on: None) -> None:
    import pkgutil

    for target in runtime_gate.HOOKS:
        installed = pkgutil.resolve_name(target)
        assert inspect.unwrap(installed) is not installed, f"{target} was not hooked"


def test_a_prefix_batch_replays_by_the_pinned_method_not_by_cuda(
        server_args: Any, debug_log: pytest.LogCaptureFixture) -> None:
    """sglang's ``not is_cuda()`` rule (this CPU machine is not CUDA) refuses a prefix batch
    under breakable; attnreg's triton pins MLA there, so it replays, at both call sites."""
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
        PrefillCudaGraphRunner,
    )

    sglang_own = make_runner(_NoPlan())
    assert not sglang_own.can_run_graph(forward_batch([8, 0], [4, 4]))
    assert not vote(sglang_own, schedule_batch([8, 0], [4, 4]))
    runner = make_runner(server_args)
    assert runner.can_run_graph(forward_batch([8, 0], [4, 4]))
    assert vote(runner, schedule_batch([8, 0], [4, 4]))
    assert rules_logged(debug_log) == ["gate.ok", "gate.ok"]
    # The unwrapped method is sglang's own, and it still says no.
    original = inspect.unwrap(PrefillCudaGraphRunner.can_replay_locally)
    assert not original(runner, batch_size=2, num_tokens=8, input_embeds=None,
                        replace_embeds=None, prefix_lens=[8, 0], is_target_verify=False,
                        capture_hidden_mode=None, return_logprob=False)


def test_a_lora_prefill_batch_runs_eagerly(server_args: Any,
                                          debug_log: pytest.LogCaptureFixture) -> None:
    """sglang: LoRA replays need the adapters captured and the LoRA manager's per-batch
    check at forward time; the vote refuses any enable_lora."""
    from attnreg.integrations.sglang.adapter import plan_for

    outcome = steps.outcome_of(server_args)
    assert outcome is not None
    facts = replace(outcome.facts, features=replace(outcome.facts.features, lora=True))
    with_lora = SimpleNamespace(_attnreg_outcome=replace(outcome, plan=plan_for(facts)))
    refused = make_runner(with_lora, enable_lora=True, _capture_lora=True,
                          lora_batch_ok=False)
    assert not refused.can_run_graph(forward_batch([0], [8]))
    assert rules_logged(debug_log)[-1] == "sglang.runtime:lora"
    allowed = make_runner(with_lora, enable_lora=True, _capture_lora=True)
    assert allowed.can_run_graph(forward_batch([0], [8]))
    assert not vote(allowed, schedule_batch([0], [8]))
    assert rules_logged(debug_log)[-1] == "sglang.runtime:lora"


def test_an_unknown_context_bound_is_refused(server_args: Any) -> None:
    runner = make_runner(server_args, max_seq_len=64)
    gate = runtime_gate.gate_of(runner)
    assert gate is not None
    call = runtime_gate.ReplayCall(batch_size=1, num_tokens=8, input_embeds=None,
                                   replace_embeds=None, prefix_lens=[0],
                                   is_target_verify=False, capture_hidden_mode=0,
                                   return_logprob=False, batch_max_context_len=None,
                                   seq_lens=(8,))
    verdict = runtime_gate.prefill_verdict(runner, call, gate)
    assert (verdict.replay, verdict.rule) == (False, "sglang.runtime:context_bound")
    assert not verdict.facts.eligible
    within = runtime_gate.prefill_verdict(runner, replace(call, batch_max_context_len=8), gate)
    assert within.replay and within.rule == "gate.ok"
    # Both call sites pass the bound sglang computes from seq_lens_cpu.
    assert runner.can_run_graph(forward_batch([0], [8]))
    assert not runner.can_run_graph(forward_batch([60], [8]))
    assert not vote(runner, schedule_batch([60], [8]))


def _cp_input(allows: bool) -> Any:
    return SimpleNamespace(allows_replay=lambda *args: allows)


@pytest.mark.parametrize(("state", "call", "rule"), [
    ({"enable_cp_bcg_capture": True, "prefill_cp_bcg_input": _cp_input(False)}, {},
     "sglang.runtime:cp_bcg"),
    ({"prefer_eager_mixed_prefill": True}, {"is_mixed": True}, "sglang.runtime:mixed_prefill"),
    ({"_capture_chunked_prefix": True, "_prefix_capture_variants": [1],
      "_prefix_chunk_len": 4}, {"prefix_lens": [100]}, "sglang.runtime:chunked_prefix"),
    ({"_captured_attn_metadata_max_bs": 0}, {}, "sglang.runtime:attn_metadata_slots"),
    ({}, {"is_target_verify": True}, "sglang.runtime:target_verify"),
    ({}, {"num_tokens": 5000}, "sglang.runtime:captured_tokens"),
    ({}, {"input_embeds": object()}, "gate.input_embeds"),
    ({}, {"replace_embeds": object()}, "gate.replace_embeds"),
    ({}, {"capture_hidden_mode": 2}, "gate.hidden_capture"),
    ({}, {"capture_hidden_mode": None}, "gate.fact_missing"),
])
def test_each_condition_has_its_rule_id(server_args: Any, state: dict[str, Any],
                                        call: dict[str, Any], rule: str) -> None:
    runner = make_runner(server_args, **state)
    gate = runtime_gate.gate_of(runner)
    assert gate is not None
    base = dict(batch_size=1, num_tokens=8, input_embeds=None, replace_embeds=None,
                prefix_lens=[0], is_target_verify=False, capture_hidden_mode=0,
                return_logprob=False)
    args = {**base, **call}
    args["seq_lens"] = (args["prefix_lens"][0] + args["num_tokens"],)
    verdict = runtime_gate.prefill_verdict(runner, runtime_gate.ReplayCall(**args), gate)
    assert (verdict.replay, verdict.rule) == (False, rule)


def test_mixed_batches_replay_as_extend_without_sglangs_preference(server_args: Any) -> None:
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    runner = make_runner(server_args)
    assert runner.can_run_graph(forward_batch([6, 9], [4, 1], forward_mode=ForwardMode.MIXED))
    assert vote(runner, schedule_batch([6, 9], [4, 1], mode="MIXED"))


def test_the_backend_vote_still_holds(server_args: Any) -> None:
    """sglang's attention-backend checks sit outside can_replay_locally and are kept."""
    runner = make_runner(server_args, _backend_vote_prefill_cuda_graph=lambda batch: False,
                         _backend_can_run_prefill_cuda_graph=lambda fb: False)
    assert not vote(runner, schedule_batch([0], [8]))
    assert not runner.can_run_graph(forward_batch([0], [8]))


def test_a_decode_batch_votes_as_its_one_token_extend_view(
        server_args: Any, debug_log: pytest.LogCaptureFixture) -> None:
    """sglang's decode->extend conversion votes with prefix_lens=None; triton pins MLA, so
    the prefix is not needed and the converted batch may replay."""
    runner = make_runner(server_args)
    assert vote(runner, schedule_batch([30, 40], [1, 1], mode="DECODE"))
    assert rules_logged(debug_log)[-1] == "gate.ok"


def test_schedule_time_hidden_states_come_from_the_schedule_batch(
        server_args: Any, debug_log: pytest.LogCaptureFixture) -> None:
    """sglang votes with capture_hidden_mode=None; the bridge gives the gate the mode the
    forward will capture, by sglang's own rule, so both call sites answer alike."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    runner = make_runner(server_args)
    plain = schedule_batch([0], [8])
    assert plain.return_hidden_states_mode == CaptureHiddenMode.NULL
    assert vote(runner, plain)
    wants = schedule_batch([0], [8], return_hidden_states_mode=CaptureHiddenMode.FULL)
    assert not vote(runner, wants)
    assert not runner.can_run_graph(forward_batch([0], [8],
                                                  capture_hidden_mode=CaptureHiddenMode.FULL))
    assert rules_logged(debug_log)[-2:] == ["gate.hidden_capture", "gate.hidden_capture"]


CASES = {
    "plain": (([0, 0], [8, 4]), {}, {}),
    "prefix": (([16, 3], [8, 4]), {}, {}),
    "embeds": (([0], [8]), {"input_embeds": torch.zeros(8, 4)}, {"input_embeds": True}),
    "logprob": (([0], [8]), {"return_logprob": True}, {"return_logprob": True}),
    "too_many_tokens": (([0], [300]), {}, {}),
    "padding_waste": (([0], [65]), {}, {}),
}


@pytest.mark.parametrize("plan", ["attnreg", "sglang"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_both_call_sites_agree(server_args: Any, case: str, plan: str) -> None:
    (prefix, extend), fwd, sched = CASES[case]
    runner = make_runner(server_args if plan == "attnreg" else _NoPlan())
    sched = {k: (torch.zeros(1) if k == "input_embeds" else v) for k, v in sched.items()}
    assert runner.can_run_graph(forward_batch(prefix, extend, **fwd)) == \
        vote(runner, schedule_batch(prefix, extend, **sched))


# --- the data-parallel exchange inside MLPSyncBatchInfo ----------------------------------

def _sync_info(num_tokens: int, can_run_prefill: bool, num_dp_ranks: int = 2) -> Any:
    from sglang.srt.managers.scheduler_components.dp_attn import MLPSyncBatchInfo
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return MLPSyncBatchInfo(
        num_dp_ranks=num_dp_ranks, tp_size=1, cp_size=1, num_tokens=num_tokens,
        num_tokens_for_logprob=num_tokens, can_run_decode_cuda_graph=False,
        can_run_draft_cuda_graph=True, can_run_prefill_cuda_graph=can_run_prefill,
        is_extend_in_batch=num_tokens > 0, local_can_run_tbo=False,
        local_forward_mode=(ForwardMode.EXTEND if num_tokens else ForwardMode.IDLE).value)


def _rank_row(runner: Any, batch: Any) -> tuple[bool, Any]:
    """One rank's vote and the local tensor it sends (sglang's row + attnreg's)."""
    eligible = vote(runner, batch)
    info = _sync_info(0 if batch is None else batch.extend_num_tokens, eligible)
    return eligible, info._get_local_tensor(device="cpu")


def _gather(runner: Any, batch: Any, rows: list[Any]) -> Any:
    """Rank 0's all_gather, the collective simulated by copying every rank's row."""
    from sglang.srt.managers.scheduler_components import dp_attn

    def exchange(global_flat: Any, local_row: Any, group: Any) -> None:
        global_flat.view(len(rows), -1).copy_(torch.stack(rows))

    eligible = vote(runner, batch)
    info = _sync_info(batch.extend_num_tokens, eligible, num_dp_ranks=len(rows))
    parallel = SimpleNamespace(tp_group=SimpleNamespace(
        active_ranks_cpu=torch.ones(len(rows), dtype=torch.int32)))
    with mock.patch.object(dp_attn, "exchange_sync_rows", exchange), \
            mock.patch.object(dp_attn, "get_parallel", return_value=parallel):
        info.all_gather(device="cpu", group=None)
    return info


def test_the_vote_carries_attnregs_row_inside_mlp_sync_batch_info(server_args: Any) -> None:
    from attnreg.graph_policy import PACKED_WIDTH

    runner = make_runner(server_args)
    _, busy = _rank_row(runner, schedule_batch([0], [8]))
    _, other = _rank_row(runner, schedule_batch([4], [4]))
    info = _gather(runner, schedule_batch([0], [8]), [busy, other])
    assert info.can_run_prefill_cuda_graph
    assert info.attnreg_agreed.replay and info.attnreg_agreed.bucket == 8
    assert info._attnreg_width + PACKED_WIDTH == busy.numel()
    # sglang's own columns are untouched by the extra ones.
    assert info.global_num_tokens == [8, 4]


def test_an_idle_dp_rank_forces_eager(server_args: Any) -> None:
    """sglang's idle rank votes permissively and its forward-time _has_inactive_dp_rank
    forces eager; attnreg's sync already answers eager at schedule time."""
    runner = make_runner(server_args)
    _, busy = _rank_row(runner, schedule_batch([0], [8]))
    idle_vote, idle = _rank_row(runner, None)
    assert idle_vote  # sglang's permissive idle vote
    info = _gather(runner, schedule_batch([0], [8]), [busy, idle])
    assert not info.can_run_prefill_cuda_graph
    assert info.attnreg_agreed.idle_ranks == (1,)
    # Without attnreg's plan the schedule-time answer is sglang's (replay), and its
    # forward-time check is what turns it eager.
    own = make_runner(_NoPlan())
    _, busy_own = _rank_row(own, schedule_batch([0], [8]))
    _, idle_own = _rank_row(own, None)
    assert _gather(own, schedule_batch([0], [8]), [busy_own, idle_own]) \
        .can_run_prefill_cuda_graph


def test_another_plan_on_a_rank_raises_sync_error(server_args: Any,
                                                  models: dict[str, Path]) -> None:
    runner = make_runner(server_args)
    other_args = _sglang_env.run_scenario(_sglang_env.SCENARIO_BY_NAME["dsv3_flashinfer_h200"],
                                          models)["server_args"]
    _, mine = _rank_row(runner, schedule_batch([0], [8]))
    _, theirs = _rank_row(make_runner(other_args), schedule_batch([0], [8]))
    with pytest.raises(SyncError, match="fingerprint"):
        _gather(runner, schedule_batch([0], [8]), [mine, theirs])


# --- the plan reaches the processes where the gate runs ---------------------------------

def test_the_plan_reaches_a_scheduler_process_pickled_with_the_server_args(
        server_args: Any) -> None:
    """sglang spawns its schedulers with the ServerArgs pickled (ServerArgs.__reduce__
    keeps __dict__, where the outcome lives); the gate rebuilt there has the launcher's
    fingerprint, which every rank's sync row then proves."""
    here = runtime_gate.gate_of(make_runner(server_args))
    there = runtime_gate.gate_of(make_runner(pickle.loads(pickle.dumps(server_args))))
    assert here is not None and there is not None
    assert str(there.fingerprint) == str(here.fingerprint)


def test_a_prefill_phase_left_to_sglang_has_no_attnreg_gate(server_args: Any) -> None:
    outcome = steps.outcome_of(server_args)
    assert outcome is not None
    decode_only = SimpleNamespace(_attnreg_outcome=replace(outcome,
                                                           decided=frozenset({Phase.DECODE})))
    runner = make_runner(decode_only)
    assert runtime_gate.gate_of(runner) is None
    assert not runner.can_run_graph(forward_batch([8], [4]))  # sglang's not-is_cuda rule


def test_the_doc_lists_every_kept_condition_and_bridge_id() -> None:
    from attnreg.integrations.sglang.decisions import BRIDGE_RULES

    doc = (Path(__file__).resolve().parents[3] / "docs" / "integrations" / "sglang.md").read_text()
    assert [r.rule for r in runtime_gate.SGLANG_RUNTIME_RULES if f"`{r.rule}`" not in doc] == []
    assert [rule for rule in BRIDGE_RULES if f"`{rule}`" not in doc] == []


def test_lengths_that_disagree_with_the_token_count_are_not_guessed(server_args: Any) -> None:
    """sglang folds encoder replay rows into some models' token counts: the lengths then
    disagree with num_tokens.  The disagreeing seq_lens are dropped (no crash in the
    scheduler); the gate answers from the facts that remain."""
    runner = make_runner(server_args)
    gate = runtime_gate.gate_of(runner)
    assert gate is not None
    call = runtime_gate.ReplayCall(batch_size=1, num_tokens=12, input_embeds=None,
                                   replace_embeds=None, prefix_lens=[0],
                                   is_target_verify=False, capture_hidden_mode=0,
                                   return_logprob=False, seq_lens=(8,))
    verdict = runtime_gate.prefill_verdict(runner, call, gate)
    assert verdict.replay and verdict.facts.max_seq_len == 12  # prefix + tokens, not 8
