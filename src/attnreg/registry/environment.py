"""Every environment variable attnreg reads: one table, parsed like the flags they mirror.

:data:`ENV_VARS` is the list ``attnreg doctor`` prints and the one place each
variable's parser lives; code reads a variable through :func:`env_value`, so
a value that does not parse is an :class:`EnvironmentValueError` naming the
variable, the value and what is allowed (``attnreg`` turns it into one line
and exit 2), never ignored and never a bare ``ValueError``.

Variables other programs own (``TRITON_INTERPRET``, ``CUDA_VISIBLE_DEVICES``,
...) are listed too, with ``owner`` saying whose they are: attnreg reads them
but does not define what they mean.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from typing import Any

from .errors import AttnregError
from .loading import DEFAULT_SLOW_SECONDS

__all__ = [
    "ENV_VARS",
    "EnvVar",
    "EnvironmentValueError",
    "env_value",
    "environment_report",
    "parse_bool",
    "parse_name_list",
    "parse_seconds",
]


class EnvironmentValueError(AttnregError, ValueError):
    """An environment variable whose value attnreg cannot use.

    ``name`` and ``value`` say which; the message says what is allowed and how
    to fix it (unset the variable, or set a value of the documented form).
    """

    def __init__(self, name: str, value: str, problem: str) -> None:
        self.name = name
        self.value = value
        self.problem = problem
        super().__init__(f"environment variable {name}={_short(value)}: {problem}; set a "
                         f"valid value or unset it (`unset {name}`)")


def _short(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "...'"


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def parse_bool(text: str) -> bool:
    """``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``/empty (any case)."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE[:-1])} "
                     "or empty (off)")


def parse_name_list(text: str) -> list[str]:
    """Comma-separated names (``a,b``); blanks are dropped; empty = none."""
    return [p.strip() for p in text.split(",") if p.strip()]


def parse_seconds(text: str) -> float:
    """A number of seconds >= 0 (``0.5``, ``2``)."""
    try:
        value = float(text.strip())
    except ValueError:
        raise ValueError("expected a number of seconds >= 0, e.g. 0.5") from None
    if not math.isfinite(value) or value < 0:
        raise ValueError("expected a finite number of seconds >= 0, e.g. 0.5")
    return value


def _parse_platform(text: str) -> Any:
    from .platform import Platform

    return Platform.parse(text)


def _parse_text(text: str) -> str:
    return text


class EnvVar:
    """One environment variable: what it does, the flag it mirrors, how it is parsed.

    ``parse`` turns the raw value into what code uses, raising ``ValueError``
    with what is allowed; ``owner`` is ``attnreg`` or the program that defines
    the variable.  ``default`` is what code uses when it is unset (or, with
    ``empty_is_unset``, set to blanks).  A plain class (not a dataclass): the
    table is built on every start-up (P5).
    """

    __slots__ = ("default", "empty_is_unset", "flag", "help", "name", "owner", "parse")

    def __init__(self, name: str, help: str, parse: Callable[[str], Any] = _parse_text, *,
                 flag: str = "", default: Any = None, owner: str = "attnreg",
                 empty_is_unset: bool = False) -> None:
        self.name = name
        self.help = help
        self.parse = parse
        self.flag = flag
        self.default = default
        self.owner = owner
        self.empty_is_unset = empty_is_unset

    def __repr__(self) -> str:
        return f"EnvVar({self.name!r})"


#: Every variable attnreg reads, in the order ``attnreg doctor`` lists them.
ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("ATTNREG_PLATFORM", "the platform to plan for instead of detecting one "
           "(cuda:sm90, h200, cpu)", _parse_platform, flag="--platform", empty_is_unset=True),
    EnvVar("ATTNREG_PLUGINS", "load only these plugins (comma-separated entry-point names; "
           "empty = none)", parse_name_list),
    EnvVar("ATTNREG_DISABLE", "block these plugins or backends (comma-separated)",
           parse_name_list, flag="--disable", default=[]),
    EnvVar("ATTNREG_DISABLE_PLUGIN_AUTOLOAD", "do not load entry-point plugins (1/0)",
           parse_bool, default=False),
    EnvVar("ATTNREG_SLOW_PLUGIN_SECONDS", "warn about a plugin slower than this to load "
           "(seconds)", parse_seconds, default=DEFAULT_SLOW_SECONDS, empty_is_unset=True),
    EnvVar("ATTNREG_HEAVY_MODULES", "libraries a plugin is warned for importing at startup "
           "(comma-separated; empty = none)", parse_name_list),
    EnvVar("ATTNREG_TRACE_HOOKS", "print pluggy's hook-call trace on stderr (1/0)", parse_bool,
           default=False),
    EnvVar("ATTNREG_TRITON_DIRECT_LAUNCH", "let Triton kernels bypass Triton's JIT launch "
           "path where checked (0 turns it off)", parse_bool, default=True),
    EnvVar("ATTNREG_SGLANG", "switch the sglang bridge on (1/0)", parse_bool, default=False),
    EnvVar("ATTNREG_VLLM", "switch the vLLM bridge on (1/0)", parse_bool, default=False),
    EnvVar("ATTNREG_CLAIM_TIME_LIMIT", "conformance: refute a claim that runs longer (seconds; "
           "0 = no limit; default 600 on cpu, 300 on cuda)", parse_seconds,
           flag="--time-limit", empty_is_unset=True),
    EnvVar("TRITON_INTERPRET", "run Triton kernels in the interpreter (CPU)", owner="triton"),
    EnvVar("CUDA_VISIBLE_DEVICES", "which GPUs torch sees", owner="CUDA"),
    EnvVar("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "pytest loads no plugin by itself; `attnreg "
           "conformance` then passes its own", owner="pytest"),
    EnvVar("XDG_CACHE_HOME", "where `attnreg calibrate` writes profiles by default "
           "(attnreg/profiles under it; default ~/.cache)", owner="XDG"),
)

_BY_NAME: Mapping[str, EnvVar] = {v.name: v for v in ENV_VARS}


def env_value(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of ``name`` (its default when unset).

    Raises
    ------
    EnvironmentValueError
        The value does not parse; the message names the variable and what is allowed.
    KeyError
        ``name`` is not in :data:`ENV_VARS` (add it there first: doctor lists that table).
    """
    var = _BY_NAME[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or (var.empty_is_unset and not raw.strip()):
        return var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        what = f" (as {var.flag} takes it)" if var.flag else ""
        raise EnvironmentValueError(name, raw, f"{exc}{what}") from None


def environment_report(environ: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Per variable: name, owner, raw value (None when unset), whether it parses, and why not."""
    env = os.environ if environ is None else environ
    rows = []
    for var in ENV_VARS:
        raw = env.get(var.name)
        problem = ""
        if raw is not None and var.owner == "attnreg":  # others' values are theirs to judge
            try:
                env_value(var.name, env)
            except EnvironmentValueError as exc:
                problem = exc.problem
        rows.append({"name": var.name, "owner": var.owner, "value": raw, "help": var.help,
                     "flag": var.flag or None, "valid": not problem, "problem": problem or None})
    return rows
