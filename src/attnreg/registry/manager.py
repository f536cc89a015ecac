"""The plugin manager and the backend registry built from it.

Loading order (see docs/hooks.md):

1. hookspecs;
2. blocked names (``disable=`` argument, ``ATTNREG_DISABLE``): a blocked name
   may be a plugin (entry-point) name or a backend name;
3. built-in backends (the ``attnreg.builtin`` plugin, by dotted path);
4. entry points of group ``attnreg.backends``, unless
   ``ATTNREG_DISABLE_PLUGIN_AUTOLOAD=1``; ``ATTNREG_PLUGINS`` (comma list)
   is an allowlist of entry-point or distribution names (set but empty = none);
5. ``check_pending()``: an implementation of an unknown hook is a plugin error.

A failing plugin (import error, raising hook, invalid declaration, duplicate
name, unknown hook) is recorded with its name and cause: listing continues,
asking for the affected backend by name raises.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import pluggy

from . import hookspecs
from .capabilities import Capabilities, Phase
from .errors import (
    BackendUnavailableError,
    DuplicateBackendError,
    PluginError,
    UnknownBackendError,
)
from .platform import Platform
from .spec import BackendSpec, DeclarationContext, installed_version
from .validation import validate_capabilities, validate_spec

if TYPE_CHECKING:  # annotations only: the registry imports no torch at run time
    from attnreg.runtime import AttentionBackend, MLAConfig

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "Availability",
    "BackendRegistry",
    "PluginInfo",
    "get_registry",
    "load_registry",
]

ENTRY_POINT_GROUP = "attnreg.backends"

#: Built-in plugins, by dotted path: the registry imports no backend module itself.
BUILTIN_PLUGINS: tuple[tuple[str, str], ...] = (("attnreg.builtin", "attnreg.backends.builtin"),)

#: Platforms every declaration is validated on at registration, besides the
#: one asked for later; catches nonsense early, at no kernel import.
_VALIDATION_PLATFORMS = ("cpu", "cuda:sm90", "cuda:sm100")


@dataclass(frozen=True)
class PluginInfo:
    """A loaded plugin: its name, module, distribution and the hooks it implements."""

    name: str
    module: str
    distribution: str
    version: str
    builtin: bool
    hooks: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "module": self.module, "distribution": self.distribution,
                "version": self.version, "builtin": self.builtin, "hooks": list(self.hooks)}


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on a platform, and why not."""

    name: str
    platform: Platform
    available: bool
    reason: str = ""
    capabilities: Capabilities | None = None


