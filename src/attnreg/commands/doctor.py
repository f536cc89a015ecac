"""``attnreg doctor``: what is installed, the detected platform, plugins and their errors.

Every plugin attnreg tried to load is listed, also one that failed to
import, with its distribution and version, what its import and hook call
cost, and the heavy libraries it pulled in; a plugin that used a deprecated
attnreg form is listed with the form and its replacement.  Every backend is listed with
its plugin, distribution and whether its runtime dotted path resolves
(checked without importing it).  Each plugin error comes with the line that
silences the plugin.

The environment table lists every variable attnreg reads
(:data:`attnreg.registry.environment.ENV_VARS`), set or not, and says which
value does not parse.

JSON keys: ``platform``, ``platform_source`` (``detected`` or
``ATTNREG_PLATFORM``), ``libraries``, ``environment`` (name -> raw value or
null), ``environment_problems`` (name -> what is wrong), ``limits
{slow_seconds, heavy_modules}``, ``plugins[PluginInfo.to_dict()]``,
``disabled``, ``backends{name: {plugin, distribution, version, runtime,
runtime_check{state, detail}}}``, ``errors[{plugin, distribution, version,
backend, kind, cause, silence, traceback}]``, ``warnings[{plugin, kind,
message}]``.
"""

from __future__ import annotations

import argparse
from typing import Any

from attnreg.registry.environment import environment_report
from attnreg.registry.spec import installed_version

from ._common import (
    add_output_arguments,
    add_plugin_argument,
    add_registry_arguments,
    emit_json,
    parse_platform,
    registry_from,
    table,
    width_of,
    wrap,
)

