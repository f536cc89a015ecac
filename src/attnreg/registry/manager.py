"""The plugin manager and the backend registry built from it.

Loading order (see docs/hooks.md):

1. hookspecs;
2. blocked names (``disable=`` argument, ``ATTNREG_DISABLE``): a blocked name
   may be a plugin (entry-point) name, a distribution name or a backend name;
3. built-in backends (the ``attnreg.builtin`` plugin, by dotted path);
4. entry points of group ``attnreg.backends``, unless
   ``ATTNREG_DISABLE_PLUGIN_AUTOLOAD=1``; ``ATTNREG_PLUGINS`` (comma list)
   is an allowlist of entry-point or distribution names (set but empty = none);
   then ``extra_plugins``;
5. ``check_pending()``: an implementation of an unknown hook is a plugin error;
6. one call of ``attnreg_register_backends`` through pluggy's caller (pluggy's
   order: ``tryfirst``, then the last registered first, ``trylast`` built-ins
   last); the registered specs are then applied in *loading* order, so a
   duplicate name is blamed on the later-loaded plugin;
7. every declaration is evaluated and validated on :data:`VALIDATION_PLATFORMS`,
   then every FALLBACK target is checked against the loaded backends.

A failing plugin (import error or ``sys.exit()``, invalid or unknown hook, a
raising hook, an invalid declaration on some platform, a duplicate name, a
fallback to nothing) is recorded with its name, distribution and cause:
listing continues, asking for the affected backend by name raises.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import sys
import traceback
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import pluggy

from . import hookspecs
from .capabilities import Capabilities, Phase, Requirement, requires_deprecation
from .deprecation import recording, warn_deprecated_at
from .environment import env_value
from .errors import (
    BackendUnavailableError,
    DuplicateBackendError,
    PluginError,
    UnknownBackendError,
    closest_names,
)
from .loading import (
    HookSession,
    IsolatedPlugin,
    PluginInfo,
    StartupLimits,
    describe_exception,
    measure,
)
from .platform import Platform
from .resolution import RuntimeCheck, check_runtime
from .spec import BackendSpec, DeclarationContext
from .validation import validate_capabilities, validate_fallback_targets, validate_spec

if TYPE_CHECKING:  # annotations only: the registry imports no torch at run time
    from attnreg.runtime import AttentionBackend, MLAConfig

__all__ = [
    "BUILTIN_PLUGINS",
    "ENTRY_POINT_GROUP",
    "VALIDATION_PLATFORMS",
    "Availability",
    "BackendRegistry",
    "PluginInfo",
    "StartupWarning",
    "get_registry",
    "load_registry",
]

ENTRY_POINT_GROUP = "attnreg.backends"

#: Built-in plugins, by dotted path: the registry imports no backend module itself.
BUILTIN_PLUGINS: tuple[tuple[str, Any], ...] = (("attnreg.builtin", "attnreg.backends.builtin"),)

#: Platforms every declaration is evaluated and validated on at registration:
#: every vendor, with and without an arch, and the archs the built-ins
#: distinguish.  A declaration that raises or is invalid on any of them is
#: refused when the plugin loads, so later queries (``resolve()``, ``compat``)
#: on these platforms never meet a declaration error.
VALIDATION_PLATFORMS: tuple[str, ...] = (
    "cpu", "cuda", "cuda:sm80", "cuda:sm89", "cuda:sm90", "cuda:sm100", "cuda:sm103",
    "cuda:sm120", "rocm", "rocm:gfx942", "rocm:gfx950", "npu", "xpu")


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run on a platform, and why not.

    ``runtime`` says whether the backend's runtime dotted path resolves
    (checked without importing it); one known not to resolve makes the
    backend unavailable, so the graph policy never plans it.
    """

    name: str
    platform: Platform
    available: bool
    reason: str = ""
    capabilities: Capabilities | None = None
    runtime: RuntimeCheck | None = None


@dataclass(frozen=True)
class StartupWarning:
    """Something about a plugin that every command should mention, on one line.

    ``kind``: ``startup`` (imported a heavy library or was slow to load) or
    ``priority`` (a backend outranks every built-in, so it becomes the default).
    """

    plugin: str
    kind: str
    message: str

    def line(self) -> str:
        label = "warning" if self.kind == "startup" else "note"
        return f"attnreg: {label}: {self.message}"

    def to_dict(self) -> dict[str, str]:
        return {"plugin": self.plugin, "kind": self.kind, "message": self.message}


