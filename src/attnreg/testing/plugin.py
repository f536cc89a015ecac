"""pytest plugin of the conformance suite (registered through the ``pytest11`` entry point).

Importing it stays cheap (no torch): torch, the backends and the harness are
imported only when a test asks for a claim.  The plugin generates items only
for test functions that request the ``attnreg_claim`` fixture, i.e. the
suite's own :class:`attnreg.testing.suite.BackendConformance` subclasses, so
it never slows down or changes unrelated test runs.

Options
-------
``--attnreg-backend NAME``
    Backend to check (repeatable).  Default: every backend available on the
    device (a subclass may fix its own list with ``attnreg_backends``).
``--attnreg-device cpu|cuda``
    Where to run.  Default: ``cuda`` when torch sees a GPU, else ``cpu``.
``--attnreg-report PATH``
    Write the claims report as JSON (see :mod:`attnreg.testing.report`).
``--attnreg-exhaustive``
    Expand the full product of declared values instead of covering each once.
``--attnreg-heads N``
    Run every configuration with N query heads (repeatable) instead of the
    device's defaults, e.g. one tensor-parallel rank's share of a model's heads.
``--attnreg-plugin MODULE``
    Import MODULE and register it as an attnreg plugin for this run (a
    backend package under development, not installed as an entry point).
``--attnreg-disable NAME``
    Block a plugin or backend by name (as ``attnreg --disable``).
``--attnreg-time-limit SECONDS``
    End a claim that runs longer as refuted ("timed out after N s in ...") and go
    on with the next (claims run in a worker process, see
    :mod:`attnreg.testing.timelimit`).  Default: ``ATTNREG_CLAIM_TIME_LIMIT``, else
    600 s on cpu (Triton interpreter) and 300 s on cuda; 0 runs claims in this
    process without a limit.
``--attnreg-other-platforms`` / ``--attnreg-no-other-platforms``
    Also list, skipped, the claims a backend declares only for other CUDA
    platforms (:data:`~attnreg.testing.claims.CUDA_PLATFORMS`), e.g. Blackwell-only
    claims on an H200.  Default: on for ``--attnreg-device cuda``, off on cpu
    (where every CUDA claim would be listed).

Run it with ``attnreg conformance`` or ``pytest --pyargs attnreg.testing.suite``.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import pytest

from .claims import (
    CUDA_PLATFORMS,
    Claim,
    declares_kernels,
    expand_claims,
    other_platform_claims,
    unavailable_claim,
)
from .report import ClaimResult, Report, Status, base_header

if TYPE_CHECKING:
    from attnreg.registry import BackendRegistry

    from .harness import Harness
    from .timelimit import ClaimRunner

__all__ = ["SESSION_KEY", "ConformanceSession"]

CLAIM_FIXTURE = "attnreg_claim"
#: Marker of the claims listed from other platforms' declarations (always skipped).
OTHER_PLATFORM_MARK = "attnreg_other_platform"


class ConformanceSession:
    """Per-pytest-run state: options, the registry, the report being built."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.requested: list[str] = list(config.getoption("attnreg_backends") or [])
        self.device_option: str | None = config.getoption("attnreg_device")
        self.report_path: str | None = config.getoption("attnreg_report")
        self.exhaustive: bool = bool(config.getoption("attnreg_exhaustive"))
        self.heads: list[int] = list(config.getoption("attnreg_heads") or [])
        self.plugin_modules: list[str] = list(config.getoption("attnreg_plugins") or [])
        self.disable: list[str] = list(config.getoption("attnreg_disable") or [])
        self.other_platforms_option: bool | None = config.getoption("attnreg_other_platforms")
        self.time_limit_option: float | None = config.getoption("attnreg_time_limit")
        self._runner: Harness | ClaimRunner | None = None
        self.report = Report()
        self.backends_seen: list[str] = []
        self.unavailable: dict[str, str] = {}
        self.claims_generated = False
        self._registry: BackendRegistry | None = None
        self._device: str | None = None
        self._harness: Harness | None = None
        self._started: dict[str, float] = {}
        #: Other-platform claims that survived collection (-k), for ``--collect-only``.
        self.listed_other: list[Claim] = []

    @property
    def active(self) -> bool:
        """Whether the user asked for the suite explicitly (an attnreg option was given)."""
        return bool(self.requested or self.device_option or self.report_path
                    or self.plugin_modules)

    # -- lazily computed facts ---------------------------------------------------------
    @property
    def device(self) -> str:
        if self._device is None:
            if self.device_option:
                self._device = self.device_option
            else:
                try:
                    import torch
                    self._device = "cuda" if torch.cuda.is_available() else "cpu"
                except ImportError:
                    self._device = "cpu"
            if self._device == "cpu":
                # Triton kernels run on a cpu only in the interpreter; the flag must
                # be set before triton compiles anything (see docs/decisions.md).
                os.environ.setdefault("TRITON_INTERPRET", "1")
        return self._device

    @property
    def platform(self) -> Any:
        from attnreg.registry import Platform

        if self.device == "cpu":
            return Platform.parse("cpu")
        return Platform.detect()

    @property
    def other_platforms(self) -> bool:
        """Whether claims declared only for other CUDA platforms are listed (skipped)."""
        if self.other_platforms_option is not None:
            return self.other_platforms_option
        return self.device == "cuda"

    @property
    def registry(self) -> BackendRegistry:
        if self._registry is None:
            from attnreg.registry import load_registry

            extra = []
            for module in self.plugin_modules:
                try:
                    extra.append((module, importlib.import_module(module)))
                except Exception as exc:  # name the plugin, keep pytest's usage error style
                    raise pytest.UsageError(
                        f"--attnreg-plugin {module}: cannot import it: "
                        f"{type(exc).__name__}: {exc}") from exc
            self._registry = load_registry(self.disable, extra_plugins=extra)
        return self._registry

    def harness(self) -> Harness:
        if self._harness is None:
            from .harness import Harness

            self._harness = Harness(self.registry, self.device, self.platform)
        return self._harness

    def claim_runner(self) -> Harness | ClaimRunner:
        """What runs each claim: a time-limited :class:`~attnreg.testing.timelimit.ClaimRunner`,
        or the harness itself when the limit is 0."""
        from .timelimit import ClaimRunner, HarnessRecipe, resolve_limit

        if self._runner is None:
            try:
                limit = resolve_limit(self.time_limit_option, self.device)
            except ValueError as exc:
                raise pytest.UsageError(str(exc)) from exc
            if limit == 0:
                self._runner = self.harness()
            else:
                recipe = HarnessRecipe(self.device, tuple(self.plugin_modules),
                                       tuple(self.disable))
                self._runner = ClaimRunner(self.harness, recipe, limit)
        return self._runner

    def close(self) -> None:
        """End the claim worker, if one runs."""
        close = getattr(self._runner, "close", None)
        if close is not None:
            close()

    # -- claims ------------------------------------------------------------------------
    def claims_for(self, backends: list[str]) -> list[Claim]:
        from attnreg.registry import AttnregError

        reg = self.registry
        names = backends or self._default_backends()
        platform = self.platform
        claims: list[Claim] = []
        for name in names:
            try:
                reg.get(name)
            except AttnregError as exc:
                raise pytest.UsageError(f"--attnreg-backend {name}: {exc}") from exc
            if name not in self.backends_seen:
                self.backends_seen.append(name)
            avail = reg.availability(name, platform)
            caps = avail.capabilities
            if avail.available and caps is not None:
                here = self._expand(caps)
                claims.extend(here)
            else:
                self.unavailable[name] = avail.reason
                claims.append(unavailable_claim(name, avail.reason))
                # what this platform declares though it cannot run here (a library
                # is missing): the other platforms' claims are those beyond it
                here = (self._expand(caps) if self.other_platforms and caps is not None
                        and declares_kernels(caps) else [])
            claims.extend(self._other_platform_claims(name, here, str(platform)))
        self.claims_generated = True
        return claims

    def _expand(self, caps: Any) -> list[Claim]:
        return expand_claims(caps, self.device, exhaustive=self.exhaustive,
                             heads=self.heads or None)

    def _other_platform_claims(self, name: str, here: list[Claim],
                               platform: str) -> list[Claim]:
        """``name``'s claims declared only for other CUDA platforms, skipped (if enabled)."""
        if not self.other_platforms:
            return []
        return other_platform_claims(here, self._other_declarations(name, platform),
                                     platform, self.device, exhaustive=self.exhaustive,
                                     heads=self.heads or None)

    def _other_declarations(self, name: str, platform: str) -> list[Any]:
        from attnreg.registry import AttnregError

        out = []
        for other in CUDA_PLATFORMS:
            if other == platform:
                continue
            # a declaration that fails on another platform is that platform's
            # problem (`attnreg backends --platform` shows it), not this run's
            with contextlib.suppress(AttnregError):
                out.append(self.registry.declaration(name, other))
        return out

    def _default_backends(self) -> list[str]:
        if self.requested:
            return self.requested
        reg = self.registry
        platform = self.platform
        names = []
        for name in reg.names():
            avail = reg.availability(name, platform)
            if avail.available or self._declared_elsewhere_only(name, avail.capabilities):
                names.append(name)
            else:
                self.unavailable[name] = avail.reason
        return names

    def _declared_elsewhere_only(self, name: str, caps: Any) -> bool:
        """Whether ``name`` runs nothing on this platform but declares claims on another.

        Such a backend (trtllm_mla on an H200) is one a full run must still show
        when other platforms are listed: its claims are what this device cannot
        check.  A backend missing only a library stays out, as before.
        """
        if not self.other_platforms or caps is None or declares_kernels(caps):
            return False
        platform = str(self.platform)
        return any(declares_kernels(c) for c in self._other_declarations(name, platform))

    # -- results -----------------------------------------------------------------------
    def record(self, claim: Claim, status: Status, message: str, duration: float) -> None:
        self.report.add(ClaimResult(claim.to_dict(), status, message, duration))

    def header(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"exhaustive": self.exhaustive,
                                 "unavailable": dict(self.unavailable),
                                 "other_platforms": self.other_platforms}
        if self.heads:
            extra["heads"] = list(self.heads)
        if self.device == "cuda":
            with contextlib.suppress(Exception):  # the header must never fail the run
                import torch
                extra["device_name"] = torch.cuda.get_device_name(0)
                extra["cuda"] = torch.version.cuda
        return base_header(self.backends_seen or self.requested, self.device,
                           str(self.platform), **extra)

    def finish(self) -> Report:
        self.report.header = self.header()
        return self.report


