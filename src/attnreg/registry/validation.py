"""Validation of declarations: a list of reasons, empty when valid."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from .capabilities import (
    PHASE_FORWARD_MODES,
    VALID_GRAPH_MODES,
    Capabilities,
    CaptureSupport,
    DType,
    ForwardMethod,
    ForwardMode,
    ForwardModeSupport,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    SparseKernel,
    SplitKV,
)
from .spec import NAME_RE, BackendSpec

__all__ = ["validate_capabilities", "validate_fallback_targets", "validate_spec"]


def validate_spec(spec: Any) -> list[str]:
    """Reasons a registered object is not a usable :class:`BackendSpec`."""
    if not isinstance(spec, BackendSpec):
        return [f"register() takes a BackendSpec, got {type(spec).__name__}"]
    reasons = []
    if not isinstance(spec.name, str) or not NAME_RE.match(spec.name):
        reasons.append(f"backend name {spec.name!r} must match {NAME_RE.pattern}")
    if not callable(spec.capabilities):
        reasons.append("capabilities must be a callable (DeclarationContext) -> Capabilities")
    module, sep, attr = (spec.runtime or "").partition(":")
    if not (module and sep and attr):
        reasons.append(f"runtime {spec.runtime!r} must be 'package.module:ClassName'")
    if not spec.summary:
        reasons.append("summary is empty; give one line for listings")
    return reasons


def _validate_capture(entry: GraphModeSupport, backend: str) -> list[str]:
    cap: CaptureSupport = entry.capture
    where = f"{entry.phase}/{entry.mode}"
    reasons = []
    if cap.is_fallback and (not cap.fallback_to or cap.fallback_to == backend):
        reasons.append(f"{where}: FALLBACK must name another backend, got {cap.fallback_to!r}")
    if cap.is_fallback and not cap.reason:
        reasons.append(f"{where}: FALLBACK needs a reason (why the native path cannot capture)")
    if cap.is_unsupported and not cap.reason:
        reasons.append(f"{where}: UNSUPPORTED needs a reason")
    if cap.is_unsupported and entry.pinned_method is not None:
        reasons.append(f"{where}: an UNSUPPORTED mode cannot pin a forward method")
    mem = entry.capture_memory
    if mem.fixed_bytes < 0 or mem.per_batch_slot_bytes < 0:
        reasons.append(f"{where}: capture memory estimate is negative")
    return reasons


def _validate_forward_modes(served: tuple[ForwardModeSupport, ...], where: str,
                            allowed: tuple[ForwardMode, ...]) -> list[str]:
    """Reasons a list of served forward modes is malformed.

    Each mode must belong to ``allowed`` (the phase's modes for a graph
    entry), appear once, and bound its query length sensibly: DECODE serves
    one token per sequence, a speculative mode at least one, EXTEND may be
    unbounded (None).
    """
    reasons = []
    seen: set[ForwardMode] = set()
    for f in served:
        if f.mode not in allowed:
            reasons.append(f"{where}: serves forward mode {f.mode}, which is not one of "
                           f"{[m.value for m in allowed]}")
        if f.mode in seen:
            reasons.append(f"{where}: forward mode {f.mode} listed twice")
        seen.add(f.mode)
        if f.max_query_len is not None and f.max_query_len < 1:
            reasons.append(f"{where}: {f.mode} max_query_len must be >= 1 or None, got "
                           f"{f.max_query_len}")
        elif f.mode is ForwardMode.DECODE and f.max_query_len != 1:
            reasons.append(f"{where}: DECODE serves exactly one query token per sequence, got "
                           f"max_query_len={f.max_query_len}")
        elif f.mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND) \
                and f.max_query_len is None:
            reasons.append(f"{where}: {f.mode} needs a bound on the draft tokens per sequence "
                           "(max_query_len)")
    return reasons


def _validate_kernel(k: KernelConstraints) -> list[str]:
    where = f"kernel {k.kernel or k.method}"
    reasons = []
    if not k.phases:
        reasons.append(f"{where}: no phase")
    if not k.head_dims:
        reasons.append(f"{where}: no head dims")
    for pair in k.head_dims:
        if len(pair) != 2 or min(pair) <= 0:
            reasons.append(f"{where}: head dims {pair} are not two positive ints")
        elif k.method is ForwardMethod.MLA and tuple(pair) != (576, 512):
            reasons.append(f"{where}: absorbed MLA is (576, 512), got {tuple(pair)}")
    if not k.q_dtypes or not k.kv_dtypes:
        reasons.append(f"{where}: q and kv dtypes must be non-empty")
    if DType.FP8_E4M3 in k.q_dtypes and k.method is not ForwardMethod.MLA:
        reasons.append(f"{where}: an fp8 query (with its q_scale) is absorbed MLA's only; "
                       f"{k.method} takes q, k and v in one 16-bit dtype")
    for p in k.page_sizes:
        if p <= 0 or p & (p - 1):
            reasons.append(f"{where}: page size {p} is not a positive power of two")
    if k.method is ForwardMethod.MLA and not k.page_sizes:
        reasons.append(f"{where}: absorbed MLA reads the paged latent cache; list page sizes")
    if k.max_heads < 1 or any(h < 1 or h > k.max_heads for h in k.head_counts):
        reasons.append(f"{where}: head counts must be within 1..max_heads")
    if not 1 <= k.min_heads <= k.max_heads or any(h < k.min_heads for h in k.head_counts):
        reasons.append(f"{where}: min_heads must be within 1..max_heads, and below every "
                       f"listed head count")
    if Phase.DECODE in k.phases and k.method is not ForwardMethod.MLA:
        reasons.append(f"{where}: decode of an MLA model runs absorbed MLA, not {k.method}")
    return reasons


def _validate_sparse_kernel(k: SparseKernel) -> list[str]:
    where = f"sparse kernel {k.kernel or 'mla'}"
    reasons = []
    if not k.phases:
        reasons.append(f"{where}: no phase")
    if not k.q_dtypes:
        reasons.append(f"{where}: q dtypes must be non-empty")
    if not k.page_sizes:
        reasons.append(f"{where}: sparse MLA reads the paged latent cache; list page sizes")
    for p in k.page_sizes:
        if p <= 0 or p & (p - 1):
            reasons.append(f"{where}: page size {p} is not a positive power of two")
    if k.max_heads < 1 or any(h < 1 or h > k.max_heads for h in k.head_counts):
        reasons.append(f"{where}: head counts must be within 1..max_heads")
    if k.top_k_multiple < 1 or k.max_top_k < 1 or k.max_top_k < k.top_k_multiple:
        reasons.append(f"{where}: top-k bounds must satisfy 1 <= top_k_multiple <= max_top_k, "
                       f"got multiple {k.top_k_multiple}, max {k.max_top_k}")
    if any(t < 1 for t in k.top_k_sizes):
        reasons.append(f"{where}: top-k sizes must be >= 1, got {list(k.top_k_sizes)}")
    return reasons


def _validate_sparse(caps: Capabilities) -> list[str]:
    """Reasons the sparse (DSA) part of a declaration is malformed."""
    reasons: list[str] = []
    for k in caps.sparse_kernels:
        reasons.extend(_validate_sparse_kernel(k))
    seen: set[tuple[Phase, object]] = set()
    for entry in caps.sparse_graph_modes:
        where = f"sparse {entry.phase}/{entry.mode}"
        if entry.mode not in VALID_GRAPH_MODES[entry.phase]:
            reasons.append(f"{where}: {entry.phase} has no graph mode {entry.mode}")
        if (entry.phase, entry.mode) in seen:
            reasons.append(f"{where} declared twice")
        seen.add((entry.phase, entry.mode))
        reasons.extend(f"sparse {r}" for r in _validate_capture(entry, caps.backend))
        if entry.pinned_method not in (None, ForwardMethod.MLA):
            reasons.append(f"{where}: sparse attention is absorbed MLA; it cannot pin "
                           f"{entry.pinned_method}")
        if not entry.capture.is_unsupported and not caps.serves_sparse(entry.phase):
            reasons.append(f"{where}: declared {entry.capture.kind.value.upper()} but no "
                           f"sparse kernel serves {entry.phase}")
    for phase, modes in VALID_GRAPH_MODES.items():
        if not caps.serves_sparse(phase):
            continue
        for mode in modes:
            if (phase, mode) not in seen:
                reasons.append(f"sparse {phase}/{mode} is not declared (say NATIVE, FALLBACK "
                               "or UNSUPPORTED with a reason in sparse_graph_modes)")
    return reasons


def validate_capabilities(caps: Any, expected_name: str | None = None) -> list[str]:
    """Reasons a declaration is invalid (empty list = valid)."""
    if not isinstance(caps, Capabilities):
        return [f"capability function must return Capabilities, got {type(caps).__name__}"]
    reasons: list[str] = []
    # caps.requires (deprecated in 0.2.0) is valid: it warns and the registry merges
    # it into BackendSpec.requires.
    if expected_name is not None and caps.backend != expected_name:
        reasons.append(f"declaration names backend {caps.backend!r}, spec says {expected_name!r}")
    if not caps.kernels and not caps.sparse_kernels and not caps.platform_reason:
        reasons.append("declares no kernel on this platform but gives no platform_reason")
    reasons.extend(_validate_sparse(caps))
    for k in caps.kernels:
        reasons.extend(_validate_kernel(k))
    seen: set[tuple[Phase, object]] = set()
    for entry in caps.graph_modes:
        key = (entry.phase, entry.mode)
        if entry.mode not in VALID_GRAPH_MODES[entry.phase]:
            reasons.append(f"{entry.phase} has no graph mode {entry.mode} "
                           f"(valid: {[m.value for m in VALID_GRAPH_MODES[entry.phase]]})")
        if key in seen:
            reasons.append(f"{entry.phase}/{entry.mode} declared twice")
        seen.add(key)
        reasons.extend(_validate_capture(entry, caps.backend))
        if not entry.capture.is_unsupported:
            reasons.extend(_validate_forward_modes(entry.forward_modes,
                                                   f"{entry.phase}/{entry.mode}",
                                                   PHASE_FORWARD_MODES[entry.phase]))
        # A FALLBACK pins too: the backend still decides which method runs
        # (and e.g. refuses the other), so the pin must name a kernel it has.
        if not entry.capture.is_unsupported and entry.pinned_method is not None \
                and caps.kernels and not caps.kernels_for(entry.pinned_method, entry.phase):
            reasons.append(f"{entry.phase}/{entry.mode} pins {entry.pinned_method} but no "
                           f"{entry.pinned_method} kernel serves {entry.phase}")
        if entry.capture.is_native and entry.split_kv in (SplitKV.DYNAMIC, SplitKV.HOST_PLANNED) \
                and caps.kernels and \
                not any(k.split_kv in (SplitKV.DYNAMIC, SplitKV.HOST_PLANNED) for k in caps.kernels
                        if entry.phase in k.phases):
            reasons.append(f"{entry.phase}/{entry.mode} claims dynamic split-KV under capture "
                           "but no kernel of that phase declares split-KV")
    reasons.extend(_validate_forward_modes(caps.eager_forward_modes, "eager forward modes",
                                           tuple(ForwardMode)))
    if caps.kernels:
        for phase, modes in VALID_GRAPH_MODES.items():
            if not caps.serves(phase):
                continue
            for mode in modes:
                if (phase, mode) not in seen:
                    reasons.append(f"{phase}/{mode} is not declared (say NATIVE, FALLBACK or "
                                   "UNSUPPORTED with a reason)")
    return reasons


def validate_fallback_targets(caps: Capabilities,
                              target_of: Callable[[str], Capabilities | None],
                              skip: Collection[str] = ()) -> list[str]:
    """Reasons the FALLBACK entries of ``caps`` name targets that cannot take over.

    ``target_of(name)`` is the target's declaration on the same platform, or
    None when no loaded plugin registered that name.  A target must exist
    and, where it has kernels, declare the (phase, mode) it is asked to run
    NATIVE (so there are no chains and no cycles) with a kernel for the
    method the fallback pins.  Whether the target is *available* on a
    platform is the graph policy's question, not a declaration error; so is
    a target in ``skip`` (names the user disabled).
    """
    reasons: list[str] = []
    for entry in caps.graph_modes:
        cap = entry.capture
        if not cap.is_fallback or not cap.fallback_to or not caps.serves(entry.phase) \
                or cap.fallback_to in skip:
            continue
        where = f"{entry.phase}/{entry.mode}"
        target = target_of(cap.fallback_to)
        if target is None:
            reasons.append(f"{where} falls back to {cap.fallback_to!r}, which no loaded plugin "
                           "registers; name a registered backend, or install the plugin "
                           "that provides it")
            continue
        if not target.kernels:
            continue  # unavailable here: the policy's hard rule, not a declaration error
        support = target.graph_support(entry.phase, entry.mode).capture
        if not support.is_native:
            reasons.append(f"{where} falls back to {cap.fallback_to!r}, which declares "
                           f"{entry.phase}/{entry.mode} {support.kind.value.upper()}, not NATIVE "
                           "(a fallback target must run the mode itself: no chains, no cycles)")
        elif entry.pinned_method is not None and \
                not target.kernels_for(entry.pinned_method, entry.phase):
            reasons.append(f"{where} falls back to {cap.fallback_to!r} pinning "
                           f"{entry.pinned_method}, but {cap.fallback_to!r} has no "
                           f"{entry.pinned_method} kernel for {entry.phase}")
    return reasons