def _env_list(name: str) -> list[str] | None:
    """A comma-separated variable of :data:`~attnreg.registry.environment.ENV_VARS`
    (None when unset)."""
    raw = os.environ.get(name)
    return None if raw is None else list(env_value(name))


def _truthy(name: str) -> bool:
    """A yes/no variable; a value that is neither is an ``EnvironmentValueError``."""
    return bool(env_value(name))


def _norm(distribution: str) -> str:
    """A distribution name in its canonical form (PEP 503): ``Attnreg_Demo`` == ``attnreg-demo``."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


@dataclass
class BackendRegistry:
    """All registered backends, every plugin attnreg tried to load, and the errors met."""

    pm: pluggy.PluginManager
    specs: dict[str, BackendSpec] = field(default_factory=dict)
    plugins: list[PluginInfo] = field(default_factory=list)
    errors: list[PluginError] = field(default_factory=list)
    disabled: list[str] = field(default_factory=list)
    limits: StartupLimits = field(default_factory=StartupLimits)

    # -- lookups -------------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.specs)

    def plugin(self, name: str) -> PluginInfo | None:
        """The record of plugin ``name`` (loaded or not), None if attnreg never tried it."""
        for info in self.plugins:
            if info.name == name:
                return info
        return None

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
        returns something invalid (never on :data:`VALIDATION_PLATFORMS`
        without ``versions``: that was checked at registration).
        """
        spec = self.get(name)
        return _evaluate(spec, Platform.parse(platform), versions)

    def runtime_check(self, name: str) -> RuntimeCheck:
        """Whether the runtime dotted path of ``name`` resolves, checked without importing it."""
        return check_runtime(self.get(name).runtime)

    def availability(self, name: str, platform: Platform | str | None = None,
                     versions: Mapping[str, str | None] | None = None, *,
                     assume_installed: bool = False) -> Availability:
        """Whether ``name`` runs on ``platform`` (default: detected), with the reasons if not.

        ``assume_installed`` ignores missing optional dependencies: use it to
        ask what a *simulated* platform (``cuda:sm100`` from a laptop) would get.
        A runtime path known not to resolve makes the backend unavailable on
        every platform, simulated or not.
        """
        plat = Platform.parse(platform) if platform is not None else Platform.detect()
        spec = self.get(name)
        runtime = check_runtime(spec.runtime)
        try:
            caps = _evaluate(spec, plat, versions)
        except PluginError as exc:
            return Availability(name, plat, False, str(exc), runtime=runtime)
        reasons = []
        if caps.platform_reason or not (caps.kernels or caps.sparse_kernels):
            reasons.append(caps.platform_reason or f"no kernel of {name} runs on {plat}")
        if runtime.missing:
            reasons.append(f"its runtime {spec.runtime!r} does not resolve ({runtime.detail}); "
                           f"{_origin(spec)} is incomplete: reinstall or fix it")
        if not assume_installed:
            reasons.extend(spec.unmet_requirements(DeclarationContext(plat, versions or {})))
        if reasons:
            return Availability(name, plat, False, "; ".join(reasons), caps, runtime)
        return Availability(name, plat, True, "", caps, runtime)

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
              and env_value("ATTNREG_PLATFORM") is None):
            plat = Platform.parse("cpu")
        else:
            plat = Platform.detect()
        cls = self.load(name, plat)
        caps = self.declaration(name, plat)
        backend: AttentionBackend[Any, Any] = cls(config, capabilities=caps, **kwargs)
        return backend

    # -- what every command should mention -------------------------------------
    def startup_warnings(self) -> list[StartupWarning]:
        """One line per plugin that made startup heavy or slow, and per backend that
        outranks every built-in (it is preferred wherever it lets the requested mode run)."""
        out = []
        limit = self.limits.slow_seconds
        for p in self.plugins:
            if p.builtin:
                continue  # attnreg's own start-up cost is measured by its benchmarks (P5)
            problems = []
            if p.heavy_imports:
                problems.append(f"imported {', '.join(p.heavy_imports)}")
            if p.startup_seconds > limit:
                problems.append(f"took {p.startup_seconds:.2f} s (limit {limit:g} s)")
            if problems:
                out.append(StartupWarning(p.name, "startup", (
                    f"{p.origin} {' and '.join(problems)} at startup, which every attnreg "
                    "command pays: import torch and kernel libraries in the runtime module "
                    f"only (docs/hooks.md#startup-cost), or skip it with --disable {p.name}")))
        out.extend(self._priority_notes())
        return out

    def _priority_notes(self) -> list[StartupWarning]:
        builtin = [s for s in self.specs.values() if self._is_builtin(s)]
        ceiling = max((_top_priority(s) for s in builtin), default=0)
        notes = []
        for name in self.names():
            spec = self.specs[name]
            top = _top_priority(spec)
            if not self._is_builtin(spec) and top > ceiling:
                notes.append(StartupWarning(spec.plugin, "priority", (
                    f"backend {name!r} from {_origin(spec)} declares priority {top}, above "
                    f"every built-in (at most {ceiling}): it is preferred wherever it lets "
                    f"the requested graph mode run; choose another with --backend, or --disable {name}")))
        return notes

    def _is_builtin(self, spec: BackendSpec) -> bool:
        info = self.plugin(spec.plugin)
        return info is not None and info.builtin


