"""attnreg's replay gate inside sglang's prefill graph runner: the runtime half.

sglang 0.5.23 decides whether a prefill batch replays a captured graph in one
method, ``PrefillCudaGraphRunner.can_replay_locally``, called from two places
that must agree (or the data-parallel ranks' collectives mismatch):

* forward time, ``PrefillCudaGraphRunner.can_run_graph(forward_batch)``;
* schedule time, the data-parallel vote
  ``dp_attn._local_prefill_cuda_graph_vote(local_batch=ScheduleBatch, ...)``,
  whose answer every rank exchanges in ``MLPSyncBatchInfo.all_gather``.

The plugin wraps that one method (an AROUND hook of sglang's
``HookRegistry``) with :func:`prefill_verdict`, so both call sites get the
same function of the same arguments.  It answers, in order:

1. each sglang condition attnreg has no fact for (:data:`SGLANG_RUNTIME_RULES`:
   CP breakable graphs, LoRA's per-batch check, mixed batches, chunked
   prefix, the runner's captured slots, buckets and context bounds, ...),
   exactly as sglang states it, under its own ``sglang.runtime:<name>`` id;
2. attnreg's :class:`~attnreg.graph_policy.ReplayGate` on the plan of this
   server (``gate.*`` ids): input and replaced embeddings, hidden-state
   capture, prefill logprobs, LoRA under DP attention, and the prefix rule
   that replaces sglang's ``not is_cuda()`` (``gate.mha_companion_prefix``:
   by the backend's pinned method, not the vendor).  A fact the call site
   does not know (``prefix_lens=None`` for a decode batch voting as its
   one-token extend view, ``capture_hidden_mode=None`` at schedule time) is
   passed as unknown, never guessed.

The vote also carries attnreg's own row (``attnreg.graph_policy.pack``)
inside sglang's ``MLPSyncBatchInfo`` tensor (AFTER hooks on
``_get_local_tensor`` / ``_get_fallback_tensor``), and after sglang's
exchange every rank unpacks the same rows (``unpack``): the group replays
only if attnreg's sync agrees.

Where attnreg did not decide the prefill phase (a gap, see
:mod:`.steps`), every hook hands the call to sglang's own code, unchanged.
The plan reaches the scheduler and TP-worker processes pickled with the
server args (``ServerArgs.__reduce__`` keeps ``__dict__``, where the
outcome lives).
"""

from __future__ import annotations

import contextvars
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from attnreg.graph_policy import BatchFacts, HiddenCapture, ReplayBatch, ReplayGate, pack, unpack
from attnreg.registry.capabilities import ForwardMode, Phase

from .steps import outcome_of

__all__ = [
    "HOOKS",
    "SGLANG_RUNTIME_RULES",
    "PrefillVerdict",
    "ReplayCall",
    "RuntimeRule",
    "gate_of",
    "prefill_verdict",
    "replay_batch",
    "schedule_capture_hidden",
]

logger = logging.getLogger("attnreg.integrations.sglang")

_RUNNER = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner"
_DP = "sglang.srt.managers.scheduler_components.dp_attn"


@dataclass(frozen=True)
class ReplayCall:
    """The arguments of sglang's ``can_replay_locally`` (both call sites pass these).

    ``None`` means "not known at this call site" (sglang's convention for
    ``capture_hidden_mode`` and ``prefix_lens``).  ``site`` is ``"forward"``
    or ``"schedule"`` (for the log only: the verdict never reads it).
    ``seq_lens`` are the batch's ``seq_lens_cpu``, the numbers sglang's own
    context-bound check reads at that call site (None: not known).
    """

    batch_size: int
    num_tokens: int | None
    input_embeds: Any
    replace_embeds: Any
    prefix_lens: Any
    is_target_verify: bool
    capture_hidden_mode: Any
    return_logprob: bool
    lora_ineligible: bool = False
    is_mixed: bool = False
    batch_max_context_len: int | None = None
    contains_mm_inputs: bool = False
    site: str = "forward"
    seq_lens: tuple[int, ...] | None = None