SESSION_KEY = pytest.StashKey[ConformanceSession]()


def _session(config: pytest.Config) -> ConformanceSession:
    return config.stash[SESSION_KEY]


# ---------------------------------------------------------------------------
# hooks
# ---------------------------------------------------------------------------

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("attnreg", "attnreg conformance suite")
    group.addoption("--attnreg-backend", action="append", default=[], dest="attnreg_backends",
                    metavar="NAME",
                    help="backend to check (repeatable); default: all available on the device")
    group.addoption("--attnreg-device", choices=("cpu", "cuda"), default=None,
                    dest="attnreg_device",
                    help="device to run claims on (default: cuda if torch sees a GPU)")
    group.addoption("--attnreg-report", default=None, dest="attnreg_report", metavar="PATH",
                    help="write the claims report as JSON to PATH")
    group.addoption("--attnreg-report-quiet", action="store_true", default=False,
                    dest="attnreg_report_quiet",
                    help="do not print where the JSON report was written (used by "
                         "`attnreg conformance` for its internal, temporary report)")
    group.addoption("--attnreg-exhaustive", action="store_true", default=False,
                    dest="attnreg_exhaustive",
                    help="expand the full product of declared values (default: cover each "
                         "declared value once)")
    group.addoption("--attnreg-heads", action="append", default=[], type=_positive_int,
                    dest="attnreg_heads", metavar="N",
                    help="run every configuration with N query heads (repeatable) instead "
                         "of the device's defaults, e.g. one tensor-parallel rank's share")
    group.addoption("--attnreg-plugin", action="append", default=[], dest="attnreg_plugins",
                    metavar="MODULE",
                    help="import MODULE and register it as an attnreg plugin for this run")
    group.addoption("--attnreg-disable", action="append", default=[], dest="attnreg_disable",
                    metavar="NAME", help="block an attnreg plugin or backend by name")
    group.addoption("--attnreg-time-limit", type=float, default=None,
                    dest="attnreg_time_limit", metavar="SECONDS",
                    help="refute a claim that runs longer than SECONDS (timed out) and go on; "
                         "default: $ATTNREG_CLAIM_TIME_LIMIT, else 600 on cpu, 300 on cuda; "
                         "0: no limit, claims run in this process")
    group.addoption("--attnreg-other-platforms", action="store_const", const=True,
                    default=None, dest="attnreg_other_platforms",
                    help="also list, skipped, the claims a backend declares only for other "
                         "CUDA platforms (" + ", ".join(CUDA_PLATFORMS) + "); default: on "
                         "for --attnreg-device cuda, off on cpu")
    group.addoption("--attnreg-no-other-platforms", action="store_const", const=False,
                    dest="attnreg_other_platforms",
                    help="list only the claims of the platform under test")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"a head count must be >= 1, got {value}")
    return value


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "attnreg_claim: a conformance claim of the attnreg "
                                       "suite (one declared capability of one backend)")
    config.addinivalue_line("markers", f"{OTHER_PLATFORM_MARK}: a conformance claim declared "
                                       "only for another platform (listed, skipped)")
    session = ConformanceSession(config)
    config.stash[SESSION_KEY] = session
    if session.device_option == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    session = _session(config)
    if not session.active:
        return None
    names = ", ".join(session.requested) or "(all available)"
    line = (f"attnreg conformance: backends {names}, device {session.device}, "
            f"platform {session.platform}")
    return [line]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if CLAIM_FIXTURE not in metafunc.fixturenames:
        return
    session = _session(metafunc.config)
    fixed = getattr(metafunc.cls, "attnreg_backends", None) or \
        getattr(metafunc.module, "attnreg_backends", None)
    backends = list(fixed) if fixed else list(session.requested)
    claims = session.claims_for(backends)
    params = []
    for claim in claims:
        marks = [pytest.mark.attnreg_claim]
        if claim.declared_for:
            marks.append(getattr(pytest.mark, OTHER_PLATFORM_MARK))
        if claim.skip_reason:
            marks.append(pytest.mark.skip(reason=claim.skip_reason))
        params.append(pytest.param(claim, id=claim.id, marks=marks))
    metafunc.parametrize(CLAIM_FIXTURE, params)