def _origin(spec: BackendSpec) -> str:
    return PluginError(spec.plugin or "?", "", distribution=spec.distribution,
                       version=spec.distribution_version).origin


def _top_priority(spec: BackendSpec) -> int:
    """The highest priority ``spec`` declares where it has kernels (validation platforms)."""
    tops = []
    for plat in VALIDATION_PLATFORMS:
        try:
            caps = _evaluate(spec, Platform.parse(plat), None)
        except PluginError:
            continue
        if caps.kernels:
            tops.append(caps.priority)
    return max(tops, default=0)


@lru_cache(maxsize=2048)
def _evaluate_cached(spec: BackendSpec, platform: Platform,
                     versions_key: tuple[tuple[str, str | None], ...]) -> Capabilities:
    ctx = DeclarationContext(platform, dict(versions_key))
    origin = {"distribution": spec.distribution, "version": spec.distribution_version}
    try:
        caps = spec.capabilities(ctx)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a plugin bug (sys.exit included) must not crash listings
        raise PluginError(spec.plugin or "?", f"on {platform}, the capability function "
                          f"{describe_exception(exc)}", backend=spec.name,
                          kind="declaration error", traceback_text=traceback.format_exc(),
                          **origin) from exc
    reasons = validate_capabilities(caps, spec.name)
    if reasons:
        raise PluginError(spec.plugin or "?", f"on {platform}: " + "; ".join(reasons),
                          backend=spec.name,
                          kind="invalid declaration", **origin)
    return caps


def _evaluate(spec: BackendSpec, platform: Platform,
              versions: Mapping[str, str | None] | None) -> Capabilities:
    key = tuple(sorted((versions or {}).items()))
    return _evaluate_cached(spec, platform, key)


def _make_pm() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    if _truthy("ATTNREG_TRACE_HOOKS"):
        pm.trace.root.setwriter(sys.stderr.write)
        pm.enable_tracing()
    return pm


def _own_version() -> str:
    """attnreg.__version__, the one place the version is written (the installed
    metadata can lag behind a source tree on PYTHONPATH)."""
    import attnreg  # at call time: attnreg's __init__ imports this package first

    return attnreg.__version__


def _entry_points() -> Iterable[importlib.metadata.EntryPoint]:
    return importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)


class _Candidate:
    """A plugin to load: its name, how to get it, and where it comes from."""

    __slots__ = ("builtin", "distribution", "name", "source", "version")

    def __init__(self, name: str, source: Any, distribution: str, version: str,
                 builtin: bool) -> None:
        self.name = name
        self.source = source  # dotted "module[:attr]", an EntryPoint, or the plugin itself
        self.distribution = distribution
        self.version = version
        self.builtin = builtin

    @property
    def module(self) -> str:
        if isinstance(self.source, str):
            return self.source
        if isinstance(self.source, importlib.metadata.EntryPoint):
            return str(self.source.value)
        return str(getattr(self.source, "__name__", type(self.source).__name__))