@dataclass(frozen=True)
class RuntimeRule:
    """One sglang runtime condition attnreg has no fact for, kept as sglang states it.

    ``refuses(runner, call)`` is sglang's predicate; ``missing_fact`` what
    attnreg would need to decide it itself.
    """

    name: str
    message: str
    missing_fact: str
    refuses: Callable[[Any, ReplayCall], bool]

    @property
    def rule(self) -> str:
        return f"sglang.runtime:{self.name}"


def _cp_bcg(runner: Any, call: ReplayCall) -> bool:
    return bool(getattr(runner, "enable_cp_bcg_capture", False)) and \
        not runner.prefill_cp_bcg_input.allows_replay(call.batch_size, call.num_tokens,
                                                      call.prefix_lens,
                                                      call.contains_mm_inputs)


def _mm_side_channel(runner: Any, call: ReplayCall) -> bool:
    return call.contains_mm_inputs and bool(getattr(runner, "_qwen_bcg_hc_sidechannel", False)
                                            or getattr(runner, "_qwen_bcg_mtp_draft", False))


def _full_fa4_multimodal(runner: Any, call: ReplayCall) -> bool:
    return bool(runner._is_full_backend and runner._fa4_prefill and call.contains_mm_inputs)


def _full_request_slots(runner: Any, call: ReplayCall) -> bool:
    return bool(runner._is_full_backend and call.batch_size > runner._capture_req_slots)


def _attn_metadata_slots(runner: Any, call: ReplayCall) -> bool:
    limit = runner._captured_attn_metadata_max_bs
    return limit is not None and call.batch_size > limit


def _lora(runner: Any, call: ReplayCall) -> bool:
    return bool(call.lora_ineligible)


def _mixed(runner: Any, call: ReplayCall) -> bool:
    return call.is_mixed and bool(getattr(runner, "prefer_eager_mixed_prefill", False))


def _chunked_prefix(runner: Any, call: ReplayCall) -> bool:
    return bool(runner._has_uncapturable_chunked_prefix(call.prefix_lens))


def _target_verify(runner: Any, call: ReplayCall) -> bool:
    return call.is_target_verify


def _context_bound(runner: Any, call: ReplayCall) -> bool:
    bound = call.batch_max_context_len
    return any(limit is not None and (bound is None or bound > limit)
               for limit in (runner.max_context_size, runner.max_seq_len))


def _captured_tokens(runner: Any, call: ReplayCall) -> bool:
    from sglang.srt.model_executor.runner.prefill_cuda_graph_runner import (
        _MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR,
    )

    n = call.num_tokens
    if n is None:
        return False
    if n > runner.max_num_tokens:
        return True
    padded = runner._pad_to_bucket(n, runner.capture_num_tokens)
    return bool(padded > n * _MAX_PREFILL_CUDA_GRAPH_PADDING_FACTOR)


