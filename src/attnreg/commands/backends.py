"""``attnreg backends``: every registered backend, available here or why not.

JSON schema (stable; ``schema_version`` 1)::

    {"schema_version": 1, "platform": "cuda:sm90", "simulated": true,
     "backends": [{"name", "plugin", "distribution", "version", "summary",
                   "available", "unavailable_reason", "capabilities"}],
     "errors": [{"plugin", "backend", "kind", "cause"}]}

``capabilities`` is ``Capabilities.to_dict()`` (null when the declaration
itself is broken).
"""

from __future__ import annotations

import argparse
from typing import Any

from attnreg.registry import Capabilities, Phase

from ._common import (
    add_json_argument,
    add_registry_arguments,
    parse_platform,
    print_json,
    registry_from,
    table,
)

SCHEMA_VERSION = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--platform", default=None,
                        help="report for this platform (e.g. cuda:sm90, cuda:sm100, cpu); "
                             "default: detect this machine")
    parser.add_argument("--assume-installed", action="store_true",
                        help="ignore missing optional libraries (what would a machine with "
                             "every extra get?); implied for a simulated --platform")
    add_registry_arguments(parser)
    add_json_argument(parser)


def summarize(caps: Capabilities | None) -> str:
    """One short line: methods per phase and the capture modes."""
    if caps is None:
        return "-"
    parts = []
    for phase in Phase:
        methods = "/".join(m.value for m in caps.methods(phase))
        if methods:
            parts.append(f"{phase.value}:{methods}")
    modes = []
    for g in caps.graph_modes:
        short = g.capture.kind.value
        if g.capture.is_fallback:
            short = f"fallback->{g.capture.fallback_to}"
        pin = f",pin={g.pinned_method.value}" if g.pinned_method else ""
        modes.append(f"{g.phase.value[:3]}.{g.mode.value}={short}{pin}")
    return " ".join(parts) + ("  |  " + " ".join(modes) if modes else "")


def collect(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Capabilities | None]]:
    """The JSON document, and each backend's declaration here (None when it is broken)."""
    reg = registry_from(args)
    platform, simulated = parse_platform(args.platform)
    assume = args.assume_installed or simulated
    rows = []
    caps: dict[str, Capabilities | None] = {}
    for name in reg.names():
        spec = reg.get(name)
        a = reg.availability(name, platform, assume_installed=assume)
        caps[name] = a.capabilities
        rows.append({
            "name": name,
            "plugin": spec.plugin,
            "distribution": spec.distribution,
            "version": spec.distribution_version,
            "summary": spec.summary,
            "available": a.available,
            "unavailable_reason": a.reason or None,
            "capabilities": a.capabilities.to_dict() if a.capabilities else None,
        })
    data = {
        "schema_version": SCHEMA_VERSION,
        "platform": str(platform),
        "simulated": simulated,
        "assume_installed": assume,
        "backends": rows,
        "errors": [e.to_dict() for e in reg.errors],
    }
    return data, caps


def run(args: argparse.Namespace) -> int:
    data, caps = collect(args)
    if args.json:
        print_json(data)
        return 0
    how = "simulated" if data["simulated"] else "detected"
    note = ", optional libraries assumed installed" if data["assume_installed"] else ""
    print(f"attention backends on {data['platform']} ({how}{note})")
    rows = []
    for b in data["backends"]:
        status = "yes" if b["available"] else f"no: {b['unavailable_reason']}"
        rows.append((b["name"], f"{b['plugin']} {b['version']}".strip(), status,
                     summarize(caps[b["name"]]) if b["available"] else ""))
    print(table(("backend", "plugin", "available", "declares"), rows))
    for err in data["errors"]:
        print(f"plugin error: {err['plugin']}"
              f"{' (' + err['backend'] + ')' if err['backend'] else ''}: "
              f"{err['kind']}: {err['cause']}")
    return 0