def _import_dotted(path: str) -> Any:
    """``module`` or ``module:attr.attr`` -> the object."""
    module_name, _, attr = path.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def _distribution_of(source: Any) -> tuple[str, str]:
    """(distribution, version) of an extra plugin's top-level package, when one is installed
    under that name (``acme_attn`` -> ``acme-attn``); ("", "") otherwise.

    A name lookup, not ``packages_distributions()``, which reads every installed
    distribution's file list (a quarter of a second on a small environment).
    """
    if isinstance(source, str):
        module = source.partition(":")[0]
    else:
        module = str(getattr(source, "__name__", "") or type(source).__module__)
    top = module.partition(".")[0]
    if not top or top in ("builtins", "__main__"):
        return "", ""
    try:
        dist = importlib.metadata.distribution(top)
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return "", ""
    return str(dist.metadata["Name"] or top), dist.version or ""


def _candidates(autoload: bool, allow: Sequence[str] | None,
                extra_plugins: Sequence[tuple[str, Any]]) -> list[_Candidate]:
    out = [_Candidate(name, source, "attnreg", _own_version(), True)
           for name, source in BUILTIN_PLUGINS]
    if autoload:
        allowed = None if allow is None else {_norm(a) for a in allow} | set(allow)
        for ep in _entry_points():
            dist = ep.dist.name if ep.dist is not None else ""
            if allowed is not None and ep.name not in allowed and _norm(dist) not in allowed:
                continue
            version = ep.dist.version if ep.dist is not None else ""
            out.append(_Candidate(ep.name, ep, dist, version, False))
    for name, obj in extra_plugins:
        dist, version = _distribution_of(obj)
        out.append(_Candidate(name, obj, dist, version, False))
    return out


def _one_line(exc: BaseException) -> str:
    """pluggy's multi-line validation message as one line, without the plugin name it repeats."""
    lines = [" ".join(line.split()) for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].startswith("Plugin "):
        lines = lines[1:]
    return "; ".join(lines) or type(exc).__name__