#: sglang 0.5.23's ``can_replay_locally`` conditions that attnreg has no fact
#: for, in sglang's order.  The rest of that method (input / replaced
#: embeddings, hidden-state capture, prefill logprobs, the ``not is_cuda()``
#: prefix rule) is attnreg's gate.
SGLANG_RUNTIME_RULES: tuple[RuntimeRule, ...] = (
    RuntimeRule("cp_bcg", "the CP breakable graph cannot replay this batch's CP split",
                "context-parallel split geometry", _cp_bcg),
    RuntimeRule("multimodal_side_channel", "multimodal inputs with Qwen's breakable-graph side "
                "channel or MTP draft", "model-specific side channels", _mm_side_channel),
    RuntimeRule("full_fa4_multimodal", "a full prefill graph bypasses FA4's image-mask guard",
                "full prefill graphs (attnreg models none)", _full_fa4_multimodal),
    RuntimeRule("full_request_slots", "more requests than the full graph's request slots",
                "full prefill graphs (attnreg models none)", _full_request_slots),
    RuntimeRule("attn_metadata_slots", "more requests than the captured attention metadata "
                "holds", "the attention backend's captured metadata size",
                _attn_metadata_slots),
    RuntimeRule("lora", "LoRA replay needs the adapters captured and sglang's LoRA manager's "
                "per-batch check (the schedule-time vote refuses any enable_lora)",
                "the LoRA manager's per-batch check", _lora),
    RuntimeRule("mixed_prefill", "the runner prefers eager mixed (prefill + decode) batches",
                "the runner's mixed-batch preference", _mixed),
    RuntimeRule("chunked_prefix", "the prefix needs more chunks than the full graph captured",
                "full prefill graphs' chunked-prefix variants", _chunked_prefix),
    RuntimeRule("target_verify", "prefill graphs are captured for EXTEND batches without "
                "speculative inputs", "which forward modes the prefill runner captured",
                _target_verify),
    RuntimeRule("context_bound", "the batch's longest context is unknown or above the bound "
                "the prefill graphs were captured for", "the runner's captured context bound",
                _context_bound),
    RuntimeRule("captured_tokens", "more tokens than the largest captured bucket, or padding "
                "above sglang's factor", "the token buckets the runner actually captured",
                _captured_tokens),
)


@dataclass(frozen=True)
class PrefillVerdict:
    """What :func:`prefill_verdict` decided.

    ``rule`` is the first refusing rule (``sglang.runtime:<name>`` or a
    ``gate.*`` id) or ``gate.ok``.  ``facts`` is attnreg's row for the
    data-parallel exchange, its ``eligible`` the combined answer.
    """

    replay: bool
    rule: str
    message: str
    facts: BatchFacts


def _hidden(mode: Any) -> HiddenCapture | None:
    return None if mode is None else HiddenCapture(int(mode))


def _prefix(prefix_lens: Any) -> tuple[int, ...] | None:
    if prefix_lens is None:
        return None
    if hasattr(prefix_lens, "tolist"):
        prefix_lens = prefix_lens.tolist()
    return tuple(int(n) for n in prefix_lens)


def replay_batch(runner: Any, call: ReplayCall) -> ReplayBatch:
    """The :class:`ReplayBatch` attnreg's gate sees for one call (unknown stays unknown).

    The prefill runner serves EXTEND (and MIXED: an extend batch whose
    decode requests are one-token extends) batches.  Where the call's token
    count and lengths disagree (sglang folds encoder replay rows into the
    token count of some models), the disagreeing ``seq_lens`` are dropped,
    never a scheduler crash: the gate answers from the facts that remain
    (or ``gate.fact_missing``), at both call sites alike.
    """
    try:
        return _replay_batch(runner, call, call.seq_lens)
    except ValueError:
        return _replay_batch(runner, call, None)


def _replay_batch(runner: Any, call: ReplayCall, seq_lens: tuple[int, ...] | None
                  ) -> ReplayBatch:
    return ReplayBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=int(call.batch_size),
        num_tokens=call.num_tokens,
        prefix_lens=_prefix(call.prefix_lens),  # type: ignore[arg-type]
        lora=bool(getattr(runner, "enable_lora", False)),
        has_input_embeds=call.input_embeds is not None,
        has_replace_embeds=call.replace_embeds is not None,
        capture_hidden=_hidden(call.capture_hidden_mode),  # type: ignore[arg-type]
        return_logprob=bool(call.return_logprob),
        seq_lens=seq_lens,
    )


def gate_of(runner: Any) -> ReplayGate | None:
    """attnreg's gate for this prefill runner, or None when attnreg did not decide prefill.

    Built once per runner from the plan on ``runner.model_runner.server_args``
    (pickled there from the launcher) with the runner's own captured
    hidden-state mode and whether it runs an eager logprob tail.
    """
    cached = getattr(runner, "_attnreg_gate", False)
    if cached is not False:
        return cached  # type: ignore[no-any-return]
    outcome = outcome_of(runner.model_runner.server_args)
    gate = None
    if outcome is not None and outcome.plan is not None and Phase.PREFILL in outcome.decided:
        gate = ReplayGate(outcome.plan,
                          captured_hidden=HiddenCapture(int(runner.capture_hidden_mode)),
                          eager_logprob_tail=bool(runner._uses_eager_prefill_tail()))
    runner._attnreg_gate = gate
    return gate