@pytest.fixture(scope="session")
def attnreg_harness(request: pytest.FixtureRequest
                    ) -> Generator[Harness | ClaimRunner, None, None]:
    """What runs this run's claims (``.run(claim)``): the harness (device, registry,
    oracle), behind a per-claim time limit unless the limit is 0."""
    session = _session(request.config)
    yield session.claim_runner()
    session.close()


def pytest_collection_finish(session: pytest.Session) -> None:
    # after -k / -m deselection: what --list (--collect-only) marks as other-platform
    state = _session(session.config)
    state.listed_other = [c for c in map(_claim_of, session.items)
                          if c is not None and c.declared_for]


def _claim_of(item: pytest.Item) -> Claim | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    claim = callspec.params.get(CLAIM_FIXTURE)
    return claim if isinstance(claim, Claim) else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    rep = yield
    claim = _claim_of(item)
    if claim is None:
        return rep
    session = _session(item.config)
    duration = float(getattr(rep, "duration", 0.0))
    if rep.skipped:
        session.record(claim, Status.SKIPPED, _skip_reason(rep), duration)
    elif rep.failed:
        where = "" if rep.when == "call" else f"(during {rep.when}) "
        session.record(claim, Status.REFUTED, where + _failure_message(call), duration)
    elif rep.when == "call":
        session.record(claim, Status.VERIFIED, "", duration)
    return rep


