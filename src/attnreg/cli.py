"""The ``attnreg`` command.

Each subcommand lives in ``attnreg.commands.<name>`` with ``add_arguments``
and ``run``; this module only dispatches, importing the chosen command
lazily so that ``attnreg compat`` never pays for ``attnreg conformance``.
Exit codes: 0 success, 1 a check failed, 2 bad input or a policy error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from .registry.errors import AttnregError

#: name -> (module, one-line help).  A new command adds one line here.
COMMANDS: dict[str, tuple[str, str]] = {
    "backends": ("attnreg.commands.backends", "list backends and what each declares"),
    "doctor": ("attnreg.commands.doctor", "installed libraries, platform, plugins, errors"),
    "conformance": ("attnreg.commands.conformance",
                    "prove each declared capability of a backend on this device"),
    "compat": ("attnreg.commands.compat", "graph plan and decision trace for a platform/model"),
    "demo": ("attnreg.commands.demo", "compatibility report: this machine + simulated H200/B200"),
    "calibrate": ("attnreg.commands.calibrate", "measure prefill costs on this GPU: a cost profile"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnreg",
        description="Pick MLA attention backends and CUDA-graph modes from declared capabilities.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def _version() -> str:
    from . import __version__

    return f"attnreg {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in args_list if a in COMMANDS), None)
    parser = build_parser(only=chosen)
    args = parser.parse_args(args_list)
    if not args.command:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except AttnregError as exc:
        print(f"attnreg {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
