"""Which backend serves each phase: the user's choice or the best one for the need.

Backends are given by name (resolved through the registry to declarations)
or directly as :class:`Capabilities` (property tests, engines that build
declarations themselves).

The default is chosen by need, then priority: among the available backends
whose kernels accept what the model and engine need
(:mod:`~attnreg.graph_policy.acceptance`: forward methods, KV dtype, heads,
page size, context), those whose declaration lets the phase's requested
graph mode run (and, with speculative decoding, its verify graphs) come
first; then the highest declared ``priority``; ties go to the alphabetically
first name.  The decision names every higher-priority backend passed over
and why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

from ..registry.capabilities import Capabilities, Phase
from ..registry.errors import AttnregError, UnknownBackendError
from ..registry.manager import BackendRegistry
from ..registry.platform import Platform
from .acceptance import method_attempts, model_rejections, pinned_method_rejections
from .engine import EngineFacts
from .model import ModelFacts
from .rule_ids import tagged
from .sparse import planned_declaration, sparse_rejections

__all__ = ["BackendChoice", "BackendsArg", "SelectedBackend", "SelectionTiers", "method_attempts",
           "model_rejections", "normalize_backends", "pinned_method_rejections",
           "select_backend"]

BackendRef: TypeAlias = "str | Capabilities | None"
BackendsArg: TypeAlias = ("BackendChoice | Mapping[Any, BackendRef] | "
                          "tuple[BackendRef, BackendRef] | str | Capabilities | None")
#: For a candidate declaration: per tier (most important first), what it
#: would fail to run (a short goal such as "prefill breakable") and why; no reasons
#: means the candidate meets that tier.
SelectionTiers: TypeAlias = Callable[[Capabilities], Sequence[tuple[str, Sequence[str]]]]


@dataclass(frozen=True)
class BackendChoice:
    """The backend asked for per phase (name, declaration, or None = default)."""

    prefill: BackendRef = None
    decode: BackendRef = None

    def for_phase(self, phase: Phase) -> BackendRef:
        return self.prefill if phase is Phase.PREFILL else self.decode


def normalize_backends(backends: BackendsArg) -> BackendChoice:
    """Accept a BackendChoice, a {phase: ref} mapping, a (prefill, decode)
    pair, or one ref for both phases."""
    if backends is None:
        return BackendChoice()
    if isinstance(backends, BackendChoice):
        return backends
    if isinstance(backends, (str, Capabilities)):
        return BackendChoice(backends, backends)
    if isinstance(backends, tuple):
        prefill, decode = backends
        return BackendChoice(prefill, decode)
    if isinstance(backends, Mapping):
        by_phase = {Phase.parse(str(k.value if isinstance(k, Phase) else k)): v
                    for k, v in backends.items()}
        return BackendChoice(by_phase.get(Phase.PREFILL), by_phase.get(Phase.DECODE))
    raise TypeError(f"backends must be a name, Capabilities, a (prefill, decode) pair or a "
                    f"{{phase: backend}} mapping, got {type(backends).__name__}")


@dataclass(frozen=True)
class SelectedBackend:
    """A phase's backend declaration and how it was chosen."""

    caps: Capabilities
    by_user: bool
    how: str


def _unavailable_reason(caps: Capabilities) -> str:
    if caps.platform_reason:
        return caps.platform_reason
    if not (caps.kernels or caps.sparse_kernels):   # sparse-only backends run (DSA models)
        return f"no kernel of {caps.backend} runs on {caps.platform}"
    return ""


def _need(registry: BackendRegistry | None) -> BackendRegistry:
    if registry is None:
        raise ValueError("choosing a backend by name or by default needs a registry")
    return registry


def _named(ref: str, platform: Platform, registry: BackendRegistry, assume_installed: bool,
           versions: Mapping[str, str | None] | None) -> tuple[Capabilities | None, str]:
    """A named backend's declaration here and why it cannot run ('' = it can).

    Raises :class:`UnknownBackendError` for a name nobody registered; any other
    registry error (a plugin that failed to load, a declaration that raises on
    this platform) is a reason, so that resolving never raises a plugin's error.
    """
    try:
        avail = registry.availability(ref, platform, versions,
                                      assume_installed=assume_installed)
    except UnknownBackendError:
        raise
    except AttnregError as exc:
        return None, str(exc)
    if avail.capabilities is None:
        return None, avail.reason or f"{ref} has no declaration on {platform}"
    return avail.capabilities, "" if avail.available else avail.reason


