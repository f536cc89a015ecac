"""The ``attnreg`` command.

Each subcommand lives in ``attnreg.commands.<name>`` with ``add_arguments``
and ``run``; this module only dispatches.  argparse picks the subcommand in
two passes: the first parser knows every command's name but none of their
options (so it imports no command module), the second is built with the
chosen command's options only, so ``attnreg compat`` never pays for
``attnreg conformance``'s imports (start-up time is a measured figure, P5).

Conventions every command follows: ``--json`` prints JSON on stdout (and
nothing else there), ``-o/--output FILE`` writes it to a file, tables fit
100 columns (``--wide`` shows long cells whole).  Exit codes: 0 success,
1 a check failed, 2 bad input or a policy error.  A closed pipe
(``attnreg doctor --json | head``) ends quietly with exit 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
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
    """The ``attnreg`` parser; ``only``: add the options of that command alone.

    ``only=""`` adds no command's options (the first, choosing pass of
    :func:`main`); ``None`` adds every command's (the docs generator).
    """
    parser = argparse.ArgumentParser(
        prog="attnreg",
        description="Pick MLA attention backends and CUDA-graph modes from declared capabilities.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        # The choosing pass must not answer -h itself: the full parser does, with the options.
        p = sub.add_parser(name, help=help_text, description=help_text, add_help=only != "")
        if only is None or only == name:
            importlib.import_module(module).add_arguments(p)
    return parser


def _version() -> str:
    from . import __version__

    return f"attnreg {__version__}"


def _chosen_command(argv: list[str]) -> str | None:
    """The subcommand argparse finds in ``argv`` (None: none given), options left unparsed."""
    args, _ = build_parser(only="").parse_known_args(argv)
    return args.command


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    try:
        chosen = _chosen_command(args_list)
        parser = build_parser(only=chosen or "")
        args = parser.parse_args(args_list)
        if not args.command:
            parser.print_help()
            return 2
        module = importlib.import_module(COMMANDS[args.command][0])
        try:
            status = int(module.run(args) or 0)
        except AttnregError as exc:
            print(f"attnreg {args.command}: error: {exc}", file=sys.stderr)
            status = 2
        sys.stdout.flush()  # a closed pipe shows here, inside the handler below
        return status
    except BrokenPipeError:
        return _closed_pipe()


def _closed_pipe() -> int:
    """The reader went away (``| head``): stop quietly, like a Unix tool.

    stdout is pointed at /dev/null so that the interpreter's final flush of
    what is still buffered does not raise again (Python's documented recipe).
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
