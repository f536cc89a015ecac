"""RULES: every rule id the graph policy can emit, with what it means.

The single source of truth for rule ids.  Every :class:`Decision`,
:class:`Violation` and :class:`ReplayReason`, and every rule-tagged
:class:`~attnreg.registry.GraphPolicyError` reason, carries an id listed
here (the constructors refuse any other); ``tests/policy/test_rule_ids.py``
checks that every entry is emitted somewhere, and the rule tables of
docs/policy.md are generated from this module (``scripts/build_docs.py``).

An entry says how binding the rule is (its severities), where the fact
behind it comes from (its sources), what it reads and what it does.  A soft
rule that yields to a user's lock is recorded at INFO severity; that is
not listed per rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from .features import FEATURE_RULES, FeatureRule
from .severity import Severity, Source

__all__ = ["RULES", "RuleInfo", "RuleKind", "check_rule_id", "rule_info", "tagged"]

#: What part of the policy emits a rule: a Decision of the plan (startup), a
#: reason of GraphPolicyError (no plan at all), a feature rule (FEATURE_RULES,
#: recorded as a Decision too), a ReplayReason of the gate (per batch), or the
#: data-parallel agreement overriding the local gate (per step: a count key of the
#: graph session, ``runtime.SessionCounts``).
RuleKind = Literal["plan", "error", "feature", "gate", "sync"]
PLAN: RuleKind = "plan"
ERROR: RuleKind = "error"
FEATURE: RuleKind = "feature"
GATE: RuleKind = "gate"
SYNC: RuleKind = "sync"


@dataclass(frozen=True)
class RuleInfo:
    """One rule id and its meaning.

    Parameters
    ----------
    id
        the stable id (``"backend.high_cost_fallback"``).
    kind
        ``"plan"``, ``"error"``, ``"feature"``, ``"gate"`` or ``"sync"``.
    severities
        the severities the rule's records carry (first = the usual one); for a
        gate rule: HARD when the graph cannot serve the batch, SOFT when
        eager is only expected to be faster, INFO for ``gate.ok``.
    sources
        where the fact behind it comes from.
    reads
        the declared facts, config or batch fields it reads.
    description
        what it does, in one line.
    """

    id: str
    kind: RuleKind
    severities: tuple[Severity, ...]
    sources: tuple[Source, ...]
    reads: str
    description: str

    @property
    def severity(self) -> str:
        """The severities as docs show them (``"soft / info"``)."""
        return " / ".join(s.value for s in self.severities)

    @property
    def source(self) -> str:
        """The sources as docs show them (``"platform / user"``)."""
        return " / ".join(s.value for s in self.sources)


_H, _S, _I = Severity.HARD, Severity.SOFT, Severity.INFO


def _rule(rule_id: str, kind: RuleKind, severities: tuple[Severity, ...] | Severity,
          sources: tuple[Source, ...] | Source, reads: str, description: str) -> RuleInfo:
    sev = severities if isinstance(severities, tuple) else (severities,)
    src = sources if isinstance(sources, tuple) else (sources,)
    return RuleInfo(rule_id, kind, sev, src, reads, description)


_PLAN_RULES = (
    _rule("default.mode", PLAN, _I, (Source.PLATFORM, Source.USER),
          "platform vendor; an unlocked `GraphConfig` mode",
          "the mode asked for before any rule: the platform default, or the engine's "
          "unlocked value (source user)"),
    _rule("user.locked", PLAN, _I, Source.USER, "`GraphConfig.locked`",
          "the user set this phase's mode: soft rules yield to it, hard rules must allow it"),
    _rule("user.backend", PLAN, _I, Source.USER, "the backend named for the phase",
          "the user chose the phase's backend"),
    _rule("backend.selected", PLAN, _I, Source.BACKEND,
          "availability, kernel acceptance (`check_request`: methods, KV dtype, heads, page "
          "size, context), the requested mode's hard rules, verify graphs, declared `priority`",
          "the default backend, chosen by need: among the available ones whose kernels accept "
          "the model and engine, those whose declaration lets the requested mode run (and, "
          "with speculative decoding, whose full graphs serve target-verify batches) first, "
          "then the highest declared priority; the message names each higher-priority backend "
          "passed over and why"),
    _rule("platform.no_device_graphs", PLAN, _H, Source.PLATFORM,
          "`Platform.has_device_graphs` (the platform table, `PLATFORM_TRAITS`)",
          "every capture mode (`full`, `breakable`, `tc_piecewise`) needs device graphs; cpu "
          "has none (npu and xpu have them: there each backend's declaration decides)"),
    _rule("engine.mode_unsupported", PLAN, _H, Source.ENGINE,
          "`EngineFacts.prefill_graph_modes` / `decode_graph_modes`",
          "a mode the host engine does not have is never planned; a lock on it fails startup"),
    _rule("backend.capture_unsupported", PLAN, _H, Source.BACKEND,
          "`graph_support(phase, mode).capture`",
          "a mode the backend declares UNSUPPORTED (or does not declare) is impossible"),
    _rule("backend.fallback_target_invalid", PLAN, _H, Source.BACKEND,
          "`capture.fallback_to` and the target's availability and declaration",
          "a FALLBACK whose target is unknown, unavailable on the platform, or does not "
          "declare that (phase, mode) NATIVE itself (a chain or a cycle) makes the mode "
          "impossible for the falling-back backend"),
    _rule("backend.pinned_kernel_rejects_model", PLAN, _H, Source.BACKEND,
          "`pinned_method` and that method's kernels",
          "a mode that pins a method whose kernels reject the model is impossible (e.g. an "
          "absorbed kernel without FP8 KV, pinned under breakable, with an FP8 pool)"),
    _rule("model.piecewise_upgrade", PLAN, (_S, _I), Source.MODEL,
          "`piecewise_validated`, `graph_support(prefill, tc_piecewise).capture.is_native`, "
          "every rule against tc_piecewise",
          "soft: an unlocked default `breakable` prefill becomes `tc_piecewise` where the "
          "backend captures it natively; info: why the upgrade was not applied"),
    _rule("model.sparse_attention", PLAN, _I, Source.MODEL,
          "`sparse_top_k`, `Capabilities.sparse_kernels`, `sparse_graph_modes`",
          "the model's attention is sparse with top-k K: the phase runs the chosen backend's "
          "sparse MLA kernels, and its graph mode follows their declared capture support"),
    _rule("model.multimodal_piecewise_unvalidated", PLAN, _S, Source.MODEL,
          "`multimodal`, `piecewise_validated`",
          "no default `tc_piecewise` prefill for a multimodal model it was not validated for"),
    _rule("backend.high_cost_fallback", PLAN, _S, Source.BACKEND,
          "`capture.is_fallback`, `capture.cost_for(kv_dtype)`",
          "no default into a capture FALLBACK whose cost for this KV dtype is HIGH"),
    _rule("budget.capture_memory", PLAN, _S, (Source.USER, Source.PLATFORM, Source.ENGINE),
          "`CaptureMemory.estimate(CaptureShape)` + model capture pool vs "
          "`capture_memory_budget_bytes`, else `capture_budget_fraction` x device memory",
          "over budget (the user's, else the default: a fraction of the device memory): drop "
          "unlocked captures, prefill first (decode graphs carry the per-token latency)"),
    _rule("budget.pool_size_unknown", PLAN, _I, Source.ENGINE,
          "`CaptureMemory.estimate` at two pool sizes, `EngineFacts.kv_pool_bytes`",
          "the captured mode's memory grows with the KV pool (a fallback converts or copies it "
          "in the graph) and the engine did not pass the pool size: the estimate leaves it "
          "out"),
    _rule("engine.captured_shapes", PLAN, _I, Source.ENGINE,
          "`GraphConfig` buckets, `EngineFacts` (context, page size, max running requests, "
          "draft tokens)",
          "the shapes the phase's graphs are captured for, per forward mode"),
    _rule("spec.graph", PLAN, _I, Source.BACKEND,
          "`EngineFacts.num_draft_tokens`, the decode backend's `full` `forward_modes`",
          "target-verify / draft-extend batches replay the decode graphs, captured for the "
          "draft tokens per sequence"),
    _rule("spec.eager", PLAN, _I, Source.BACKEND,
          "speculative decoding, `num_draft_tokens`, the decode mode, the decode backend's "
          "`forward_modes` and `eager_forward_modes`",
          "target-verify / draft-extend batches run eagerly (or are not declared by the decode "
          "backend at all), and why"),
    _rule("backend.fallback_in_effect", PLAN, _I, Source.BACKEND,
          "`capture.fallback_to`, `capture.cost_for(kv_dtype)`",
          "the planned mode runs another backend's implementation, at this cost"),
    _rule("backend.pinning", PLAN, _I, Source.BACKEND,
          "`pinned_method` under breakable, `has_mha_companion`",
          "whether prefix batches of an MLA model may replay (MLA pinned; subject to "
          "`gate.cost_model` with a cost profile) or run eagerly (`gate.mha_companion_prefix`)"),
    _rule("backend.split_kv_single", PLAN, _I, Source.BACKEND, "`split_kv == single`",
          "split-KV forced to one split under capture (correct, slower on long KV)"),
    _rule("decode.bucket_backends", PLAN, _I, (Source.BACKEND, Source.ENGINE),
          "the decode profile (`resolve(decode_profile=...)`), each measured backend's "
          "declaration (page size, KV dtype, heads, full decode capture, verify graphs)",
          "each decode capture bucket is captured with the backend the decode profile "
          "measured more than 2% faster there than the phase's backend, among backends that "
          "declare the same pool layout; `PhasePlan.bucket_backends` gives the reason per "
          "bucket"),
    _rule("decode.bucket_backends_off", PLAN, _I, (Source.BACKEND, Source.USER, Source.ENGINE),
          "the decode profile, the user's decode backend, `EngineFacts.page_size`, the "
          "capture budget",
          "a decode profile was given but one backend still captures every bucket, and why "
          "(decode graphs off, the user named the backend, another pool, no candidate, no "
          "faster one, over the capture budget)"),
)

_ERROR_RULES = (
    _rule("platform.arch_required", ERROR, _H, Source.PLATFORM,
          "`PLATFORM_TRAITS[vendor].arch_required`, the platform's arch",
          "a cuda or rocm platform without an architecture: no plan (kernels depend on it); "
          "the reason lists the known architectures and GPU names"),
    _rule("backend.unavailable", ERROR, _H, Source.BACKEND,
          "availability: platform, optional libraries, plugin errors",
          "the backend named for a phase cannot run on the platform (or its plugin failed): "
          "no plan"),
    _rule("backend.phase_unserved", ERROR, _H, Source.BACKEND, "`Capabilities.serves(phase)`",
          "the backend named for a phase has no kernel for that phase: no plan"),
    _rule("backend.model_unsupported", ERROR, _H, Source.BACKEND, "`check_request`",
          "the backend named for a phase has no kernel that accepts the model and engine "
          "(forward method, e.g. absorbed-only prefill of a DSA model; KV dtype; heads; page "
          "size; context): no plan"),
    _rule("backend.sparse_unsupported", ERROR, _H, Source.BACKEND,
          "`sparse_top_k`, `check_sparse_request`",
          "the backend named for a phase of a sparse-attention model declares no sparse MLA "
          "kernel that accepts it (top-k, KV row format, heads, page size): no plan"),
    _rule("backend.none_fits", ERROR, _H, Source.BACKEND,
          "availability and `check_request` of every backend",
          "no available backend can serve the phase of this model: no plan"),
)

_GATE_RULES = (  # in evaluation order: the first that fails is the reason
    _rule("gate.spec_forward_mode", GATE, _H, Source.BATCH,
          "`forward_mode`, the plan's captured forward modes",
          "TARGET_VERIFY or DRAFT_EXTEND and no captured graph serves it (speculative decoding "
          "off or its draft tokens unknown, decode graphs disabled, or the decode backend "
          "declares no graph for it; the message says which)"),
    _rule("gate.phase_disabled", GATE, _H, Source.BATCH, "`forward_mode`, the plan's mode",
          "the phase's mode is `disabled`"),
    _rule("gate.batch_slots", GATE, _H, Source.BATCH, "`batch_size`",
          "more requests than captured slots (decode-phase graphs: the largest batch "
          "bucket; prefill: `prefill_max_requests`, capped by the engine's max running "
          "requests)"),
    _rule("gate.fact_missing", GATE, _H, Source.BATCH,
          "the fact the rule at its place needs (`reason.fact`, `reason.needed_by`)",
          "in the place of any rule below whose fact the batch does not carry (None: not "
          "known at this call site, e.g. `prefix_lens` or `capture_hidden` at schedule time): "
          "the batch runs eagerly, never on a guess, so an answer from fewer facts never "
          "replays where the answer from all of them would not"),
    _rule("gate.spec_query_len", GATE, _H, Source.BATCH, "`num_tokens` / `extend_lens`",
          "a target-verify batch whose tokens per sequence are not the captured draft tokens, "
          "or a draft-extend batch with a sequence above them"),
    _rule("gate.lora", GATE, _H, Source.BATCH, "`lora`, features `lora`, `dp_attention`",
          "a LoRA batch and LoRA was off at capture, or prefill under DP attention"),
    _rule("gate.input_embeds", GATE, _H, Source.BATCH, "`has_input_embeds`",
          "input embeddings bypass the captured embedding lookup"),
    _rule("gate.replace_embeds", GATE, _H, Source.BATCH, "`has_replace_embeds`",
          "replaced (multimodal) embeddings are not part of the captured graph"),
    _rule("gate.mha_companion_prefix", GATE, _H, Source.BATCH,
          "`prefix_lens`, the prefill `pinned_method`, `has_mha_companion`",
          "prefill under `breakable`, a model with an MHA companion, a non-zero prefix, and "
          "the prefill backend does **not** pin MLA for `breakable` on this platform (this "
          "replaces the engine-wide \"is it CUDA?\" test)"),
    _rule("gate.hidden_capture", GATE, _H, Source.BATCH, "`capture_hidden`",
          "the batch wants more hidden states than were captured"),
    _rule("gate.logprob_without_eager_tail", GATE, _H, Source.BATCH, "`return_logprob`",
          "a prefill batch wants logprobs and the engine runs no eager tail"),
    _rule("gate.num_tokens_above_max", GATE, _H, Source.BATCH, "`num_tokens` / `extend_lens`",
          "prefill tokens above the largest captured bucket"),
    _rule("gate.seq_len_above_max", GATE, _H, Source.BATCH,
          "`seq_lens` (or `prefix_lens` + the query lengths)",
          "a sequence longer than the graphs were captured for (the engine's max context)"),
    _rule("gate.padding_waste", GATE, _S, Source.BATCH, "`num_tokens` / `extend_lens`",
          "the prefill bucket exceeds the tokens by more than `padding_waste_factor` (2x)"),
    _rule("gate.cost_model", GATE, _S, Source.BATCH,
          "`prefix_lens`, `extend_lens` (both required then), the cost profile",
          "only with a cost profile: a prefill batch under a `breakable` graph that runs "
          "absorbed MLA, and the profile predicts eager MHA no slower (ties run eagerly)"),
    _rule("gate.ok", GATE, _I, Source.BATCH, "everything above",
          "replay (with a cost profile, the message and `reason.cost` carry both "
          "predictions)"),
)


#: Not gate rules (the gate answers one rank's batch): what the data-parallel agreement
#: (:func:`attnreg.graph_policy.sync`) decides over the local gate's answer.
_SYNC_RULES = (
    _rule("sync.other_rank_eager", SYNC, _H, Source.BATCH,
          "`Agreed.replay` (every rank's gate row, exchanged by `sync`)",
          "the local gate would replay the step but another data-parallel rank cannot (or, "
          "in a prefill step, is idle), so every rank runs it eagerly; the graph session "
          "counts such a step under this id (`runtime.SYNC_EAGER`)"),
)


def _feature_entries(rules: Iterable[FeatureRule]) -> tuple[RuleInfo, ...]:
    """One entry per feature id; its severities are those of its FEATURE_RULES rows."""
    by_id: dict[str, list[FeatureRule]] = {}
    for rule in rules:
        by_id.setdefault(rule.rule_id, []).append(rule)
    out = []
    for rule_id, rows in by_id.items():
        severities = tuple(s for s in (_H, _S) if any(r.severity is s for r in rows))
        modes = sorted({m.value for r in rows for m in r.modes})
        out.append(_rule(rule_id, FEATURE, severities, Source.FEATURE,
                         f"`ServerFeatures.{rows[0].feature}`",
                         f"{rows[0].feature} cannot be captured under {', '.join(modes)} "
                         "prefill (see the feature table)"))
    return tuple(out)


def _index(entries: Iterable[RuleInfo]) -> Mapping[str, RuleInfo]:
    out: dict[str, RuleInfo] = {}
    for entry in entries:
        if entry.id in out:
            raise ValueError(f"rule id {entry.id!r} is listed twice in RULES")
        out[entry.id] = entry
    return MappingProxyType(out)


#: Every rule id the policy can emit -> its :class:`RuleInfo`; insertion order is
#: the order of the docs tables (gate rules: evaluation order).
RULES: Mapping[str, RuleInfo] = _index((*_PLAN_RULES, *_ERROR_RULES,
                                        *_feature_entries(FEATURE_RULES), *_GATE_RULES,
                                        *_SYNC_RULES))


def _unknown(rule_id: str) -> ValueError:
    return ValueError(f"unknown graph-policy rule id {rule_id!r}: every id must be listed in "
                      "RULES (attnreg/graph_policy/rule_ids.py); add an entry there and "
                      "regenerate docs/policy.md with `python scripts/build_docs.py`")


def check_rule_id(rule_id: str) -> None:
    """Raise ``ValueError`` unless ``rule_id`` is in :data:`RULES`."""
    if rule_id not in RULES:
        raise _unknown(rule_id)


def rule_info(rule_id: str) -> RuleInfo:
    """The entry of ``rule_id``; ``ValueError`` (saying what to do) for an unknown id."""
    check_rule_id(rule_id)
    return RULES[rule_id]


def tagged(rule_id: str, message: str) -> str:
    """``"rule_id: message"``, the form of a rule-tagged error reason (id checked)."""
    check_rule_id(rule_id)
    return f"{rule_id}: {message}"
