"""The claims report: one row per claim (verified / refuted / skipped), as text and JSON.

JSON schema (``schema_version`` 1; stable, additive changes only)::

    {
      "schema_version": 1,
      "header": {"backends": [...], "device": "cuda", "platform": "cuda:sm90",
                 "libraries": {"attnreg": "0.1.0", "torch": "2.11.0", ...},
                 "device_name": "NVIDIA H200", "exhaustive": false,
                 "unavailable": {"trtllm_mla": "reason"}, "python": "3.12.3",
                 "other_platforms": true},
      "summary": {"verified": 40, "refuted": 1, "skipped": 7,
                  "by_backend": {"triton": {"verified": 40, "refuted": 1, "skipped": 7}}},
      "claims": [{"id", "backend", "kind", "check", "statement", "status",
                  "message", "duration_s", "combo", "graph_mode", "capture",
                  "fallback_to", "pinned_method", "split_kv", "batches",
                  "needs_device_graphs", "forward_mode", "query_len"}]
    }

``status`` is ``verified``, ``refuted`` or ``skipped``; ``message`` is the
refutation (what failed and where) or the skip reason.  Nothing here imports
torch.
"""

from __future__ import annotations

import platform as _pyplatform
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnreg.registry.errors import AttnregError
from attnreg.registry.jsonfile import (
    AnyValue,
    Int,
    List,
    Map,
    Nullable,
    Num,
    Obj,
    Str,
    problems_text,
    read_json,
    write_json,
)
from attnreg.registry.spec import installed_version
from attnreg.registry.strenum import StrEnum

__all__ = ["LIBRARIES", "REPORT_SCHEMA_CHECK", "SCHEMA_VERSION", "ClaimResult", "Report",
           "ReportError", "Status", "library_versions"]

SCHEMA_VERSION = 1

#: Distributions whose versions the report header names.
LIBRARIES = ("attnreg", "torch", "triton", "flashinfer-python", "flash-attn-4",
             "nvidia-cutlass-dsl", "pluggy", "pytest")


def library_versions() -> dict[str, str | None]:
    """Installed versions of :data:`LIBRARIES` (None when absent), without importing them."""
    return {name: installed_version(name) for name in LIBRARIES}


class Status(StrEnum):
    VERIFIED = "verified"
    REFUTED = "refuted"
    SKIPPED = "skipped"


class ReportError(AttnregError, ValueError):
    """A conformance report that cannot be read or merged: names the file and the problem.

    A ``ValueError`` too, as the errors of :meth:`Report.from_dict` and
    :meth:`Report.merge` were before they had their own type.
    """

    DEFAULT_HINT = ("give a report written by `attnreg conformance -o FILE` of this attnreg "
                    "version, or run the claims again")

    def __init__(self, source: str, problem: str, *, hint: str = DEFAULT_HINT) -> None:
        self.source = source
        self.problem = problem
        self.hint = hint
        super().__init__(f"conformance report {source}: {problem}; {hint}")


_NAME = Str(nonempty=True)

#: What :meth:`Report.from_dict` and :meth:`Report.read_json` check (the keys they read);
#: other keys are kept as they are.
REPORT_SCHEMA_CHECK = Obj({
    "schema_version": Int(minimum=SCHEMA_VERSION, maximum=SCHEMA_VERSION),
    "header": Obj({"backends": List(_NAME), "device": Nullable(Str()),
                   "platform": Nullable(Str()), "device_name": Nullable(Str()),
                   "libraries": Map(Nullable(Str())), "unavailable": Map(Str())},
                  optional=("backends", "device", "platform", "device_name", "libraries",
                            "unavailable")),
    "summary": AnyValue(),
    "claims": List(Obj({"id": _NAME, "backend": _NAME,
                        "status": Str(choices=tuple(s.value for s in Status)),
                        "message": Str(), "duration_s": Num(minimum=0.0)},
                       optional=("message", "duration_s"))),
}, optional=("header", "summary", "claims"))



@dataclass
class ClaimResult:
    """The outcome of one claim.  ``claim`` is :meth:`Claim.to_dict` output."""

    claim: dict[str, Any]
    status: Status
    message: str = ""
    duration_s: float = 0.0

    @property
    def id(self) -> str:
        return str(self.claim["id"])

    @property
    def backend(self) -> str:
        return str(self.claim["backend"])

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.claim)
        out.update(status=self.status.value, message=self.message,
                   duration_s=round(self.duration_s, 4))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClaimResult:
        claim = {k: v for k, v in data.items() if k not in ("status", "message", "duration_s")}
        return cls(claim, Status(data["status"]), data.get("message", ""),
                   float(data.get("duration_s", 0.0)))