def _other_platform_lines(claims: list[Claim]) -> list[str]:
    """The ``--list`` marking of other-platform claims: each reason once, then its ids."""
    by_reason: dict[str, list[str]] = {}
    for claim in claims:
        by_reason.setdefault(claim.skip_reason, []).append(claim.id)
    lines: list[str] = []
    for reason, ids in by_reason.items():
        lines.append("")
        lines.append(f"OTHER PLATFORM (listed, skipped here) {len(ids)} "
                     f"claim{'s' if len(ids) > 1 else ''}: {reason}")
        lines.extend(f"  {i}" for i in ids)
    return lines


def _skip_reason(rep: pytest.TestReport) -> str:
    longrepr = rep.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        text = str(longrepr[2])
        return text.removeprefix("Skipped: ")
    return str(longrepr)


def _failure_message(call: pytest.CallInfo[None]) -> str:
    excinfo = call.excinfo
    if excinfo is None:
        return "failed"
    from .errors import ClaimRefuted

    if isinstance(excinfo.value, ClaimRefuted):
        return str(excinfo.value)
    text = excinfo.exconly()
    return text if len(text) <= 2000 else text[:1997] + "..."


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    session = _session(config)
    if not (session.claims_generated or session.report_path):
        return
    report = session.finish()
    verbose = config.getoption("verbose") > 0
    terminalreporter.section("attnreg conformance claims")
    listing = bool(config.getoption("collectonly"))
    for line in report.to_text(verbose=verbose, listing=listing).splitlines():
        terminalreporter.write_line(line)
    if config.getoption("collectonly"):
        for line in _other_platform_lines(session.listed_other):
            terminalreporter.write_line(line)
    if session.report_path:
        path = report.write_json(session.report_path)
        if not config.getoption("attnreg_report_quiet"):
            terminalreporter.write_line(f"claims report written to {path}")