def prefill_verdict(runner: Any, call: ReplayCall, gate: ReplayGate) -> PrefillVerdict:
    """The one answer for both call sites: sglang's kept conditions, then attnreg's gate."""
    batch = replay_batch(runner, call)
    facts = gate.facts(batch)
    for rule in SGLANG_RUNTIME_RULES:
        if rule.refuses(runner, call):
            return PrefillVerdict(False, rule.rule, f"{rule.message} (sglang's condition, "
                                  f"kept: attnreg has no fact for {rule.missing_fact})",
                                  replace(facts, eligible=False, bucket=None))
    reason = facts.reason
    assert reason is not None  # ReplayGate.facts always gives the reason
    return PrefillVerdict(facts.eligible, reason.rule, reason.message, facts)


# --- the hooks --------------------------------------------------------------------------

@dataclass
class _Site:
    """What this thread's current call site knows beyond ``can_replay_locally``'s arguments.

    ``site`` is None outside both call sites (a direct call: sglang's arguments only).
    ``row`` is the attnreg row this rank sends in the vote's ``MLPSyncBatchInfo``,
    ``fingerprint`` the gate's (every row of the exchange carries it).
    """

    site: str | None = None
    seq_lens: tuple[int, ...] | None = None
    capture_hidden: int | None = None
    row: BatchFacts | None = None
    attnreg_decides: bool = False
    fingerprint: Any = None


_SITE: contextvars.ContextVar[_Site] = contextvars.ContextVar("attnreg_sglang_site")


def _state() -> _Site:
    try:
        return _SITE.get()
    except LookupError:
        state = _Site()
        _SITE.set(state)
        return state


def _host_lens(values: Any) -> tuple[int, ...] | None:
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    return tuple(int(v) for v in values)


def _idle_facts(fingerprint: Any) -> BatchFacts:
    """The row of a rank with no batch (and of sglang's inactive slots)."""
    return BatchFacts(eligible=True, forward_mode=ForwardMode.EXTEND, batch_size=0,
                      num_tokens=0, max_seq_len=0, fingerprint=fingerprint)


def schedule_capture_hidden(local_batch: Any, model_runner: Any) -> int | None:
    """The hidden-state mode the forward of ``local_batch`` will capture, by sglang's own
    rule (``ForwardBatch.init_new`` without an override); None when it cannot be read."""
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        get_required_capture_hidden_mode,
        get_server_return_hidden_states_mode,
    )

    try:
        request = CaptureHiddenMode.NULL if model_runner.is_draft_worker else max(
            local_batch.return_hidden_states_mode, get_server_return_hidden_states_mode())
        return int(get_required_capture_hidden_mode(request, local_batch.spec_info))
    except (AttributeError, RuntimeError):  # sglang's config not published: not known
        return None


def _can_replay_locally(original: Callable[..., bool], runner: Any, **kwargs: Any) -> bool:
    gate = gate_of(runner)
    if gate is None:
        return original(runner, **kwargs)
    state = _state()
    if kwargs.get("capture_hidden_mode") is None and state.capture_hidden is not None:
        kwargs["capture_hidden_mode"] = state.capture_hidden
    call = ReplayCall(**kwargs, site=state.site or "direct", seq_lens=state.seq_lens)
    verdict = prefill_verdict(runner, call, gate)
    if state.site == "schedule":
        state.row = verdict.facts
    logger.debug("attnreg: prefill %s (%s call): %s: %s",
                 "replays" if verdict.replay else "runs eagerly", call.site, verdict.rule,
                 verdict.message)
    return verdict.replay