@dataclass
class Report:
    """All claim results of one run plus the header that identifies the run."""

    header: dict[str, Any] = field(default_factory=dict)
    results: list[ClaimResult] = field(default_factory=list)
    #: Where it was read from (messages of :meth:`merge`); "" for a report built here.
    source: str = field(default="", compare=False)

    def add(self, result: ClaimResult) -> None:
        """Add or replace (same claim id: a later phase of the same test wins if worse)."""
        for i, old in enumerate(self.results):
            if old.id == result.id:
                if _rank(result.status) >= _rank(old.status):
                    self.results[i] = result
                return
        self.results.append(result)

    # -- summaries -----------------------------------------------------------
    def counts(self, backend: str | None = None) -> dict[str, int]:
        out = {s.value: 0 for s in Status}
        for r in self.results:
            if backend is None or r.backend == backend:
                out[r.status.value] += 1
        return out

    def backends(self) -> list[str]:
        seen: list[str] = []
        for r in self.results:
            if r.backend not in seen:
                seen.append(r.backend)
        return seen

    @property
    def refuted(self) -> list[ClaimResult]:
        return [r for r in self.results if r.status is Status.REFUTED]

    @property
    def ok(self) -> bool:
        """True when no claim was refuted."""
        return not self.refuted

    # -- serialisation -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        summary: dict[str, Any] = dict(self.counts())
        summary["by_backend"] = {b: self.counts(b) for b in self.backends()}
        return {"schema_version": SCHEMA_VERSION, "header": self.header, "summary": summary,
                "claims": [r.to_dict() for r in self.results]}

    def write_json(self, path: str | Path) -> Path:
        """Write the report atomically (a failed write leaves what was there)."""
        return write_json(path, self.to_dict(), ReportError, what="the report")

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<dict>") -> Report:
        """Validate ``data`` (:data:`REPORT_SCHEMA_CHECK`) and build the report.

        Raises
        ------
        ReportError
            Naming ``source`` and the first problems found.
        """
        version = data.get("schema_version") if isinstance(data, dict) else None
        if isinstance(version, int) and not isinstance(version, bool) \
                and version != SCHEMA_VERSION and version.bit_length() < 64:
            raise ReportError(source, f"schema_version {version} is not {SCHEMA_VERSION}",
                              hint="re-run the claims with this attnreg version")
        problem = problems_text(REPORT_SCHEMA_CHECK, data)
        if problem:
            raise ReportError(source, problem)
        return cls(dict(data.get("header", {})),
                   [ClaimResult.from_dict(c) for c in data.get("claims", [])], source=source)

    @classmethod
    def read_json(cls, path: str | Path) -> Report:
        """The report in ``path`` (:func:`attnreg.registry.jsonfile.read_json`'s limits).

        Raises
        ------
        ReportError
            Naming the file and the problem: missing, a directory, not JSON,
            too large or too deep, or not a report.
        """
        return cls.from_dict(read_json(path, ReportError), source=str(path))

    @classmethod
    def merge(cls, reports: Iterable[Report]) -> Report:
        """One report from runs on the same platform and device, e.g. one per backend.

        Backends run in separate processes (in parallel, or one after the other)
        each write a report; this joins them.  The header of the first report is
        kept, with ``backends`` and ``unavailable`` gathered from all.  A claim id
        that appears twice keeps its worse outcome (refuted over skipped over
        verified), as within one run.

        Raises
        ------
        ReportError
            When no report is given, or the reports come from different platforms, devices or library
            versions (a library absent from one run and present in another is
            not a difference: the merged header lists its version): such a merge
            would describe a run that never happened.
        """
        reports = list(reports)
        if not reports:
            raise ReportError("(none)", "nothing to merge: no conformance reports given",
                              hint="give one --merge FILE per report")
        first = reports[0].header
        merged = cls(dict(first))
        backends: list[str] = []
        unavailable: dict[str, str] = {}
        libraries: dict[str, str | None] = dict(first.get("libraries") or {})
        for i, rep in enumerate(reports):
            for key in ("platform", "device", "device_name"):
                if rep.header.get(key) != first.get(key):
                    raise ReportError(
                        rep.source or f"number {i + 1}",
                        f"cannot merge it: it has {key} {rep.header.get(key)!r}, "
                        f"{_which(reports[0], 1)} has {first.get(key)!r}", hint=_SAME_RUN)
            # A library one run lacks (None) and another has is the same set: a backend's
            # library installed for its own run (flash-attn-4, say); two versions are not.
            for name, version in (rep.header.get("libraries") or {}).items():
                known = libraries.get(name)
                if version and known and version != known:
                    raise ReportError(
                        rep.source or f"number {i + 1}",
                        f"cannot merge it: it has {name} {version}, an earlier one {known}",
                        hint=_SAME_RUN)
                if version or name not in libraries:
                    libraries[name] = version or known
            for name in list(rep.header.get("backends", [])) + rep.backends():
                if name not in backends:
                    backends.append(name)
            unavailable.update(rep.header.get("unavailable") or {})
            for result in rep.results:
                merged.add(result)
        merged.header["backends"] = backends
        merged.header["unavailable"] = unavailable
        merged.header["libraries"] = libraries
        return merged

    # -- text ----------------------------------------------------------------
    def header_lines(self) -> list[str]:
        h = self.header
        libs = h.get("libraries", {})
        lib_text = ", ".join(f"{k} {v}" for k, v in libs.items() if v)
        lines = [f"attnreg conformance: backends {', '.join(h.get('backends', [])) or '-'} "
                 f"on {h.get('platform', '?')} (device {h.get('device', '?')}"
                 + (f", {h['device_name']}" if h.get("device_name") else "") + ")"]
        if lib_text:
            lines.append(f"libraries: {lib_text}")
        for name, reason in (h.get("unavailable") or {}).items():
            lines.append(f"not available here: {name}: {reason}")
        return lines

    def to_text(self, *, verbose: bool = False, width: int = 100, listing: bool = False) -> str:
        """The claims table: each refuted claim with its message, skips grouped by reason.

        Verified claims (and every skipped id) are listed only when ``verbose``.
        ``listing``: the claims were only listed (``--list``), so the last line
        says that nothing ran instead of a verdict.
        """
        lines = self.header_lines()
        for backend in self.backends():
            c = self.counts(backend)
            lines.append("")
            lines.append(f"{backend}: {c['verified']} verified, {c['refuted']} refuted, "
                         f"{c['skipped']} skipped")
            rows = [r for r in self.results if r.backend == backend]
            for r in rows:
                if r.status is Status.REFUTED or (verbose and r.status is Status.VERIFIED):
                    lines.append(f"  {r.status.value.upper():<9} {r.id}")
                    lines.extend(_wrapped(r.message, width))
            # skips share a handful of reasons: list each reason once, then its claims
            by_reason: dict[str, list[str]] = {}
            for r in rows:
                if r.status is Status.SKIPPED:
                    by_reason.setdefault(" ".join(r.message.split()), []).append(r.id)
            for reason, ids in by_reason.items():
                lines.append(f"  SKIPPED   {len(ids)} claim{'s' if len(ids) > 1 else ''}: "
                             f"{reason}")
                if verbose or len(ids) <= 3:
                    lines.extend(f"{' ' * 12}{i}" for i in ids)
            if not verbose and c["verified"]:
                lines.append(f"  ({c['verified']} verified claims not listed; -v lists them)")
        total = self.counts()
        lines.append("")
        if listing:
            lines.append("listed only, nothing ran: drop --list to check these claims")
            return "\n".join(lines)
        verdict = "REFUTED" if total["refuted"] else ("OK" if total["verified"]
                                                      else "NOTHING VERIFIED")
        lines.append(f"{verdict}: {total['verified']} verified, {total['refuted']} refuted, "
                     f"{total['skipped']} skipped")
        return "\n".join(lines)


_SAME_RUN = "merge only runs of one machine and one set of library versions"


def _which(report: Report, number: int) -> str:
    return report.source or f"report {number}"


def _wrapped(message: str, width: int) -> list[str]:
    text = " ".join(message.split())
    return textwrap.wrap(text, width=width, initial_indent=" " * 12,
                         subsequent_indent=" " * 12) if text else []


def _rank(status: Status) -> int:
    return {Status.VERIFIED: 0, Status.SKIPPED: 1, Status.REFUTED: 2}[status]


def base_header(backends: Iterable[str], device: str, platform: str,
                **extra: Any) -> dict[str, Any]:
    """The report header: what ran where, with which library versions."""
    header: dict[str, Any] = {
        "backends": list(backends), "device": device, "platform": platform,
        "libraries": library_versions(), "python": _pyplatform.python_version(),
    }
    header.update(extra)
    return header
