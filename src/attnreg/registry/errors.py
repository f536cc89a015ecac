"""Errors of attnreg.  Each says what was wrong, why, and what to do."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence

__all__ = [
    "AttnregError",
    "BackendUnavailableError",
    "DuplicateBackendError",
    "GraphPolicyError",
    "PluginError",
    "UnknownBackendError",
    "UnsupportedError",
    "closest_names",
    "origin_label",
]


class AttnregError(Exception):
    """Base class of every error attnreg raises on purpose."""


def closest_names(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    return difflib.get_close_matches(name, sorted(candidates), n=n, cutoff=0.5)


class UnknownBackendError(AttnregError, KeyError):
    """A backend name that no loaded plugin registered."""

    def __init__(self, name: str, known: Iterable[str]):
        self.name = name
        self.known = sorted(known)
        self.suggestions = closest_names(name, self.known)
        super().__init__(name)

    def __str__(self) -> str:
        hint = f" Did you mean: {', '.join(self.suggestions)}?" if self.suggestions else ""
        known = ", ".join(self.known) or "none"
        return (f"unknown attention backend {self.name!r}.{hint} Registered backends: {known}. "
                "Run `attnreg backends` to list them, or `attnreg doctor` for plugin errors.")


def origin_label(plugin: str, distribution: str = "", version: str = "") -> str:
    """``plugin 'demo' (attnreg-demo 1.2.3)``: a plugin and the distribution it came from."""
    if distribution:
        dist = f"{distribution} {version}".strip()
    else:
        dist = "no distribution found"
    return f"plugin {plugin!r} ({dist})"


class PluginError(AttnregError):
    """A plugin failed to import, raised in its hook, or declared something invalid.

    ``plugin`` is the entry-point name (what ``--disable`` takes);
    ``distribution`` and ``version`` name the installed package it came from
    (empty when none is known: a plugin given as an object or by ``--plugin``
    whose package is not installed under its own name).
    """

    def __init__(self, plugin: str, cause: str, *, backend: str | None = None,
                 kind: str = "error", traceback_text: str = "", distribution: str = "",
                 version: str = ""):
        self.plugin = plugin
        self.cause = cause
        self.backend = backend
        self.kind = kind
        self.traceback_text = traceback_text
        self.distribution = distribution
        self.version = version
        super().__init__(str(self))

    @property
    def origin(self) -> str:
        """``plugin 'demo' (attnreg-demo 1.2.3)``."""
        return origin_label(self.plugin, self.distribution, self.version)

    @property
    def silence_hint(self) -> str:
        """How to skip the plugin: the ``--disable`` flag and the environment variable."""
        return f"`--disable {self.plugin}` / ATTNREG_DISABLE={self.plugin}"

    def __str__(self) -> str:
        what = f"backend {self.backend!r} from {self.origin}" if self.backend else self.origin
        return (f"{what}: {self.kind}: {self.cause}. Fix or upgrade the plugin, or skip it with "
                f"{self.silence_hint}.")

    def to_dict(self) -> dict[str, object]:
        return {"plugin": self.plugin, "distribution": self.distribution,
                "version": self.version, "backend": self.backend, "kind": self.kind,
                "cause": self.cause}


class DuplicateBackendError(PluginError):
    """Two plugins registered the same backend name."""

    def __init__(self, name: str, first_plugin: str, second_plugin: str, *,
                 first_origin: str = "", distribution: str = "", version: str = ""):
        self.first_plugin = first_plugin
        first = first_origin or f"plugin {first_plugin!r}"
        super().__init__(
            second_plugin,
            f"backend name {name!r} is already registered by {first}; "
            f"names must be unique (rename one, or disable one of {first_plugin!r} and "
            f"{second_plugin!r})",
            backend=name, kind="duplicate", distribution=distribution, version=version,
        )


class BackendUnavailableError(AttnregError):
    """A registered backend that cannot run here (missing library, wrong platform)."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"backend {name!r} is unavailable: {reason}")


class UnsupportedError(AttnregError, ValueError):
    """A request outside a backend's declaration, refused before any kernel launch."""

    def __init__(self, backend: str, what: str, reasons: Sequence[str] | str,
                 hint: str = ""):
        self.backend = backend
        self.what = what
        self.reasons = [reasons] if isinstance(reasons, str) else list(reasons)
        self.hint = hint or ("see `attnreg backends --json` for what this backend declares, "
                             "or choose another backend")
        super().__init__(str(self))

    def __str__(self) -> str:
        return (f"{self.backend}: unsupported {self.what}: " + "; ".join(self.reasons)
                + f". {self.hint}")


class GraphPolicyError(AttnregError):
    """The graph configuration cannot run: a locked mode breaks a hard rule, or no
    backend can serve a phase.

    ``reasons`` lists every reason, each naming its policy rule id (listed in
    ``attnreg.graph_policy.RULES``) before its message.  A reason about one
    phase starts with that phase, and with the mode when the user locked it:
    ``"decode: backend.unavailable: ..."``, ``"prefill breakable (set by the
    user): backend.capture_unsupported: ..."``; one about no phase starts with
    the rule id: ``"platform.arch_required: ..."``.  ``hint`` says what to do.
    """

    DEFAULT_HINT = ("Unlock the mode (drop the explicit flag) or choose a backend that "
                    "supports it.")

    def __init__(self, reasons: Sequence[str], hint: str = DEFAULT_HINT):
        self.reasons = list(reasons)
        self.hint = hint
        body = "\n".join(f"  - {r}" for r in self.reasons)
        super().__init__("the requested graph configuration cannot run:\n" + body +
                         "\n" + hint)