class _Loader:
    """Fills one registry: loads each candidate in isolation, calls the hook, applies specs."""

    def __init__(self, reg: BackendRegistry, blocked: Sequence[str]):
        self.reg = reg
        self.pm = reg.pm
        self.blocked = set(blocked)
        self.blocked_dists = {_norm(b) for b in blocked}
        self.session = HookSession(reg.limits)

    # -- bookkeeping -----------------------------------------------------------
    def _set(self, info: PluginInfo) -> None:
        plugins = self.reg.plugins
        for i, old in enumerate(plugins):
            if old.name == info.name:
                plugins[i] = info
                return
        plugins.append(info)

    def error(self, plugin: str | None, cause: str, *, kind: str, backend: str | None = None,
              traceback_text: str = "") -> None:
        name = plugin or "?"
        info = self.reg.plugin(name)
        self.reg.errors.append(PluginError(
            name, cause, kind=kind, backend=backend, traceback_text=traceback_text,
            distribution=info.distribution if info else "",
            version=info.version if info else ""))

    def note_deprecations(self, plugin: str, messages: Sequence[str]) -> None:
        """Add deprecated forms ``plugin`` used to its :class:`PluginInfo` (once each)."""
        info = self.reg.plugin(plugin)
        if info is not None and messages:
            self._set(replace(info, deprecations=tuple(dict.fromkeys(
                info.deprecations + tuple(messages)))))

    # -- steps -----------------------------------------------------------------
    def load(self, c: _Candidate) -> None:
        if self.pm.is_blocked(c.name) or (c.distribution and
                                          _norm(c.distribution) in self.blocked_dists):
            return
        info = PluginInfo(c.name, c.module, c.distribution, c.version, c.builtin, loaded=False)
        failure: BaseException | None = None
        tb = ""
        deprecated: list[str] = []
        with measure(self.reg.limits.heavy_modules) as m:
            try:
                with recording(deprecated):
                    plugin = self._get(c.source)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: a plugin must not stop attnreg
                failure, tb = exc, traceback.format_exc()
        info = replace(info, import_seconds=m.seconds, heavy_imports=m.heavy,
                       deprecations=tuple(deprecated))
        self._set(info)
        if failure is not None:
            self.error(c.name, f"importing {c.module} {describe_exception(failure)}",
                       kind="import error", traceback_text=tb)
            return
        try:
            isolated = IsolatedPlugin(self.pm, plugin, c.name, self.session)
            self.pm.register(isolated, name=c.name)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # pluggy's validation of hookimpl signatures, mostly
            self.error(c.name, _one_line(exc) + " (the hookspec is "
                       "attnreg_register_backends(register))", kind="invalid hook")
            return
        hooks = tuple(sorted(h.name for h in self.pm.get_hookcallers(isolated) or ()))
        self._set(replace(info, loaded=True, hooks=hooks))

    @staticmethod
    def _get(source: Any) -> Any:
        if isinstance(source, str):
            return _import_dotted(source)
        if isinstance(source, importlib.metadata.EntryPoint):
            return source.load()
        return source

    def check_pending(self) -> None:
        """pluggy's check_pending, turned into per-plugin errors instead of one crash."""
        known = sorted(name for name, caller in vars(self.pm.hook).items()
                       if isinstance(caller, pluggy.HookCaller) and caller.has_spec())
        while True:
            try:
                self.pm.check_pending()
                return
            except pluggy.PluginValidationError as exc:
                plugin = exc.plugin
                name = self.pm.get_name(plugin) or str(plugin)
                unknown = sorted(h.name for h in self.pm.get_hookcallers(plugin) or ()
                                 if not h.has_spec())
                hint = "; ".join(f"did you mean {', '.join(close)}?" for h in unknown
                                 if (close := closest_names(h, known)))
                self.error(name, f"implements {', '.join(unknown) or 'a hook'}, which is not "
                           f"an attnreg hook{' (' + hint + ')' if hint else ''}; the hooks "
                           f"are: {', '.join(known)}", kind="unknown hook")
                self.pm.unregister(plugin)
                info = self.reg.plugin(name)
                if info is not None:
                    self._set(replace(info, loaded=False))

    def call_hook(self) -> None:
        """One call through pluggy's caller; guarded implementations report to the session."""
        try:
            self.pm.hook.attnreg_register_backends(register=self.session.register)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # only a hook *wrapper* can get here
            wrappers = [i.plugin_name for i in
                        self.pm.hook.attnreg_register_backends.get_hookimpls()
                        if i.wrapper or i.hookwrapper]
            self.error(wrappers[0] if len(wrappers) == 1 else None,
                       f"a hook wrapper of attnreg_register_backends {describe_exception(exc)}",
                       kind="hook error", traceback_text=traceback.format_exc())
        for name, (cause, tb) in self.session.failures.items():
            self.error(name, f"attnreg_register_backends {cause}", kind="hook error",
                       traceback_text=tb)
        order = list(dict.fromkeys(self.session.call_order))
        for name, seen in self.session.figures.items():
            info = self.reg.plugin(name)
            if info is not None:
                self._set(replace(info, hook_seconds=seen.seconds,
                                  heavy_imports=tuple(dict.fromkeys(info.heavy_imports
                                                                    + seen.heavy)),
                                  call_order=order.index(name)))
        for name, messages in self.session.deprecations.items():
            self.note_deprecations(name, messages)

    def apply_registrations(self) -> None:
        """Validate, stamp and store every registered spec, in loading order."""
        rank = {p.name: i for i, p in enumerate(self.reg.plugins)}
        entries = sorted(self.session.registered, key=lambda e: rank.get(e[0] or "", 1 << 30))
        for plugin_name, spec in entries:
            self._apply(plugin_name or "?", spec)

    def _apply(self, plugin: str, spec: Any) -> None:
        reasons = validate_spec(spec)
        if reasons:
            label = getattr(spec, "name", None)
            self.error(plugin, "invalid BackendSpec: " + "; ".join(reasons),
                       backend=label if isinstance(label, str) else None,
                       kind="invalid declaration")
            return
        if spec.name in self.blocked:
            return
        info = self.reg.plugin(plugin)
        stamped = spec.stamped(plugin, info.distribution if info else "",
                               info.version if info else "")
        if spec.name in self.reg.specs:
            first = self.reg.specs[spec.name]
            self.reg.errors.append(DuplicateBackendError(
                spec.name, first.plugin, plugin, first_origin=_origin(first),
                distribution=stamped.distribution, version=stamped.distribution_version))
            return
        deprecated: list[str] = []
        legacy: list[Requirement] = []
        with recording(deprecated):
            for plat in VALIDATION_PLATFORMS:
                try:
                    caps = _evaluate(stamped, Platform.parse(plat), None)
                except PluginError as exc:
                    self.reg.errors.append(exc)
                    self.note_deprecations(plugin, deprecated)
                    return
                legacy.extend(caps.requires)
        if legacy:
            # attnreg 0.1.0 read requirements from Capabilities(requires=...): merge them
            # into the spec's, the one place they are read now (deprecated in 0.2.0).
            stamped = replace(stamped, requires=tuple(dict.fromkeys(stamped.requires
                                                                    + tuple(legacy))))
            with recording(deprecated):
                warn_deprecated_at(requires_deprecation(spec.name), spec.capabilities)
        deprecated.extend(text for req in stamped.requires
                          if (text := getattr(req, "_deprecation", None)))
        self.note_deprecations(plugin, deprecated)
        self.reg.specs[spec.name] = stamped

    def validate_fallbacks(self) -> None:
        """Refuse backends whose FALLBACK names a missing or non-NATIVE target (to a fixed point)."""
        specs = self.reg.specs
        changed = True
        while changed:
            changed = False
            for name in sorted(specs):
                reasons = self._fallback_reasons(specs[name])
                if reasons:
                    spec = specs.pop(name)
                    self.reg.errors.append(PluginError(
                        spec.plugin, "; ".join(reasons), backend=name,
                        kind="invalid declaration", distribution=spec.distribution,
                        version=spec.distribution_version))
                    changed = True

    def _fallback_reasons(self, spec: BackendSpec) -> list[str]:
        for text in VALIDATION_PLATFORMS:
            plat = Platform.parse(text)

            def target_of(target: str, plat: Platform = plat) -> Capabilities | None:
                found = self.reg.specs.get(target)
                return _evaluate(found, plat, None) if found is not None else None

            # A disabled target is the user's choice, not the plugin's mistake:
            # the graph policy treats it as unavailable.
            reasons = validate_fallback_targets(_evaluate(spec, plat, None), target_of,
                                                skip=self.blocked)
            if reasons:
                return [f"on {plat}: {r}" for r in reasons]
        return []