def _env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    return [p.strip() for p in raw.split(",") if p.strip()]


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass
class BackendRegistry:
    """All registered backends, their plugins and the errors met while loading."""

    pm: pluggy.PluginManager
    specs: dict[str, BackendSpec] = field(default_factory=dict)
    plugins: list[PluginInfo] = field(default_factory=list)
    errors: list[PluginError] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)

    # -- lookups -------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.specs)

    def _error_for(self, name: str) -> PluginError | None:
        for err in self.errors:
            if err.backend == name:
                return err
        return None

    def get(self, name: str) -> BackendSpec:
        """The spec of ``name``; raises the plugin's error or a did-you-mean error."""
        if name in self.specs:
            return self.specs[name]
        err = self._error_for(name)
        if err is not None:
            raise err
        if name in self.disabled:
            raise BackendUnavailableError(name, "disabled (--disable or ATTNREG_DISABLE)")
        raise UnknownBackendError(name, self.specs)

    def declaration(self, name: str, platform: Platform | str,
                    versions: Mapping[str, str | None] | None = None) -> Capabilities:
        """The validated declaration of ``name`` on ``platform``.

        Raises :class:`PluginError` when the capability function raises or
        returns something invalid.
        """
        spec = self.get(name)
        return _evaluate(spec, Platform.parse(platform), versions)

    def availability(self, name: str, platform: Platform | str | None = None,
                     versions: Mapping[str, str | None] | None = None, *,
                     assume_installed: bool = False) -> Availability:
        """Whether ``name`` runs on ``platform`` (default: detected), with the reasons if not.

        ``assume_installed`` ignores missing optional dependencies: use it to
        ask what a *simulated* platform (``cuda:sm100`` from a laptop) would get.
        """
        plat = Platform.parse(platform) if platform is not None else Platform.detect()
        spec = self.get(name)
        try:
            caps = _evaluate(spec, plat, versions)
        except PluginError as exc:
            return Availability(name, plat, False, str(exc))
        reasons = []
        if caps.platform_reason or not caps.kernels:
            reasons.append(caps.platform_reason or f"no kernel of {name} runs on {plat}")
        if not assume_installed:
            ctx = DeclarationContext(plat, versions or {})
            reasons.extend(f"{r.distribution} not installed: {r.install_hint()}"
                           for r in spec.missing_requirements(ctx))
        if reasons:
            return Availability(name, plat, False, "; ".join(reasons), caps)
        return Availability(name, plat, True, "", caps)

    def available(self, platform: Platform | str | None = None,
                  phase: Phase | str | None = None,
                  versions: Mapping[str, str | None] | None = None, *,
                  assume_installed: bool = False) -> list[Availability]:
        """Available backends on ``platform`` (serving ``phase``), best priority first."""
        out = []
        for name in self.names():
            a = self.availability(name, platform, versions, assume_installed=assume_installed)
            if not a.available or a.capabilities is None:
                continue
            if phase is not None and not a.capabilities.serves(phase):
                continue
            out.append(a)
        out.sort(key=lambda a: (-(a.capabilities.priority if a.capabilities else 0), a.name))
        return out

    def load(self, name: str, platform: Platform | str | None = None) -> type:
        """Import the runtime class of ``name`` after checking it can run on ``platform``."""
        avail = self.availability(name, platform)
        if not avail.available:
            raise BackendUnavailableError(name, avail.reason)
        spec = self.get(name)
        try:
            return spec.load_runtime()
        except ImportError as exc:
            raise BackendUnavailableError(
                name, f"runtime {spec.runtime!r} could not be imported ({exc}); "
                f"plugin {spec.plugin!r} may be incomplete") from exc

    def create(self, name: str, config: MLAConfig, *, platform: Platform | str | None = None,
               **kwargs: Any) -> AttentionBackend[Any, Any]:
        """Instantiate backend ``name`` for an ``MLAConfig``.

        The declaration is evaluated for ``platform``; by default the platform of
        the config's device: ``cpu`` for a cpu config (even on a GPU machine),
        else the detected one.  ``ATTNREG_PLATFORM`` (a simulated platform)
        overrides both.
        """
        if platform is not None:
            plat = Platform.parse(platform)
        elif (str(getattr(config, "device", "")).split(":")[0] == "cpu"
              and not os.environ.get("ATTNREG_PLATFORM")):
            plat = Platform.parse("cpu")
        else:
            plat = Platform.detect()
        cls = self.load(name, plat)
        caps = self.declaration(name, plat)
        backend: AttentionBackend[Any, Any] = cls(config, capabilities=caps, **kwargs)
        return backend


@lru_cache(maxsize=64)
def _evaluate_cached(spec: BackendSpec, platform: Platform,
                     versions_key: tuple[tuple[str, str | None], ...]) -> Capabilities:
    ctx = DeclarationContext(platform, dict(versions_key))
    try:
        caps = spec.capabilities(ctx)
    except Exception as exc:  # a plugin bug must not crash listings
        raise PluginError(spec.plugin or "?", f"capability function raised "
                          f"{type(exc).__name__}: {exc}", backend=spec.name,
                          kind="declaration error",
                          traceback_text=traceback.format_exc()) from exc
    reasons = validate_capabilities(caps, spec.name)
    if reasons:
        raise PluginError(spec.plugin or "?", "invalid declaration on "
                          f"{platform}: " + "; ".join(reasons), backend=spec.name,
                          kind="invalid declaration")
    return caps


def _evaluate(spec: BackendSpec, platform: Platform,
              versions: Mapping[str, str | None] | None) -> Capabilities:
    key = tuple(sorted((versions or {}).items()))
    return _evaluate_cached(spec, platform, key)


def _make_pm() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    return pm


def _own_version() -> str:
    return installed_version("attnreg") or "0+unknown"


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


