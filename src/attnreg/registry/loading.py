"""Loading plugins in isolation: each import, registration and hook call is guarded and timed.

A plugin is third-party code run inside every attnreg command.  Whatever it
does at import or in its hook (raise, ``sys.exit()``, import torch, sleep) must
not stop attnreg, and must be visible, with the plugin's name, in
``attnreg doctor``.  Everything except ``KeyboardInterrupt`` is caught: a
``SystemExit`` from a plugin is a bug of that plugin, not a request to stop
the host.

The hook itself is called once, through pluggy's caller
(``pm.hook.attnreg_register_backends``), so ``tryfirst``/``trylast``, hook
wrappers and ``pm.enable_tracing()`` behave as pluggy documents.  Isolation
comes from what attnreg registers with pluggy for each plugin: an
:class:`IsolatedPlugin` carrying the plugin's hook implementations with the
same options, each plain implementation guarded so that its failure is
recorded against its plugin and the call goes on to the next one.
"""

from __future__ import annotations

import functools
import sys
import time
import traceback
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pluggy

from .deprecation import recording
from .errors import origin_label

__all__ = [
    "DEFAULT_HEAVY_MODULES",
    "DEFAULT_SLOW_SECONDS",
    "HookSession",
    "IsolatedPlugin",
    "PluginInfo",
    "StartupLimits",
    "describe_exception",
    "measure",
]

#: Libraries whose import at startup a plugin is warned about (top-level module names).
DEFAULT_HEAVY_MODULES: tuple[str, ...] = ("torch", "triton", "flashinfer", "flash_attn", "jax",
                                          "tensorflow", "cupy")
#: A plugin whose import plus hook call takes longer than this is warned about (seconds).
DEFAULT_SLOW_SECONDS = 0.5


@dataclass(frozen=True)
class StartupLimits:
    """When a plugin's startup cost earns a warning.

    Configurable through ``ATTNREG_SLOW_PLUGIN_SECONDS`` (a number of
    seconds) and ``ATTNREG_HEAVY_MODULES`` (comma-separated top-level module
    names; set but empty = none).  A value that does not parse is an
    ``EnvironmentValueError`` (:mod:`attnreg.registry.environment`).
    """

    slow_seconds: float = DEFAULT_SLOW_SECONDS
    heavy_modules: tuple[str, ...] = DEFAULT_HEAVY_MODULES

    @classmethod
    def from_env(cls) -> StartupLimits:
        """The limits ``ATTNREG_SLOW_PLUGIN_SECONDS`` and ``ATTNREG_HEAVY_MODULES`` set.

        Raises
        ------
        EnvironmentValueError
            A value that does not parse (named, with what is allowed).
        """
        from .environment import env_value

        heavy = env_value("ATTNREG_HEAVY_MODULES")
        return cls(float(env_value("ATTNREG_SLOW_PLUGIN_SECONDS")),
                   DEFAULT_HEAVY_MODULES if heavy is None else tuple(heavy))


@dataclass(frozen=True)
class PluginInfo:
    """A plugin attnreg tried to load: where it comes from, whether it loaded, what it cost.

    ``loaded`` is False for a plugin that failed to import or that pluggy
    rejected (its error is in ``BackendRegistry.errors``).  The figures are
    wall-clock seconds of its import and of its hook call, and the heavy
    libraries (see :class:`StartupLimits`) that were first imported during
    either.  ``call_order`` is the position of its ``attnreg_register_backends``
    in pluggy's call (0 = called first), None when it was not called.
    ``deprecations`` holds the message of every deprecated attnreg form it
    used while it was imported, called and its declarations evaluated
    (:mod:`attnreg.registry.deprecation`); ``attnreg doctor`` lists them.
    """

    name: str
    module: str
    distribution: str
    version: str
    builtin: bool
    hooks: tuple[str, ...] = ()
    loaded: bool = True
    import_seconds: float = 0.0
    hook_seconds: float = 0.0
    heavy_imports: tuple[str, ...] = ()
    call_order: int | None = None
    deprecations: tuple[str, ...] = ()

    @property
    def origin(self) -> str:
        """``plugin 'demo' (attnreg-demo 1.2.3)``."""
        return origin_label(self.name, self.distribution, self.version)

    @property
    def startup_seconds(self) -> float:
        return self.import_seconds + self.hook_seconds

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "module": self.module, "distribution": self.distribution,
                "version": self.version, "builtin": self.builtin, "loaded": self.loaded,
                "hooks": list(self.hooks), "import_seconds": round(self.import_seconds, 6),
                "hook_seconds": round(self.hook_seconds, 6),
                "heavy_imports": list(self.heavy_imports), "call_order": self.call_order,
                "deprecations": list(self.deprecations)}


