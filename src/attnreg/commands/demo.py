"""``attnreg demo``: the compatibility report `make demo` prints.

For this machine (detected) and the simulated H200 (``cuda:sm90``) and B200
(``cuda:sm100``), named as GPUs so that the plan's default capture budget
uses their memory: the backends table, then the graph plan for a
DeepSeek-V3 preset with its decision trace.

It runs ``attnreg backends`` and ``attnreg compat`` through their own
modules (their parsers and functions), never through the CLI root.

JSON (``--json`` / ``-o FILE``, ``schema_version`` 1)::

    {"schema_version": 1, "model": "deepseek-v3",
     "reports": [{"platform": "detect" | "h200" | ..., "title",
                  "backends": <attnreg backends --json>,
                  "plan": <attnreg compat --json>, or its policy error, or null}]}
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import backends, compat
from ._common import add_output_arguments, emit_json, width_of

SCHEMA_VERSION = 1
DEFAULT_PLATFORMS = ("detect", "h200", "b200")
RULE = "=" * 78


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="deepseek-v3", help="model preset for the plan")
    parser.add_argument("--platform", action="append", default=None,
                        help="platforms to report (repeatable; default: this machine, "
                             "h200 (cuda:sm90), b200 (cuda:sm100))")
    add_output_arguments(parser)


def _args_of(module: Any, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by ``module``'s own options, as ``attnreg NAME argv`` would be."""
    parser = argparse.ArgumentParser(prog=f"attnreg {module.__name__.rsplit('.', 1)[-1]}")
    module.add_arguments(parser)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> int:
    status = 0
    reports = []
    wide = ["--wide"] if getattr(args, "wide", False) else []
    for platform in args.platform or DEFAULT_PLATFORMS:
        title = "this machine" if platform == "detect" else f"simulated {platform}"
        plat_args = [] if platform == "detect" else ["--platform", platform]
        backends_args = _args_of(backends, [*plat_args, *wide])
        data, caps = backends.collect(backends_args)
        outcome = compat.plan_outcome(_args_of(compat, ["--model", args.model, *plat_args,
                                                        *wide]))
        status |= outcome.status
        reports.append({"platform": platform, "title": title, "backends": data,
                        "plan": outcome.data})
        if args.json:
            continue
        print("\n".join([RULE, f"== {title}", RULE,
                         backends.render(data, caps, width=width_of(args)), ""]))
        if outcome.text:
            print(outcome.text)
        print()
        sys.stdout.flush()  # each section as soon as it is ready (stderr errors interleave)
    emit_json(args, {"schema_version": SCHEMA_VERSION, "model": args.model, "reports": reports})
    return status
