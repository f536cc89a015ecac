"""The ``attnreg`` command.

Each subcommand lives in ``attnreg.commands.<name>`` with ``add_arguments``
and ``run``; this module only dispatches.  argparse picks the subcommand in
two passes: the first parser knows every command's name but none of their
options (so it imports no command module), the second is built with the
chosen command's options only, so ``attnreg compat`` never pays for
``attnreg conformance``'s imports (start-up time is a measured figure, P5).

Conventions every command follows: ``--json`` prints JSON on stdout (and
nothing else there), ``-o/--output FILE`` writes it to a file, tables fit
100 columns (``--wide`` shows long cells whole).

Exit codes (:data:`EXIT_CODES`): 0 success, 1 a check failed, 2 bad input
(an option, a file, an environment variable) or a policy error, 3 an
internal error (a bug: please report it), 130 interrupted.  :func:`main`
is the one error boundary: an ``AttnregError``, an ``OSError`` on a file
the user named, or a failed write to stdout ends in exit 2 and one line on
stderr (``attnreg COMMAND: error: ...``); anything else in
``attnreg COMMAND: internal error: ... (run with --traceback and report
it)`` and exit 3.  ``--traceback`` (every command takes it) also prints
the Python traceback.  A closed pipe (``attnreg doctor --json | head``)
ends quietly with exit 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any, TextIO

from .registry.errors import AttnregError, GraphPolicyError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

#: Every exit status of ``attnreg``, with its meaning (docs/cli.md lists them).
EXIT_CODES: dict[int, str] = {
    EXIT_OK: "success",
    EXIT_FAILED: "a check failed (a refuted claim, `backends --check`, a disagreeing "
                 "calibration)",
    EXIT_BAD_INPUT: "bad input (an option, a file, an environment variable), a failed write, "
                    "or a graph policy error",
    EXIT_INTERNAL: "internal error: a bug in attnreg or a plugin (run with --traceback and "
                   "report it)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}

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


class _Parser(argparse.ArgumentParser):
    """argparse, with bad input said in one line (no usage block): ``PROG: error: ...``.

    Subcommand parsers are of this class too (argparse makes them of the
    parent's class); ``PROG -h`` still shows the usage.
    """

    def error(self, message: str) -> Any:  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``attnreg`` parser; ``only``: add the options of that command alone.

    ``only=""`` adds no command's options (the first, choosing pass of
    :func:`main`); ``None`` adds every command's (the docs generator).
    """
    parser = _Parser(
        prog="attnreg",
        description="Pick MLA attention backends and CUDA-graph modes from declared capabilities.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        # The choosing pass must not answer -h itself: the full parser does, with the options.
        p = sub.add_parser(name, help=help_text, description=help_text, add_help=only != "")
        if only is None or only == name:
            importlib.import_module(module).add_arguments(p)
            if "--traceback" not in p._option_string_actions:
                p.add_argument("--traceback", action="store_true",
                               help="on an error, also print the Python traceback")
    return parser


def _version() -> str:
    from . import __version__

    return f"attnreg {__version__}"


def _chosen_command(argv: list[str]) -> str | None:
    """The subcommand argparse finds in ``argv`` (None: none given), options left unparsed."""
    args, _ = build_parser(only="").parse_known_args(argv)
    return args.command


class OutputError(AttnregError):
    """Writing to stdout failed (disk full, a closed terminal): a clean exit 2."""


class _GuardedStdout:
    """``sys.stdout`` while a command runs: a failed write is an :class:`OutputError`.

    A closed pipe stays a ``BrokenPipeError`` (quiet, exit 0); every other
    attribute is the real stream's.
    """

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def _guard(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as exc:
            _silence(self._stream)  # what is still buffered must not fail again at exit
            raise OutputError(f"cannot write to stdout: {exc.strerror or exc}; redirect the "
                              "output somewhere with room, or write it with -o FILE") from None

    def write(self, text: str) -> int:
        return int(self._guard(self._stream.write, text))

    def writelines(self, lines: Any) -> None:
        self._guard(self._stream.writelines, lines)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _user_named(filename: object, argv: Sequence[str]) -> bool:
    """Whether ``filename`` (of an ``OSError``) is a path the user gave, or a directory
    above one (``-o /proc/x/out.json`` fails creating ``/proc/x``)."""
    if not isinstance(filename, (str, os.PathLike)):
        return False
    path = os.path.abspath(os.fspath(filename))
    given = [a.partition("=")[2] if a.startswith("--") else a for a in argv]
    for arg in given:
        if not arg or arg.startswith("-"):
            continue
        named = os.path.abspath(arg)
        if named == path or named.startswith(path.rstrip(os.sep) + os.sep):
            return True
    return False


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``attnreg`` with ``argv`` (default: ``sys.argv[1:]``); the exit status.

    The one error boundary (see the module docstring for the exit codes).
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    show_traceback = "--traceback" in args_list
    command = "attnreg"
    real_stdout = sys.stdout
    sys.stdout = _GuardedStdout(real_stdout)  # type: ignore[assignment]
    try:
        chosen = _chosen_command(args_list)
        command = f"attnreg {chosen}" if chosen in COMMANDS else command
        parser = build_parser(only=chosen or "")
        args = parser.parse_args(args_list)
        if not args.command:
            parser.print_help()
            return EXIT_BAD_INPUT
        module = importlib.import_module(COMMANDS[args.command][0])
        status = int(module.run(args) or 0)
        sys.stdout.flush()  # a closed pipe or a full disk shows here, inside the handlers
        return status
    except BrokenPipeError:
        return _closed_pipe()
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except AttnregError as exc:
        return _report(command, exc, show_traceback)
    except OSError as exc:
        if _user_named(exc.filename, args_list):
            return _report(command, exc, show_traceback, text=(
                f"{exc.filename}: {exc.strerror or exc}; check the path (and that it is a "
                "file you may read or write)"))
        return _internal(command, exc, show_traceback)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - the boundary: a bug, said as one
        return _internal(command, exc, show_traceback)
    finally:
        if isinstance(sys.stdout, _GuardedStdout):
            sys.stdout = real_stdout


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _report(command: str, exc: BaseException, show_traceback: bool, *,
            text: str | None = None) -> int:
    """Bad input: ``COMMAND: error: ...`` on one line (a policy error: its reasons listed)."""
    if show_traceback:
        traceback.print_exception(exc)
    if isinstance(exc, GraphPolicyError):
        print(f"{command}: error: {exc}", file=sys.stderr)  # a line per reason, as documented
    else:
        print(f"{command}: error: {_one_line(text or str(exc))}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _internal(command: str, exc: BaseException, show_traceback: bool) -> int:
    """Anything attnreg did not raise on purpose: say so, and how to report it."""
    if show_traceback:
        traceback.print_exception(exc)
    what = _one_line(f"{type(exc).__name__}: {exc}")
    if len(what) > 300:
        what = what[:297] + "..."
    hint = "report it" if show_traceback else "run with --traceback and report it"
    print(f"{command}: internal error: {what} ({hint})", file=sys.stderr)
    return EXIT_INTERNAL


def _silence(stream: Any) -> None:
    """Point ``stream``'s file descriptor at /dev/null (nothing more can be written there)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())
    except (OSError, ValueError, AttributeError):  # no descriptor (captured in tests)
        pass


def _closed_pipe() -> int:
    """The reader went away (``| head``): stop quietly, like a Unix tool.

    stdout is pointed at /dev/null so that the interpreter's final flush of
    what is still buffered does not raise again (Python's documented recipe).
    """
    _silence(sys.stdout)
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