def load_registry(disable: Sequence[str] = (), *, autoload: bool | None = None,
                  allow: Sequence[str] | None = None,
                  extra_plugins: Sequence[tuple[str, Any]] = ()) -> BackendRegistry:
    """Build a fresh registry.

    Parameters
    ----------
    disable:
        plugin, distribution or backend names to block (added to
        ``ATTNREG_DISABLE``).
    autoload:
        load entry points; default: unless ``ATTNREG_DISABLE_PLUGIN_AUTOLOAD=1``.
    allow:
        allowlist of entry-point or distribution names; default
        ``ATTNREG_PLUGINS`` (unset = all, set but empty = none).
    extra_plugins:
        ``(name, plugin)`` pairs loaded after the entry points (tests,
        embedding engines, ``--plugin``): ``plugin`` is a module or object
        with hook implementations, or a dotted ``"module[:attr]"`` string
        imported with the same isolation as an entry point.
    """
    blocked = list(disable) + (_env_list("ATTNREG_DISABLE") or [])
    if autoload is None:
        autoload = not _truthy("ATTNREG_DISABLE_PLUGIN_AUTOLOAD")
    if allow is None:
        allow = _env_list("ATTNREG_PLUGINS")

    reg = BackendRegistry(pm=_make_pm(), disabled=sorted(set(blocked)),
                          limits=StartupLimits.from_env())
    for name in blocked:
        reg.pm.set_blocked(name)
    loader = _Loader(reg, blocked)
    for candidate in _candidates(autoload, allow, extra_plugins):
        loader.load(candidate)
    loader.check_pending()
    loader.call_hook()
    loader.apply_registrations()
    loader.validate_fallbacks()
    return reg


_DEFAULT: dict[tuple[Any, ...], BackendRegistry] = {}


def get_registry(disable: Sequence[str] = ()) -> BackendRegistry:
    """The process-wide registry for the current environment (cached)."""
    key = (tuple(sorted(disable)), os.environ.get("ATTNREG_DISABLE"),
           os.environ.get("ATTNREG_PLUGINS"), os.environ.get("ATTNREG_DISABLE_PLUGIN_AUTOLOAD"))
    if key not in _DEFAULT:
        _DEFAULT[key] = load_registry(disable)
    return _DEFAULT[key]
