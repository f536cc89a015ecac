"""Which backend serves each phase: the user's choice or the best declared one.

Backends are given by name (resolved through the registry to declarations)
or directly as :class:`Capabilities` (property tests, engines that build
declarations themselves).  The default is the available backend with the
highest declared ``priority`` whose kernels accept the model (KV dtype, head
count, head dims); ties go to the alphabetically first name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

from ..registry.capabilities import METHOD_HEAD_DIMS, Capabilities, DType, ForwardMethod, Phase
from ..registry.manager import BackendRegistry
from ..registry.platform import Platform
from .model import AttentionKind, ModelFacts
from .rule_ids import tagged

__all__ = ["BackendChoice", "BackendsArg", "SelectedBackend", "model_rejections",
           "normalize_backends", "pinned_method_rejections", "select_backend"]

BackendRef: TypeAlias = "str | Capabilities | None"
BackendsArg: TypeAlias = ("BackendChoice | Mapping[Any, BackendRef] | "
                          "tuple[BackendRef, BackendRef] | str | Capabilities | None")


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


def _method_attempts(model: ModelFacts,
                     phase: Phase) -> list[tuple[ForwardMethod, tuple[int, int], DType]]:
    """(method, head dims, dtype of the K/V the kernel reads) a phase may run.

    Kernels that read the paged pool (absorbed MLA, MHA decode) see the KV
    dtype; a ragged MHA prefill reads K/V materialised in the activation dtype.
    """
    if model.attention is AttentionKind.MLA:
        mla = (ForwardMethod.MLA, METHOD_HEAD_DIMS[ForwardMethod.MLA], model.kv_dtype)
        if phase is Phase.DECODE:
            return [mla]
        mha_dims = METHOD_HEAD_DIMS[ForwardMethod.MHA]
        return [mla, (ForwardMethod.MHA, mha_dims, model.act_dtype),
                (ForwardMethod.MHA_CHUNKED_KV, mha_dims, model.act_dtype)]
    if phase is Phase.DECODE:
        return [(ForwardMethod.MHA, model.mha_head_dims, model.kv_dtype)]
    return [(ForwardMethod.MHA, model.mha_head_dims, model.act_dtype),
            (ForwardMethod.MHA_CHUNKED_KV, model.mha_head_dims, model.act_dtype)]


def _check(caps: Capabilities, method: ForwardMethod, phase: Phase, dims: tuple[int, int],
           kv: DType, model: ModelFacts) -> list[str]:
    return caps.check_request(method, phase, head_dims=dims, q_dtype=model.act_dtype,
                              kv_dtype=kv, num_heads=model.num_heads)


def model_rejections(caps: Capabilities, phase: Phase, model: ModelFacts) -> list[str]:
    """Why no kernel of ``caps`` can run ``phase`` of ``model`` (empty = accepted)."""
    reasons: list[str] = []
    tried = False
    for method, dims, kv in _method_attempts(model, phase):
        if not caps.kernels_for(method, phase):
            continue
        tried = True
        found = _check(caps, method, phase, dims, kv, model)
        if not found:
            return []
        reasons.extend(found)
    if not tried:
        have = ", ".join(m.value for m in caps.methods(phase)) or "none"
        reasons.append(f"{caps.backend} has no kernel for {phase} of a {model.attention} model "
                       f"on {caps.platform} (methods it has for {phase}: {have})")
    return reasons


def pinned_method_rejections(caps: Capabilities, phase: Phase, method: ForwardMethod,
                             model: ModelFacts) -> list[str]:
    """Why the kernels of a pinned ``method`` cannot run ``model`` (empty = they can)."""
    for m, dims, kv in _method_attempts(model, phase):
        if m is method:
            return _check(caps, m, phase, dims, kv, model)
    return [(f"{caps.backend} pins {method}, which a {model.attention} model does not run in "
            f"{phase}")]


def _unavailable_reason(caps: Capabilities) -> str:
    if caps.platform_reason:
        return caps.platform_reason
    if not caps.kernels:
        return f"no kernel of {caps.backend} runs on {caps.platform}"
    return ""


def _need(registry: BackendRegistry | None) -> BackendRegistry:
    if registry is None:
        raise ValueError("choosing a backend by name or by default needs a registry")
    return registry


def select_backend(phase: Phase, ref: BackendRef, platform: Platform, model: ModelFacts,
                   registry: BackendRegistry | None, assume_installed: bool,
                   versions: Mapping[str, str | None] | None = None,
                   ) -> tuple[SelectedBackend | None, list[str]]:
    """The backend for ``phase``, or None and the reasons nothing fits.

    Raises :class:`~attnreg.registry.UnknownBackendError` for an unknown name.
    """
    if ref is not None:
        if isinstance(ref, Capabilities):
            caps = ref
            unavailable = _unavailable_reason(caps)
        else:
            reg = _need(registry)
            avail = reg.availability(ref, platform, versions, assume_installed=assume_installed)
            caps = avail.capabilities if avail.capabilities is not None \
                else reg.declaration(ref, platform, versions)
            unavailable = avail.reason if not avail.available else ""
        name = caps.backend
        if unavailable:
            return None, [tagged("backend.unavailable",
                                 f"{name} cannot run on {platform}: {unavailable}")]
        if not caps.serves(phase):
            return None, [tagged("backend.phase_unserved",
                                 f"{name} has no {phase} kernel on {platform}; choose another "
                                 f"{phase} backend")]
        rejected = model_rejections(caps, phase, model)
        if rejected:
            return None, [tagged("backend.model_unsupported",
                                 f"{name} cannot serve {phase} of this model: "
                                 + "; ".join(rejected))]
        return SelectedBackend(caps, True, f"{name} chosen by the user for {phase}"), []

    skipped: list[str] = []
    for avail in _need(registry).available(platform, phase, versions,
                                           assume_installed=assume_installed):
        caps = cast(Capabilities, avail.capabilities)
        rejected = model_rejections(caps, phase, model)
        if rejected:
            skipped.append(f"{avail.name} ({'; '.join(rejected)})")
            continue
        how = (f"{avail.name} chosen for {phase}: highest declared priority ({caps.priority}) "
               f"among backends available on {platform} whose kernels accept the model")
        if skipped:
            how += "; skipped: " + ", ".join(skipped)
        return SelectedBackend(caps, False, how), []
    detail = "; ".join(skipped) if skipped else "no backend serving it is available"
    return None, [tagged("backend.none_fits",
                         f"no backend can serve {phase} of this {model.attention} model "
                         f"({model.kv_dtype} KV, {model.num_heads} heads) on {platform}: "
                         f"{detail}")]
