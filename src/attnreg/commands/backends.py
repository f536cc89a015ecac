"""``attnreg backends``: every registered backend, available here or why not.

JSON schema (stable; ``schema_version`` 1; keys are only ever added)::

    {"schema_version": 1, "platform": "cuda:sm90", "simulated": true,
     "backends": [{"name", "plugin", "distribution", "version", "summary",
                   "available", "unavailable_reason", "runtime",
                   "runtime_check": {"state", "detail"}, "requires": [...],
                   "capabilities"}],
     "errors": [{"plugin", "distribution", "version", "backend", "kind", "cause"}],
     "warnings": [{"plugin", "kind", "message"}]}

``plugin`` is the entry-point name (what ``--disable`` takes), ``distribution``
and ``version`` the installed package it came from.  ``runtime_check.state``
is ``resolves``, ``missing`` (the backend is then unavailable) or
``not_checked``.  ``capabilities`` is ``Capabilities.to_dict()`` (null when
the declaration itself is broken).

``--check`` adds a runtime column to the table and exits 1 when a plugin
failed or a runtime does not resolve: for a plugin's CI.
"""

from __future__ import annotations

import argparse
from typing import Any

from attnreg.registry import Capabilities, Phase

from ._common import (
    add_output_arguments,
    add_plugin_argument,
    add_registry_arguments,
    emit_json,
    parse_platform,
    registry_from,
    table,
    width_of,
)

SCHEMA_VERSION = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--platform", default=None,
                        help="report for this platform (e.g. cuda:sm90, cuda:sm100, cpu); "
                             "default: detect this machine")
    parser.add_argument("--assume-installed", action="store_true",
                        help="ignore missing optional libraries (what would a machine with "
                             "every extra get?); implied for a simulated --platform")
    parser.add_argument("--check", action="store_true",
                        help="also show whether each runtime dotted path resolves (without "
                             "importing it); exit 1 on any plugin error or unresolved runtime")
    add_registry_arguments(parser)
    add_plugin_argument(parser)
    add_output_arguments(parser)


def summarize(caps: Capabilities | None, *, one_line: bool = True) -> str:
    """Methods per phase, then each capture mode: on one line, or one line each."""
    if caps is None:
        return "-"
    parts = []
    for phase in Phase:
        methods = "/".join(m.value for m in caps.methods(phase))
        if caps.serves_sparse(phase):
            methods = "/".join(filter(None, (methods, "sparse_mla")))
        if methods:
            parts.append(f"{phase.value}:{methods}")
    modes = []
    for g in caps.graph_modes:
        short = g.capture.kind.value
        if g.capture.is_fallback:
            short = f"fallback->{g.capture.fallback_to}"
        pin = f",pin={g.pinned_method.value}" if g.pinned_method else ""
        modes.append(f"{g.phase.value[:3]}.{g.mode.value}={short}{pin}")
    for g in caps.sparse_graph_modes:
        modes.append(f"sparse.{g.phase.value[:3]}.{g.mode.value}={g.capture.kind.value}")
    if not one_line:
        return "\n".join([" ".join(parts), *modes])
    return " ".join(parts) + ("  |  " + " ".join(modes) if modes else "")


def collect(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Capabilities | None]]:
    """The JSON document, and each backend's declaration here (None when it is broken)."""
    reg = registry_from(args, report_errors=False)  # the table lists them
    platform, simulated = parse_platform(args.platform)
    assume = args.assume_installed or simulated
    rows = []
    caps: dict[str, Capabilities | None] = {}
    for name in reg.names():
        spec = reg.get(name)
        a = reg.availability(name, platform, assume_installed=assume)
        caps[name] = a.capabilities
        check = a.runtime or reg.runtime_check(name)
        rows.append({
            "name": name,
            "plugin": spec.plugin,
            "distribution": spec.distribution,
            "version": spec.distribution_version,
            "summary": spec.summary,
            "available": a.available,
            "unavailable_reason": a.reason or None,
            "runtime": spec.runtime,
            "runtime_check": check.to_dict(),
            "requires": [r.to_dict() for r in spec.requires],
            "capabilities": a.capabilities.to_dict() if a.capabilities else None,
        })
    data = {
        "schema_version": SCHEMA_VERSION,
        "platform": str(platform),
        "simulated": simulated,
        "assume_installed": assume,
        "backends": rows,
        "errors": [e.to_dict() for e in reg.errors],
        "warnings": [w.to_dict() for w in reg.startup_warnings()],
    }
    return data, caps


def _distribution(row: dict[str, Any], missing: str = "-") -> str:
    return f"{row['distribution']} {row['version']}".strip() or missing


def failed(data: dict[str, Any]) -> bool:
    """Whether ``--check`` fails: a plugin error, or a runtime known not to resolve."""
    return bool(data["errors"]) or any(b["runtime_check"]["state"] == "missing"
                                       for b in data["backends"])


def render(data: dict[str, Any], caps: dict[str, Capabilities | None], *, check: bool = False,
           width: int | None = None) -> str:
    """The human form: a title line, the table, then one line per plugin error.

    The last column holds what an available backend declares, or why one is
    not available; it wraps to ``width``.
    """
    how = "simulated" if data["simulated"] else "detected"
    note = ", optional libraries assumed installed" if data["assume_installed"] else ""
    headers = ["backend", "plugin", "distribution", "available", "declares (or why not)"]
    if check:
        headers.insert(3, "runtime")
    rows = []
    for b in data["backends"]:
        detail = (summarize(caps[b["name"]], one_line=width is None) if b["available"]
                  else b["unavailable_reason"] or "-")
        row = [b["name"], b["plugin"], _distribution(b), "yes" if b["available"] else "no",
               detail]
        if check:
            state = b["runtime_check"]
            row.insert(3, state["state"].replace("_", " ")
                       + (f": {state['detail']}" if state["state"] == "not_checked" else ""))
        rows.append(row)
    lines = [f"attention backends on {data['platform']} ({how}{note})",
             table(headers, rows, wrap_columns=("plugin", "distribution", "runtime",
                                                "declares (or why not)"),
                   width=width)]
    for err in data["errors"]:
        lines.append(f"plugin error: {err['plugin']} "
                     f"({_distribution(err, 'no distribution found')})"
                     f"{' backend ' + repr(err['backend']) if err['backend'] else ''}: "
                     f"{err['kind']}: {err['cause']}")
    if data["errors"]:
        lines.append("(`attnreg doctor` for details and how to silence a plugin)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    data, caps = collect(args)
    status = 1 if args.check and failed(data) else 0
    emit_json(args, data)
    if not args.json:
        print(render(data, caps, check=args.check, width=width_of(args)))
    return status