def describe_exception(exc: BaseException) -> str:
    """What code did, in one line: ``raised ValueError: ...`` or ``called sys.exit(1) (SystemExit)``."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}) (SystemExit)"
    text = " ".join(str(exc).split())
    return f"raised {type(exc).__name__}: {text}" if text else f"raised {type(exc).__name__}"


class Measured:
    """Seconds spent and heavy modules first imported inside a :func:`measure` block."""

    # A plain class, like HookSession: every dataclass costs import time at startup.
    __slots__ = ("heavy", "seconds")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.heavy: tuple[str, ...] = ()


@contextmanager
def measure(heavy_modules: tuple[str, ...]) -> Iterator[Measured]:
    """Time a block and list the heavy top-level modules it imported (sys.modules diff)."""
    before = set(sys.modules)
    out = Measured()
    start = time.perf_counter()
    try:
        yield out
    finally:
        out.seconds = time.perf_counter() - start
        new = {name.partition(".")[0] for name in set(sys.modules) - before}
        out.heavy = tuple(m for m in heavy_modules if m in new)


class HookSession:
    """One call of ``attnreg_register_backends`` across every plugin.

    Guarded implementations report here: which plugin is running (so that
    ``register`` knows whom a spec comes from), its time and heavy imports,
    and its failure.  ``registered`` keeps every (plugin, spec) in call
    order; the registry applies them afterwards in loading order.
    """

    def __init__(self, limits: StartupLimits) -> None:
        self.limits = limits
        self.current: str | None = None
        self.registered: list[tuple[str | None, Any]] = []
        self.call_order: list[str] = []
        self.figures: dict[str, Measured] = {}
        self.failures: dict[str, tuple[str, str]] = {}  # name -> (cause, traceback)
        self.deprecations: dict[str, list[str]] = {}  # name -> deprecated forms it used

    def register(self, spec: Any) -> None:
        """The ``register`` callback handed to every plugin."""
        self.registered.append((self.current, spec))

    def guard(self, plugin_name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` that records its failure against ``plugin_name`` instead of raising."""

        @functools.wraps(function)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.call_order.append(plugin_name)
            outer, self.current = self.current, plugin_name
            try:
                with measure(self.limits.heavy_modules) as m, \
                        recording(self.deprecations.setdefault(plugin_name, [])):
                    return function(*args, **kwargs)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: a plugin must not stop attnreg
                self.failures.setdefault(plugin_name, (describe_exception(exc),
                                                       traceback.format_exc()))
                return None
            finally:
                self.current = outer
                seen = self.figures.setdefault(plugin_name, Measured())
                seen.seconds += m.seconds
                seen.heavy = tuple(dict.fromkeys(seen.heavy + m.heavy))

        return guarded


def _delegating(function: Callable[..., Any]) -> Callable[..., Any]:
    """A generator function that runs the hook wrapper ``function`` unchanged."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Generator[Any, Any, Any]:
        return (yield from function(*args, **kwargs))

    return wrapper


class IsolatedPlugin:
    """What attnreg registers with pluggy for one plugin.

    It carries the plugin's hook implementations under their own names and
    with their own options (``tryfirst``, ``trylast``, ``wrapper``, ...):
    plain ones guarded by a :class:`HookSession`, wrappers delegated as they
    are.  ``plugin`` is the object the plugin's module or entry point gave.
    """

    def __init__(self, pm: pluggy.PluginManager, plugin: object, name: str,
                 session: HookSession):
        self.__dict__["_attnreg_plugin"] = plugin
        self.__dict__["_attnreg_name"] = name
        marker = f"{pm.project_name}_impl"
        for attr in dir(plugin):
            opts = pm.parse_hookimpl_opts(plugin, attr)
            if opts is None:
                continue
            original = getattr(plugin, attr)
            if opts.get("wrapper") or opts.get("hookwrapper"):
                impl = _delegating(original)
            else:
                impl = session.guard(name, original)
            setattr(impl, marker, dict(opts))
            self.__dict__[attr] = impl

    @property
    def plugin(self) -> object:
        return self.__dict__["_attnreg_plugin"]

    def __repr__(self) -> str:
        return f"<attnreg plugin {self.__dict__['_attnreg_name']!r}: {self.plugin!r}>"
