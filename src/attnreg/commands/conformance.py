"""``attnreg conformance``: prove each declared capability of a backend on this device.

Runs the conformance suite (``attnreg.testing``) through ``pytest.main`` and
prints the claims table; ``-o/--output PATH`` also writes the report (schema
in ``attnreg.testing.report``), ``--json`` prints it on stdout instead of the
table (pytest's own lines then go to stderr).  ``--json PATH``, the form
before the CLI conventions were unified, still writes PATH with a
deprecation warning.  While claims run, stderr shows ``i of N: claim <id>`` with
the elapsed time and an estimate of the time left, and a notice before a
flashinfer kernel variant may JIT-compile (when stderr is a terminal, or with
``--progress``; never with ``-q/--quiet``).  Exit status: 0 when no claim is refuted, 1 when
one is (or no claim could be collected, or a backend asked for by name cannot
run here), 2 on bad input (``-k`` selecting nothing included) or when pytest
itself could not run.

Examples::

    attnreg conformance --backend triton --device cpu        # Triton interpreter
    attnreg conformance --backend flashinfer_mla -o conf.json
    attnreg conformance --device cuda                        # every available backend
    attnreg conformance --plugin my_pkg.attnreg_plugin --backend mine   # not installed yet
    attnreg conformance --merge a.json --merge b.json -o all.json  # join earlier runs
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import sys
import tempfile
from pathlib import Path

from ._common import (
    UsageError,
    add_registry_arguments,
    check_output_path,
    check_plugin_modules,
    print_json,
)

PLUGIN_MODULE = "attnreg.testing.plugin"
SUITE_MODULE = "attnreg.testing.suite"

#: pytest exit codes (pytest.ExitCode) this command maps to its own.
_PYTEST_OK, _PYTEST_TESTS_FAILED, _PYTEST_NO_TESTS = 0, 1, 5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", action="append", default=[], metavar="NAME",
                        help="backend to check (repeatable); default: every backend available "
                             "on the device")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where claims run; default: cuda when torch sees a GPU, else cpu "
                             "(cpu sets TRITON_INTERPRET=1 and skips claims that need real "
                             "CUDA graphs, saying so)")
    parser.add_argument("--json", action="store_true",
                        help="print the claims report as JSON on stdout instead of the table")
    # `--json PATH` of earlier versions: PATH lands here (hidden) and is read as --output
    parser.add_argument("legacy_json_path", nargs="?", default=None, metavar="PATH",
                        help=argparse.SUPPRESS)
    parser.add_argument("-o", "--output", default=None, metavar="FILE",
                        help="also write the claims report as JSON to FILE")
    parser.add_argument("--exhaustive", action="store_true",
                        help="expand the full product of declared values (default: cover each "
                             "declared dtype, page size, head count and head dims once)")
    parser.add_argument("--heads", action="append", default=[], type=_positive_int,
                        metavar="N",
                        help="run every configuration with N query heads (repeatable) instead "
                             "of the device's defaults, e.g. 32 for 128 heads over "
                             "tensor-parallel 4")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE and register it as an attnreg plugin for this run "
                             "(a backend package that is not installed as an entry point)")
    parser.add_argument("--other-platforms", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="also list, skipped with the reason, the claims each backend "
                             "declares only for other CUDA platforms (cuda:sm90, cuda:sm100, "
                             "cuda:sm103), e.g. Blackwell-only claims on an H200; default: on "
                             "with --device cuda, off with --device cpu")
    parser.add_argument("-k", dest="keyword", default=None, metavar="EXPR",
                        help="only claims whose id matches EXPR (pytest -k), e.g. 'capture'")
    parser.add_argument("-x", "--exitfirst", action="store_true",
                        help="stop at the first refuted claim")
    parser.add_argument("--list", action="store_true",
                        help="list the claims the declaration expands to, run nothing")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list verified claims too, and show pytest's tracebacks")
    parser.add_argument("-q", "--quiet", action="store_true",
                        help="no progress lines (shown on stderr when it is a terminal: claim "
                             "i of N, elapsed, time left, a notice before a JIT compile)")
    parser.add_argument("--progress", action="store_true",
                        help="progress lines on stderr even when it is not a terminal (a log "
                             "file)")
    parser.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                        help="refute a claim that runs longer than SECONDS as timed out and go "
                             "on with the next (default: $ATTNREG_CLAIM_TIME_LIMIT, else 600 "
                             "on cpu, 300 on cuda; 0: no limit, claims run in this process)")
    parser.add_argument("--pytest-arg", action="append", default=[], metavar="ARG",
                        help="extra argument passed to pytest as is (repeatable)")
    parser.add_argument("--merge", action="append", default=[], metavar="REPORT",
                        help="run nothing: join the JSON reports of earlier runs on one machine "
                             "(repeatable, e.g. one per backend run in parallel), print the "
                             "table (or --json) and write it with --output")
    add_registry_arguments(parser)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a head count must be >= 1, got {value}")
    return value


def _plugin_autoloads() -> bool:
    """Whether pytest will load the attnreg plugin itself (through its pytest11 entry point)."""
    if os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    for ep in importlib.metadata.entry_points(group="pytest11"):
        if ep.value == PLUGIN_MODULE:
            return True
    return False


def pytest_args(args: argparse.Namespace, ini_path: Path,
                report_path: Path | None = None, *, progress: bool = False) -> list[str]:
    """The pytest command line that runs the suite for ``args`` (``progress``: the
    command prints a line per claim, so pytest's own per-test marks are left out)."""
    import attnreg

    package_root = Path(attnreg.__file__).resolve().parent.parent
    argv = [
        # an empty ini: the suite must not pick up the options of whatever project
        # the command is run from (addopts, testpaths, plugins of its conftest)
        "-c", str(ini_path), "--rootdir", str(package_root),
        "--confcutdir", str(package_root / "attnreg" / "testing"),
        # --confcutdir does not stop pytest importing ./test*/conftest.py of the
        # invocation directory (a project's tests/conftest.py, which may e.g. set
        # ATTNREG_DISABLE_PLUGIN_AUTOLOAD=1 and hide the plugin under test)
        "--noconftest",
        "-p", "no:cacheprovider",
        # this process imported attnreg before pytest started: nothing to rewrite
        "-W", "ignore::pytest.PytestAssertRewriteWarning",
    ]
    if not _plugin_autoloads():
        argv += ["-p", PLUGIN_MODULE]
    argv += ["--pyargs", SUITE_MODULE]
    for name in args.backend:
        argv += ["--attnreg-backend", name]
    if args.device:
        argv += ["--attnreg-device", args.device]
    report = Path(args.output).resolve() if args.output else report_path
    if report is not None:
        argv += ["--attnreg-report", str(report)]
        if not args.output or args.json:
            # the report lives in a temporary directory deleted after the run (do not
            # tell the user a path that will not exist), or stdout is for the JSON
            argv.append("--attnreg-report-quiet")
    if args.exhaustive:
        argv.append("--attnreg-exhaustive")
    for heads in args.heads:
        argv += ["--attnreg-heads", str(heads)]
    for module in args.plugin:
        argv += ["--attnreg-plugin", module]
    for name in args.disable:
        argv += ["--attnreg-disable", name]
    if args.time_limit is not None:
        argv += ["--attnreg-time-limit", str(args.time_limit)]
    if args.other_platforms is not None:
        argv.append("--attnreg-other-platforms" if args.other_platforms
                    else "--attnreg-no-other-platforms")
    if args.keyword:
        argv += ["-k", args.keyword]
    if args.exitfirst:
        argv.append("-x")
    if args.list:
        argv += ["--collect-only", "-q"]
    elif args.verbose:
        argv += ["-v", "--tb=short"]
    else:
        # the claims table says what failed and why; pytest's own summary would repeat it
        argv += ["-q", "--tb=no", "--no-header", "-rN"]
    if progress and not args.list:
        argv += ["-o", "console_output_style=classic"]  # no [ 42%]: the lines say i of N
    argv += list(args.pytest_arg)
    return argv


def _deprecated_json_path(args: argparse.Namespace) -> str | None:
    """``--json PATH`` (before the CLI conventions): PATH becomes ``--output``, with a warning.

    The problem to report instead when PATH came without ``--json``, else None.
    """
    path = getattr(args, "legacy_json_path", None)
    if path is None:
        return None
    if not args.json:
        return f"unrecognized argument: {path}"
    print(f"attnreg conformance: warning: `--json {path}` is deprecated: write the report "
          f"with `--output {path}` (`--json` alone prints it on stdout)", file=sys.stderr)
    if args.output is None:
        args.output = path
    args.json = False
    args.legacy_json_path = None
    return None


def _check_inputs(args: argparse.Namespace) -> str | None:
    """A usage problem to report before starting pytest, or None."""
    from attnreg.registry import load_registry

    check_plugin_modules(args.plugin)
    if args.output:
        check_output_path(args.output, "the report")
    reg = load_registry(args.disable)
    for name in args.backend:
        if name not in reg.names() and not args.plugin:
            reg.get(name)  # raises UnknownBackendError / the plugin's error, with hints
    if args.device == "cuda":
        try:
            import torch
        except ImportError:
            return "--device cuda needs torch (install attnreg[torch])"
        if not torch.cuda.is_available():
            return "--device cuda: torch sees no CUDA device here; use --device cpu"
    return None


def _unavailable_requested(args: argparse.Namespace, report_path: Path) -> list[str]:
    """Backends asked for by name that the report lists as unavailable here."""
    if not args.backend or not report_path.exists():
        return []
    from attnreg.testing.report import Report

    try:
        unavailable = Report.read_json(report_path).header.get("unavailable") or {}
    except ValueError:
        return []
    return [name for name in args.backend if name in unavailable]


#: Options that choose what to run: meaningless with --merge, which runs nothing.
_RUN_OPTIONS = ("backend", "device", "exhaustive", "heads", "plugin", "keyword", "exitfirst",
                "list", "pytest_arg", "other_platforms")


def merge_reports(args: argparse.Namespace) -> int:
    """``--merge``: join earlier reports, print the table, write ``--json``; 1 if refuted."""
    given = [f"--{name.replace('_', '-')}" for name in _RUN_OPTIONS if getattr(args, name)]
    if given:
        print(f"attnreg conformance: error: --merge runs no claims; drop {', '.join(given)}",
              file=sys.stderr)
        return 2
    from attnreg.testing.report import Report

    # a file that is missing, not JSON or not a report, or reports of different machines:
    # ReportError, one line and exit 2 at the CLI's error boundary
    merged = Report.merge(Report.read_json(path) for path in args.merge)
    if args.json:
        print_json(merged.to_dict())
    else:
        print(merged.to_text(verbose=args.verbose))
    if args.output:
        print(f"report written to {merged.write_json(args.output)}", file=sys.stderr)
    return 0 if merged.ok else 1


def _progress_plugins(args: argparse.Namespace) -> list[object]:
    """The pytest plugin printing progress lines, when they are on (else nothing).

    On when stderr is a terminal or with ``--progress``, off with ``--quiet`` and
    ``--list`` (nothing runs).  The lines go to stderr, so ``--json`` stdout stays
    one document.
    """
    from attnreg.profiling.progress import Progress

    lines = Progress.for_terminal(0, quiet=args.quiet or args.list, force=args.progress)
    if not lines.enabled:
        return []
    from attnreg.testing.progress import ClaimProgress

    return [ClaimProgress(lines)]


def run(args: argparse.Namespace) -> int:
    problem = _deprecated_json_path(args)
    if problem:
        print(f"attnreg conformance: error: {problem}", file=sys.stderr)
        return 2
    if args.merge:
        return merge_reports(args)
    if args.device == "cpu":
        # before anything imports triton or evaluates a declaration (declarations are
        # cached per process, and triton's reads TRITON_INTERPRET): kernels then run
        # in the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    problem = _check_inputs(args)
    if problem:
        print(f"attnreg conformance: error: {problem}", file=sys.stderr)
        return 2
    import pytest

    from attnreg.registry.jsonfile import read_json
    from attnreg.testing.report import ReportError

    plugins = _progress_plugins(args)
    with tempfile.TemporaryDirectory(prefix="attnreg-conformance-") as tmp:
        ini = Path(tmp) / "pytest.ini"
        ini.write_text("[pytest]\n")
        report_path = Path(args.output).resolve() if args.output else Path(tmp) / "report.json"
        # with --json, stdout carries the report alone: pytest's lines and the table go
        # to stderr (the terminal reporter writes to the sys.stdout it finds at start)
        to_stderr = contextlib.redirect_stdout(sys.stderr) if args.json \
            else contextlib.nullcontext()
        with to_stderr:
            code = int(pytest.main(pytest_args(args, ini, report_path,
                                               progress=bool(plugins)), plugins=plugins))
        unavailable = _unavailable_requested(args, report_path)
        if args.json and not args.list and report_path.exists():
            print_json(read_json(report_path, ReportError))
    if code == _PYTEST_NO_TESTS and args.keyword:
        raise UsageError(f"-k {args.keyword!r}: nothing selected, no claim id matches it; "
                         "`attnreg conformance --list` shows the claim ids")
    if args.list:
        return 0 if code == _PYTEST_OK else 2
    if code == _PYTEST_OK and unavailable:
        # nothing refuted, but nothing of these was checked either: a CI job that
        # asked for them must not pass silently
        print("attnreg conformance: requested backend(s) not available here, nothing of "
              f"them was checked: {', '.join(unavailable)}", file=sys.stderr)
        return 1
    if code == _PYTEST_OK:
        return 0
    if code == _PYTEST_TESTS_FAILED:
        return 1
    if code == _PYTEST_NO_TESTS:
        print("attnreg conformance: no claims were collected (no backend available on this "
              "device)", file=sys.stderr)
        return 1
    print(f"attnreg conformance: pytest could not run the suite (exit code {code})",
          file=sys.stderr)
    return 2
