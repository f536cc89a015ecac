"""BackendSpec: what a plugin registers for one backend."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from .capabilities import Capabilities, Requirement
from .platform import Platform

__all__ = ["NAME_RE", "BackendSpec", "DeclarationContext", "installed_version",
           "unmet_requirement"]

#: Backend names: lower-case identifiers, so they work as CLI values and in env vars.
NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


def installed_version(distribution: str) -> str | None:
    """The installed version of a distribution, without importing it (None if absent)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class DeclarationContext:
    """The inputs of a capability function: platform and installed library versions.

    ``versions`` maps distribution names to installed versions (None when not
    installed).  ``triton_interpreter`` is True when ``TRITON_INTERPRET=1``
    (Triton kernels then run on the CPU, slowly: for tests).  Capability
    functions must read only this, never import kernels.
    """

    platform: Platform
    versions: Mapping[str, str | None] = field(default_factory=dict)
    triton_interpreter: bool = field(
        default_factory=lambda: os.environ.get("TRITON_INTERPRET", "") == "1")

    def version(self, distribution: str) -> str | None:
        if distribution in self.versions:
            return self.versions[distribution]
        return installed_version(distribution)

    def version_at_least(self, distribution: str, minimum: str) -> bool:
        """Compare dotted versions numerically (pre-release tags are ignored)."""
        have = self.version(distribution)
        if have is None:
            return False
        return _version_tuple(have) >= _version_tuple(minimum)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in re.split(r"[.+-]", text):
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
    return tuple(parts)


def _importable(import_name: str) -> bool:
    """Whether a module can be found, without importing it (parents may be imported)."""
    try:
        return importlib.util.find_spec(import_name) is not None
    except (ImportError, ValueError):
        return False


def unmet_requirement(req: Requirement, ctx: DeclarationContext | None) -> str:
    """Why ``req`` is not met ("" when it is): not installed, or older than ``min_version``.

    A version given in ``ctx.versions`` is taken as is (None = not installed),
    so a simulated environment does not depend on this machine.  Otherwise a
    distribution without metadata still counts as installed when its module
    can be found (e.g. a source checkout on ``PYTHONPATH``).
    """
    if ctx is not None and req.distribution in ctx.versions:
        have = ctx.versions[req.distribution]
    else:
        have = installed_version(req.distribution)
        if have is None and _importable(req.import_name):
            return ""
    if have is None:
        return f"{req.distribution} not installed: {req.install_hint()}"
    if req.min_version and _version_tuple(have) < _version_tuple(req.min_version):
        return (f"{req.distribution} {have} is older than the {req.min_version} it needs: "
                f"{req.install_hint()}")
    return ""


@dataclass(frozen=True)
class BackendSpec:
    """One backend, as registered by a plugin.

    Parameters
    ----------
    name:
        unique backend name (``[a-z][a-z0-9_]*``).
    summary:
        one line for listings.
    capabilities:
        ``f(DeclarationContext) -> Capabilities``; pure, no kernel import.
    runtime:
        ``"package.module:ClassName"`` of the runtime class, imported only
        by :meth:`load_runtime`.
    requires:
        every library the runtime needs (:class:`Requirement`); one that is
        missing or too old makes the backend unavailable with an install hint
        instead of an error.  The one place requirements are declared
        (``Capabilities.requires`` is refused).
    plugin, distribution, distribution_version:
        stamped by the host at registration; plugins leave them empty.
    """

    name: str
    summary: str
    capabilities: Callable[[DeclarationContext], Capabilities]
    runtime: str
    requires: tuple[Requirement, ...] = ()
    plugin: str = ""
    distribution: str = ""
    distribution_version: str = ""

    def stamped(self, plugin: str, distribution: str, version: str) -> BackendSpec:
        return replace(self, plugin=plugin, distribution=distribution,
                       distribution_version=version)

    def missing_requirements(self, ctx: DeclarationContext | None = None) -> list[Requirement]:
        """The requirements not installed, or older than their ``min_version``
        (see :func:`unmet_requirement`)."""
        return [req for req in self.requires if unmet_requirement(req, ctx)]

    def unmet_requirements(self, ctx: DeclarationContext | None = None) -> list[str]:
        """One reason per unmet requirement, with its install hint."""
        return [why for why in (unmet_requirement(r, ctx) for r in self.requires) if why]

    def load_runtime(self) -> type:
        """Import and return the runtime class named by ``runtime``."""
        module_name, _, attr = self.runtime.partition(":")
        module = importlib.import_module(module_name)
        try:
            return getattr(module, attr)
        except AttributeError:
            raise ImportError(f"module {module_name!r} has no attribute {attr!r} "
                              f"(runtime path {self.runtime!r} of backend {self.name!r})") from None