LIBRARIES = ("attnreg", "pluggy", "torch", "triton", "numpy", "flashinfer-python",
             "flash-attn-4", "nvidia-cutlass-dsl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_registry_arguments(parser)
    add_plugin_argument(parser)
    add_output_arguments(parser)
    parser.add_argument("--traceback", action="store_true",
                        help="show the full traceback of each plugin error")


def collect(args: argparse.Namespace) -> dict[str, Any]:
    # A variable the registry or the platform needs that does not parse stops here, as
    # in every command (one line, exit 2); the others are marked INVALID in the table.
    environment = environment_report()
    # The warnings are part of the report here, not extra lines on stderr.
    reg = registry_from(args, warn=False, report_errors=False)
    platform, from_env = parse_platform(None)
    backends = {}
    for name in reg.names():
        spec = reg.get(name)
        check = reg.runtime_check(name)
        backends[name] = {"plugin": spec.plugin, "distribution": spec.distribution,
                          "version": spec.distribution_version, "runtime": spec.runtime,
                          "runtime_check": check.to_dict()}
    return {
        "platform": str(platform),
        "platform_source": "ATTNREG_PLATFORM" if from_env else "detected",
        "libraries": {name: installed_version(name) for name in LIBRARIES},
        "environment": {row["name"]: row["value"] for row in environment},
        "environment_problems": {row["name"]: row["problem"] for row in environment
                                 if row["problem"]},
        "environment_help": {row["name"]: (row["help"] if row["owner"] == "attnreg"
                                           else f"({row['owner']}) {row['help']}")
                             for row in environment},
        "limits": {"slow_seconds": reg.limits.slow_seconds,
                   "heavy_modules": list(reg.limits.heavy_modules)},
        "plugins": [p.to_dict() for p in reg.plugins],
        "disabled": reg.disabled,
        "backends": backends,
        "errors": [dict(e.to_dict(), silence=e.silence_hint, traceback=e.traceback_text)
                   for e in reg.errors],
        "warnings": [w.to_dict() for w in reg.startup_warnings()],
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _dist(row: dict[str, Any]) -> str:
    return f"{row['distribution']} {row['version']}".strip() or "-"


def _status(plugin: dict[str, Any], errors: list[dict[str, Any]]) -> str:
    if not plugin["loaded"]:
        return "failed"
    return "error" if any(e["plugin"] == plugin["name"] for e in errors) else "ok"


def render(data: dict[str, Any], *, traceback: bool = False, width: int | None = None) -> str:
    """The human form: one table per part, then warnings and plugin errors."""
    source = "detected" if data["platform_source"] == "detected" else "from ATTNREG_PLATFORM"
    problems = data["environment_problems"]
    lines = [f"platform ({source}): {data['platform']}", "", "libraries",
             table(("distribution", "version"),
                   [(k, v or "not installed") for k, v in data["libraries"].items()]),
             "", "environment (every variable attnreg reads)",
             table(("variable", "value", "meaning"),
                   [(k, ("(unset)" if v is None else repr(v))
                     + (f"  INVALID: {problems[k]}" if k in problems else ""),
                     data["environment_help"][k])
                    for k, v in data["environment"].items()],
                   wrap_columns=("value", "meaning"), width=width)]
    limits = data["limits"]
    lines += ["", *wrap(f"plugins (startup limits: {limits['slow_seconds']:g} s per plugin; "
                        f"heavy libraries: {', '.join(limits['heavy_modules']) or 'none'})",
                        width, "  ")]
    lines.append(table(
        ("plugin", "distribution", "status", "import", "hook", "heavy imports",
         "module, hooks"),
        [(p["name"], _dist(p), _status(p, data["errors"]), _ms(p["import_seconds"]),
          _ms(p["hook_seconds"]) if p["call_order"] is not None else "-",
          ", ".join(p["heavy_imports"]) or "-",
          # one line each when wrapping (they are long), one line together with --wide
          ("\n" if width else ", ").join([p["module"], *p["hooks"]]))
         for p in data["plugins"]],
        wrap_columns=("distribution", "heavy imports", "module, hooks"), width=width))
    lines += ["", "backends", table(
        ("backend", "plugin", "distribution", "runtime", "resolves"),
        [(name, b["plugin"], _dist(b), b["runtime"],
          b["runtime_check"]["state"].replace("_", " ")
          + (f": {b['runtime_check']['detail']}" if b["runtime_check"]["detail"] else ""))
         for name, b in data["backends"].items()],
        wrap_columns=("runtime", "resolves"), width=width)]
    if data["disabled"]:
        lines += ["", *wrap(f"disabled: {', '.join(data['disabled'])}", width, "  ")]
    if data["warnings"]:
        lines += ["", f"warnings and notes: {len(data['warnings'])}"]
        for w in data["warnings"]:
            lines += wrap(f"  - {w['message']}", width, "    ")
    lines += _deprecations(data["plugins"], width)
    lines += ["", f"plugin errors: {len(data['errors'])}"]
    for err in data["errors"]:
        who = f"{err['plugin']} ({_dist(err) if err['distribution'] else 'no distribution found'})"
        if err["backend"]:
            who += f", backend {err['backend']!r}"
        lines += wrap(f"  - {who}: {err['kind']}: {err['cause']}", width, "    ")
        lines += wrap(f"    silence it: {err['silence']}", width, "      ")
        if traceback and err["traceback"]:
            # as Python wrote it: wrapping a traceback would garble it
            lines.append("    " + err["traceback"].rstrip().replace("\n", "\n    "))
    return "\n".join(lines)


def _deprecations(plugins: list[dict[str, Any]], width: int | None) -> list[str]:
    """Plugins that load only through a deprecated form, with the form's replacement."""
    users = [p for p in plugins if p["deprecations"]]
    if not users:
        return []
    lines = ["", *wrap(f"plugins using deprecated forms: {len(users)} (they load today; "
                       "see docs/api.md#deprecations)", width, "  ")]
    for p in users:
        for message in p["deprecations"]:
            lines += wrap(f"  - {p['name']} ({_dist(p)}): {message}", width, "    ")
    return lines


def run(args: argparse.Namespace) -> int:
    data = collect(args)
    emit_json(args, data)
    if not args.json:
        print(render(data, traceback=args.traceback, width=width_of(args)))
    return 0