def _user_choice(phase: Phase, ref: str | Capabilities, platform: Platform, model: ModelFacts,
                 engine: EngineFacts, registry: BackendRegistry | None, assume_installed: bool,
                 versions: Mapping[str, str | None] | None,
                 ) -> tuple[SelectedBackend | None, list[str]]:
    if isinstance(ref, Capabilities):
        caps: Capabilities | None = ref
        unavailable = _unavailable_reason(ref)
        name = ref.backend
    else:
        caps, unavailable = _named(ref, platform, _need(registry), assume_installed, versions)
        name = ref
    if unavailable or caps is None:
        return None, [tagged("backend.unavailable", f"{name} cannot run on {platform}: "
                             f"{unavailable}")]
    if model.sparse:
        why = sparse_rejections(caps, phase, model, engine)
        if why:
            return None, [tagged("backend.sparse_unsupported",
                                 f"{name} cannot serve {phase} of this sparse-attention model "
                                 f"(top-k {model.sparse_top_k}): " + "; ".join(why))]
        caps = planned_declaration(caps, model)
        return SelectedBackend(caps, True, f"{name} chosen by the user for {phase} (its "
                                           "sparse MLA kernels)"), []
    if not caps.serves(phase):
        return None, [tagged("backend.phase_unserved",
                             f"{name} has no {phase} kernel on {platform}; choose another "
                             f"{phase} backend")]
    rejected = model_rejections(caps, phase, model, engine)
    if rejected:
        return None, [tagged("backend.model_unsupported",
                             f"{name} cannot serve {phase} of this model on this engine: "
                             + "; ".join(rejected))]
    return SelectedBackend(caps, True, f"{name} chosen by the user for {phase}"), []


def select_backend(phase: Phase, ref: BackendRef, platform: Platform, model: ModelFacts,
                   registry: BackendRegistry | None, assume_installed: bool,
                   versions: Mapping[str, str | None] | None = None, *,
                   engine: EngineFacts | None = None,
                   prefer: SelectionTiers | None = None,
                   ) -> tuple[SelectedBackend | None, list[str]]:
    """The backend for ``phase``, or None and the reasons nothing fits.

    ``prefer`` ranks the default candidates that serve the model (see
    :data:`SelectionTiers`); without it, priority alone decides.  Raises
    :class:`~attnreg.registry.UnknownBackendError` for an unknown name.
    """
    eng = engine if engine is not None else EngineFacts()
    if ref is not None:
        return _user_choice(phase, ref, platform, model, eng, registry, assume_installed,
                            versions)

    # Available backends serving the phase, best priority first (a sparse model: every
    # available backend, each judged by its sparse kernels and planned with their view).
    ordered = [planned_declaration(cast(Capabilities, a.capabilities), model) for a in
               _need(registry).available(platform, None if model.sparse else phase, versions,
                                         assume_installed=assume_installed)]
    fits: list[tuple[Capabilities, list[tuple[str, Sequence[str]]]]] = []
    rejected: dict[str, list[str]] = {}
    for caps in ordered:
        reasons = (sparse_rejections(caps, phase, model, eng) if model.sparse
                   else model_rejections(caps, phase, model, eng))
        if reasons:
            rejected[caps.backend] = reasons
        else:
            fits.append((caps, list(prefer(caps)) if prefer else []))
    if not fits:
        detail = "; ".join(f"{n} ({'; '.join(r)})" for n, r in rejected.items()) \
            or "no backend serving it is available"
        page = f", page size {eng.page_size}" if eng.page_size is not None else ""
        sparse = f" with sparse attention (top-k {model.sparse_top_k})" if model.sparse else ""
        return None, [tagged("backend.none_fits",
                             f"no backend can serve {phase} of this {model.attention} model{sparse} "
                             f"({model.kv_dtype} KV, {model.num_heads} heads{page}, context "
                             f"{eng.max_context_len}) on {platform}: {detail}")]

    def rank(item: tuple[Capabilities, list[tuple[str, Sequence[str]]]]) -> tuple[Any, ...]:
        caps, tiers = item
        return (*(bool(reasons) for _, reasons in tiers), -caps.priority, caps.backend)

    chosen, tiers = min(fits, key=rank)
    position = ordered.index(chosen)
    passed_over = []
    for caps in ordered[:position]:
        if caps.backend in rejected:
            why = "its kernels reject the model: " + "; ".join(rejected[caps.backend])
        else:
            their = dict(next(t for c, t in fits if c is caps))
            why = "; ".join(f"{goal} would not run: {'; '.join(reasons)}"
                            for goal, reasons in their.items() if reasons)
        passed_over.append(f"{caps.backend} (priority {caps.priority}: {why})")
    met = [goal for goal, reasons in tiers if not reasons]
    kind = "sparse MLA kernels" if model.sparse else "kernels"
    how = (f"{chosen.backend} chosen for {phase}: declared priority {chosen.priority}, the best "
           f"among backends available on {platform} whose {kind} accept the model")
    if passed_over:
        if met:
            how += " and that let " + " and ".join(met) + " run"
        how += "; passed over: " + ", ".join(passed_over)
    return SelectedBackend(chosen, False, how), []