def _can_run_graph(original: Callable[..., bool], runner: Any, *args: Any,
                   **kwargs: Any) -> bool:
    """Around sglang's forward-time check: the batch's host lengths reach the gate."""
    forward_batch = args[0] if args else kwargs["forward_batch"]
    state = _state()
    saved = (state.site, state.seq_lens, state.capture_hidden)
    state.site, state.seq_lens, state.capture_hidden = (
        "forward", _host_lens(forward_batch.seq_lens_cpu), None)
    try:
        return original(runner, *args, **kwargs)
    finally:
        state.site, state.seq_lens, state.capture_hidden = saved


def _local_vote(original: Callable[..., bool], *args: Any, **kwargs: Any) -> bool:
    """Around sglang's vote: the ScheduleBatch's facts reach the gate, and the row this
    rank sends in ``MLPSyncBatchInfo`` is recorded."""
    bound = inspect.signature(inspect.unwrap(original)).bind(*args, **kwargs).arguments
    local = bound.get("local_batch")
    runner = bound.get("prefill_graph_runner")
    state = _state()
    gate = gate_of(runner) if runner is not None and hasattr(runner, "model_runner") else None
    state.attnreg_decides = gate is not None
    state.fingerprint = gate.fingerprint if gate is not None else None
    idle = local is None or local.forward_mode.is_idle()
    # A busy rank whose vote never reaches can_replay_locally (no prefill graph
    # runner, a decode batch not eligible for the conversion) is ineligible.
    state.row = _idle_facts(state.fingerprint) if idle else BatchFacts(
        eligible=False, forward_mode=ForwardMode.EXTEND, batch_size=local.batch_size(),
        fingerprint=state.fingerprint)
    saved = (state.site, state.seq_lens, state.capture_hidden)
    if not idle:
        state.seq_lens = _host_lens(local.seq_lens_cpu)
        state.capture_hidden = schedule_capture_hidden(local, runner.model_runner) \
            if gate is not None else None
    state.site = "schedule"
    try:
        return original(*args, **kwargs)
    finally:
        state.site, state.seq_lens, state.capture_hidden = saved


def _with_row(tensor: Any, info: Any, facts: BatchFacts) -> Any:
    import torch

    info._attnreg_width = int(tensor.numel())
    row = torch.tensor(pack(facts), device=tensor.device, dtype=tensor.dtype)
    return torch.cat([tensor, row])


def _local_tensor(result: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
    state = _state()
    return _with_row(result, info, state.row or _idle_facts(state.fingerprint))


def _fallback_tensor(result: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
    return _with_row(result, info, _idle_facts(_state().fingerprint))


def _after_all_gather(result: Any, info: Any, *args: Any, **kwargs: Any) -> Any:
    """Every rank unpacks the same gathered attnreg rows: the same answer or the same
    :class:`~attnreg.graph_policy.SyncError` (another plan's fingerprint)."""
    width = getattr(info, "_attnreg_width", None)
    if width is None or info.tp0_info_cpu is None:
        return result
    agreed = unpack(info.tp0_info_cpu[:, width:].tolist())
    info.attnreg_agreed = agreed
    if _state().attnreg_decides:
        info.can_run_prefill_cuda_graph = bool(info.can_run_prefill_cuda_graph
                                               and agreed.replay)
    return result


#: sglang target -> (hook type name, hook), registered by the plugin with sglang's
#: ``HookRegistry``.
HOOKS: dict[str, tuple[str, Callable[..., Any]]] = {
    f"{_RUNNER}.can_replay_locally": ("AROUND", _can_replay_locally),
    f"{_RUNNER}.can_run_graph": ("AROUND", _can_run_graph),
    f"{_DP}._local_prefill_cuda_graph_vote": ("AROUND", _local_vote),
    f"{_DP}.MLPSyncBatchInfo._get_local_tensor": ("AFTER", _local_tensor),
    f"{_DP}.MLPSyncBatchInfo._get_fallback_tensor": ("AFTER", _fallback_tensor),
    f"{_DP}.MLPSyncBatchInfo.all_gather": ("AFTER", _after_all_gather),
}
