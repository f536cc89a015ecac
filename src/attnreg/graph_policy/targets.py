"""Fallback targets, checked where the plan is made.

A declaration may say ``FALLBACK(to=X)`` for a (phase, graph mode): under
that capture the backend runs X's implementation.  The plan may rely on it
only if X exists, can run on this platform, and declares that (phase, mode)
NATIVE itself (a fallback into another fallback is a chain, possibly a
cycle, and proves nothing).  Otherwise the mode is impossible for the
falling-back backend: a hard rule (``backend.fallback_target_invalid``).

Registration validates declarations too; this check is what makes
:func:`~attnreg.graph_policy.resolve` safe against declarations that only
break on some platforms: a target whose capability function raises is a
reason here, never an exception.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ..registry.capabilities import Capabilities, GraphMode, Phase
from ..registry.errors import AttnregError
from ..registry.manager import BackendRegistry
from ..registry.platform import Platform

__all__ = ["TargetLookup"]


@dataclass
class TargetLookup:
    """Finds fallback targets by name and says what is wrong with one ('' = nothing).

    ``known`` declarations (those passed to ``resolve`` as objects, and its
    ``extra_declarations``) are consulted before the registry, which is
    loaded (``registry_loader``) only when a target is not among them.
    """

    platform: Platform
    registry: BackendRegistry | None
    assume_installed: bool = False
    versions: Mapping[str, str | None] | None = None
    known: dict[str, Capabilities] = field(default_factory=dict)
    registry_loader: Callable[[], BackendRegistry] | None = None
    _cache: dict[tuple[str, str, str, str], str] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, platform: Platform, registry: BackendRegistry | None,
              assume_installed: bool, versions: Mapping[str, str | None] | None,
              known: Iterable[Capabilities],
              registry_loader: Callable[[], BackendRegistry] | None = None) -> TargetLookup:
        return cls(platform, registry, assume_installed, versions,
                   {c.backend: c for c in known}, registry_loader)

    def _find(self, name: str) -> tuple[Capabilities | None, str]:
        """The target's declaration here, or None and why it cannot serve."""
        if name in self.known:
            caps = self.known[name]
            if caps.platform_reason or not (caps.kernels or caps.sparse_kernels):
                return None, (caps.platform_reason
                              or f"no kernel of {name} runs on {self.platform}")
            return caps, ""
        if self.registry is None and self.registry_loader is not None:
            self.registry = self.registry_loader()
        if self.registry is None:
            return None, f"no declaration of {name!r} was given and no registry is in use"
        if name not in self.registry.specs:
            if any(getattr(err, "backend", None) == name for err in self.registry.errors):
                return None, f"{name!r} failed to register (see `attnreg doctor`)"
            return None, f"no backend named {name!r} is registered"
        try:
            avail = self.registry.availability(name, self.platform, self.versions,
                                               assume_installed=self.assume_installed)
        except AttnregError as exc:  # a plugin that breaks only here must not stop a plan
            return None, f"{name}'s declaration failed on {self.platform}: {exc}"
        if not avail.available or avail.capabilities is None:
            return None, f"{name} cannot run on {self.platform}: {avail.reason}"
        return avail.capabilities, ""

    def problem(self, caps: Capabilities, phase: Phase, mode: GraphMode) -> str:
        """Why ``caps``'s FALLBACK under (phase, mode) cannot be relied on ('' = it can)."""
        capture = caps.graph_support(phase, mode).capture
        if not capture.is_fallback:
            return ""
        target = capture.fallback_to or ""
        key = (caps.backend, target, phase.value, mode.value)
        if key in self._cache:
            return self._cache[key]
        if not target or target == caps.backend:
            why = f"{caps.backend} falls back to {target or 'nothing'} under {phase} {mode}"
        else:
            found, reason = self._find(target)
            if found is None:
                why = f"{caps.backend} falls back to {target} under {phase} {mode}, but {reason}"
            else:
                theirs = found.graph_support(phase, mode).capture
                why = "" if theirs.is_native else (
                    f"{caps.backend} falls back to {target} under {phase} {mode}, but "
                    f"{target} declares it {theirs.describe()} there; a fallback must land on "
                    "a NATIVE capture (no chains, no cycles)")
        self._cache[key] = why
        return why