def load_registry(disable: Sequence[str] = (), *, autoload: bool | None = None,
                  allow: Sequence[str] | None = None,
                  extra_plugins: Sequence[tuple[str, Any]] = ()) -> BackendRegistry:
    """Build a fresh registry.

    Parameters
    ----------
    disable:
        plugin or backend names to block (added to ``ATTNREG_DISABLE``).
    autoload:
        load entry points; default: unless ``ATTNREG_DISABLE_PLUGIN_AUTOLOAD=1``.
    allow:
        allowlist of entry-point or distribution names; default
        ``ATTNREG_PLUGINS`` (unset = all, set but empty = none).
    extra_plugins:
        ``(name, module_or_object)`` pairs registered after the entry points
        (tests and embedding engines).
    """
    blocked = list(disable) + (_env_list("ATTNREG_DISABLE") or [])
    if autoload is None:
        autoload = not _truthy("ATTNREG_DISABLE_PLUGIN_AUTOLOAD")
    if allow is None:
        allow = _env_list("ATTNREG_PLUGINS")

    pm = _make_pm()
    reg = BackendRegistry(pm=pm, disabled=sorted(set(blocked)))
    for name in blocked:
        pm.set_blocked(name)

    candidates: list[tuple[str, Any, str, str, bool]] = []  # name, loader, dist, version, builtin
    for name, dotted in BUILTIN_PLUGINS:
        candidates.append((name, dotted, "attnreg", _own_version(), True))
    if autoload:
        for ep in _entry_points():
            dist = ep.dist.name if ep.dist is not None else ""
            if allow is not None and ep.name not in allow and dist not in allow:
                continue
            version = ep.dist.version if ep.dist is not None else ""
            candidates.append((ep.name, ep, dist, version, False))
    for name, obj in extra_plugins:
        candidates.append((name, obj, "", "", False))

    for name, loader, dist, version, builtin in candidates:
        if pm.is_blocked(name):
            continue
        try:
            if isinstance(loader, str):
                plugin = importlib.import_module(loader)
            elif isinstance(loader, importlib.metadata.EntryPoint):
                plugin = loader.load()
            else:
                plugin = loader
        except Exception as exc:
            reg.errors.append(PluginError(name, f"failed to import: {type(exc).__name__}: {exc}",
                                          kind="import error",
                                          traceback_text=traceback.format_exc()))
            continue
        try:
            pm.register(plugin, name=name)
        except Exception as exc:  # pluggy validation of hookimpl signatures
            reg.errors.append(PluginError(name, f"rejected by the plugin manager: {exc}",
                                          kind="invalid hook"))
            continue
        module = getattr(plugin, "__name__", type(plugin).__name__)
        hooks = tuple(sorted(h.name for h in pm.get_hookcallers(plugin) or ()))
        reg.plugins.append(PluginInfo(name, module, dist, version, builtin, hooks))

    _check_pending(reg)
    _collect_backends(reg, set(blocked))
    return reg


def _check_pending(reg: BackendRegistry) -> None:
    """pluggy's check_pending, turned into per-plugin errors instead of one crash."""
    while True:
        try:
            reg.pm.check_pending()
            return
        except pluggy.PluginValidationError as exc:
            plugin = exc.plugin
            name = reg.pm.get_name(plugin) or str(plugin)
            reg.errors.append(PluginError(name, f"implements an unknown hook: {exc}",
                                          kind="unknown hook"))
            reg.pm.unregister(plugin)
            reg.plugins = [p for p in reg.plugins if p.name != name]


def _collect_backends(reg: BackendRegistry, blocked: set[str]) -> None:
    by_plugin = {p.name: p for p in reg.plugins}
    impls = reg.pm.hook.attnreg_register_backends.get_hookimpls()
    # pluggy lists implementations in reverse call order; we want registration order
    # (built-ins first), so a duplicate is blamed on the later plugin.
    order = {p.name: i for i, p in enumerate(reg.plugins)}
    impls = sorted(impls, key=lambda i: order.get(i.plugin_name, 1 << 30))
    for impl in impls:
        info = by_plugin.get(impl.plugin_name)
        plugin_name = impl.plugin_name

        def register(spec: BackendSpec, _plugin: str = plugin_name,
                     _info: PluginInfo | None = info) -> None:
            reasons = validate_spec(spec)
            if reasons:
                label = getattr(spec, "name", None)
                reg.errors.append(PluginError(_plugin, "invalid BackendSpec: " +
                                              "; ".join(reasons),
                                              backend=label if isinstance(label, str) else None,
                                              kind="invalid declaration"))
                return
            if spec.name in blocked:
                return
            stamped = spec.stamped(_plugin, _info.distribution if _info else "",
                                   _info.version if _info else "")
            if spec.name in reg.specs:
                reg.errors.append(DuplicateBackendError(spec.name, reg.specs[spec.name].plugin,
                                                        _plugin))
                return
            for plat in _VALIDATION_PLATFORMS:
                try:
                    _evaluate(stamped, Platform.parse(plat), None)
                except PluginError as exc:
                    reg.errors.append(exc)
                    return
            reg.specs[spec.name] = stamped

        kwargs = {arg: register for arg in impl.argnames if arg == "register"}
        try:
            impl.function(**kwargs)
        except Exception as exc:
            reg.errors.append(PluginError(plugin_name, f"attnreg_register_backends raised "
                                          f"{type(exc).__name__}: {exc}", kind="hook error",
                                          traceback_text=traceback.format_exc()))


_DEFAULT: dict[tuple[Any, ...], BackendRegistry] = {}


def get_registry(disable: Sequence[str] = ()) -> BackendRegistry:
    """The process-wide registry for the current environment (cached)."""
    key = (tuple(sorted(disable)), os.environ.get("ATTNREG_DISABLE"),
           os.environ.get("ATTNREG_PLUGINS"), os.environ.get("ATTNREG_DISABLE_PLUGIN_AUTOLOAD"))
    if key not in _DEFAULT:
        _DEFAULT[key] = load_registry(disable)
    return _DEFAULT[key]
