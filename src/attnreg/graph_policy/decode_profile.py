"""Decode profiles: measured decode times per backend and per capture bucket.

No single decode kernel is fastest everywhere (issue 31 measured one backend
1.65x faster than another at one long sequence on few heads, and the other
ahead at 64-128 heads).  A decode graph is captured per batch-size
bucket, so a plan may give each bucket its own backend, provided every one of
them reads the same KV pool.  A :class:`DecodeProfile` holds what that choice
is made from: for one pool layout (platform, heads per rank, KV dtype, page
size), per backend and per bucket, the replayed decode time at a few KV
lengths.  ``attnreg calibrate --decode`` measures it through
:class:`attnreg.runtime.GraphSession` (the code that runs); this module only
reads, checks and compares.  Plain data, no torch.

Profile JSON (``schema`` ``attnreg.decode_profile``, ``schema_version`` 1)
--------------------------------------------------------------------------
Required: ``schema``, ``schema_version``, ``platform`` (``cuda:sm90``),
``heads`` (attention heads on one rank), ``kv_dtype``, ``page_size`` (the one
pool every entry was measured over), ``entries``: a list of ``{"backend":
NAME, "bucket": batch size, "points": [{"kv_len": tokens per sequence, "us":
microseconds per layer}, ...]}``, one entry per (backend, bucket), each KV
length once.  Informational (kept, not interpreted): ``device``, ``created``,
``dry_run``, ``note``, ``versions``, ``timing``, ``layers`` and per point
``samples_us`` / ``p20_us`` / ``p80_us``.

Comparison
----------
:meth:`DecodeProfile.ratio` is the geometric mean, over the KV lengths both
backends were measured at in that bucket, of one backend's time over the
other's; None when they share no KV length (the policy never answers from a
missing fact).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..registry.capabilities import DType
from ..registry.jsonfile import (
    Bool,
    Check,
    Int,
    List,
    Num,
    Obj,
    Str,
    newer_schema_problem,
    problems_text,
    read_json,
    write_json,
)
from ..registry.platform import Platform
from .cost_profile import CostProfileError

__all__ = [
    "DECODE_PROFILE_SCHEMA",
    "DECODE_PROFILE_SCHEMA_CHECK",
    "DECODE_PROFILE_SCHEMA_VERSION",
    "DecodeEntry",
    "DecodeProfile",
    "DecodeProfileError",
    "load_decode_profile",
    "save_decode_profile",
]

DECODE_PROFILE_SCHEMA = "attnreg.decode_profile"
DECODE_PROFILE_SCHEMA_VERSION = 1


class DecodeProfileError(CostProfileError):
    """A decode profile that cannot be used: names the file and the problem."""

    kind = "decode profile"
    default_hint = ("regenerate it with `attnreg calibrate --decode --backend A,B "
                    "--output PATH` on the device it describes")


@dataclass(frozen=True)
class DecodeEntry:
    """One backend at one decode bucket: ``points`` are ``(kv_len, us)``, by KV length."""

    backend: str
    bucket: int
    points: tuple[tuple[int, float], ...]

    def times(self) -> dict[int, float]:
        return dict(self.points)

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "bucket": self.bucket,
                "points": [{"kv_len": k, "us": us} for k, us in self.points]}


@dataclass(frozen=True)
class DecodeProfile:
    """A validated decode profile; build it with :func:`load_decode_profile` or
    :meth:`from_dict`.

    Examples
    --------
    >>> def entry(name, bucket, us):
    ...     return {"backend": name, "bucket": bucket, "points": [{"kv_len": 4096, "us": us}]}
    >>> profile = DecodeProfile.from_dict({"schema": DECODE_PROFILE_SCHEMA,
    ...     "schema_version": 1, "platform": "cuda:sm90", "heads": 16, "kv_dtype": "bf16",
    ...     "page_size": 64, "entries": [entry("a", 1, 30.0), entry("b", 1, 50.0)]})
    >>> round(profile.ratio(1, "a", "b"), 2), profile.ratio(8, "a", "b")
    (0.6, None)
    """

    platform: Platform
    heads: int
    kv_dtype: DType
    page_size: int
    entries: tuple[DecodeEntry, ...]
    source: str = "<dict>"
    device: str = ""
    created: str = ""
    dry_run: bool = False
    data: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False,
                                    repr=False)

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "<dict>") -> DecodeProfile:
        """Validate ``data`` (a parsed decode profile JSON) and build the profile.

        Raises
        ------
        DecodeProfileError
            Naming ``source`` and the first problem (:data:`DECODE_PROFILE_SCHEMA_CHECK`).
        """
        too_new = newer_schema_problem(data, DECODE_PROFILE_SCHEMA_VERSION)
        if too_new:
            raise DecodeProfileError(source, too_new, hint="upgrade attnreg or recalibrate")
        problem = problems_text(DECODE_PROFILE_SCHEMA_CHECK, data)
        if problem:
            raise DecodeProfileError(source, problem)
        entries = tuple(
            DecodeEntry(e["backend"], int(e["bucket"]),
                        tuple(sorted((int(p["kv_len"]), float(p["us"])) for p in e["points"])))
            for e in data["entries"])
        return cls(platform=Platform.parse(data["platform"]), heads=int(data["heads"]),
                   kv_dtype=DType(data["kv_dtype"]), page_size=int(data["page_size"]),
                   entries=entries, source=source, device=str(data.get("device") or ""),
                   created=str(data.get("created") or ""),
                   dry_run=bool(data.get("dry_run", False)), data=dict(data))

    def to_dict(self) -> dict[str, Any]:
        """The profile JSON: the data it was built from, with the validated fields."""
        out = dict(self.data)
        out.update(schema=DECODE_PROFILE_SCHEMA, schema_version=DECODE_PROFILE_SCHEMA_VERSION,
                   platform=str(self.platform), heads=self.heads, kv_dtype=self.kv_dtype.value,
                   page_size=self.page_size)
        if "entries" not in out:
            out["entries"] = [e.to_dict() for e in self.entries]
        return out

    # -- queries -----------------------------------------------------------------------
    @property
    def backends(self) -> tuple[str, ...]:
        """The measured backends, in the order they first appear."""
        return tuple(dict.fromkeys(e.backend for e in self.entries))

    def entry(self, backend: str, bucket: int) -> DecodeEntry | None:
        return next((e for e in self.entries if e.backend == backend and e.bucket == bucket),
                    None)

    def ratio(self, bucket: int, backend: str, other: str) -> float | None:
        """Geometric mean over the shared KV lengths of ``backend``'s time / ``other``'s at
        ``bucket``; None when either was not measured there or they share no KV length."""
        a, b = self.entry(backend, bucket), self.entry(other, bucket)
        if a is None or b is None:
            return None
        ta, tb = a.times(), b.times()
        shared = sorted(set(ta) & set(tb))
        if not shared:
            return None
        return math.exp(sum(math.log(ta[k] / tb[k]) for k in shared) / len(shared))

    def mismatch(self, platform: Platform | str, heads: int, kv_dtype: DType | str,
                 page_size: int) -> str:
        """Why this profile does not describe that pool ('' = it does)."""
        wants = (("platform", Platform.parse(platform), self.platform),
                 ("heads per rank", int(heads), self.heads),
                 ("KV dtype", DType.parse(kv_dtype), self.kv_dtype),
                 ("page size", int(page_size), self.page_size))
        off = [f"{what} {have} (the plan's is {want})" for what, want, have in wants
               if want != have]
        return "it was measured at " + ", ".join(off) if off else ""

    @property
    def profile_id(self) -> str:
        """A stable id of the content (not the path): ``"decode@HASH"``."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"), default=str)
        return "decode@" + hashlib.sha256(text.encode()).hexdigest()[:12]

    @property
    def label(self) -> str:
        extra = ", ".join(x for x in (self.device, self.created[:10]) if x)
        dry = "; DRY RUN, not a measurement" if self.dry_run else ""
        return (f"{self.source} ({self.platform}, {self.heads} heads, {self.kv_dtype} KV, page "
                f"{self.page_size}{'; ' + extra if extra else ''}{dry})")


def _platform_problem(text: str) -> str | None:
    try:
        Platform.parse(text)
    except ValueError as exc:
        return str(exc)
    return None


def _points_problem(points: list[Any]) -> str | None:
    lens = [p["kv_len"] for p in points]
    if not lens:
        return "no points: an entry needs at least one measured KV length"
    if len(set(lens)) != len(lens):
        return f"KV lengths {sorted(lens)} repeat: one point per KV length"
    return None


def _entries_problem(entries: list[Any]) -> str | None:
    if not entries:
        return "no entries: a decode profile needs at least one measured (backend, bucket)"
    seen: set[tuple[str, int]] = set()
    for e in entries:
        key = (e["backend"], e["bucket"])
        if key in seen:
            return f"backend {key[0]!r} at bucket {key[1]} is listed twice"
        seen.add(key)
    return None


_POINT = Obj({"kv_len": Int(minimum=1), "us": Num(minimum=1e-9)})
_ENTRY = Obj({"backend": Str(nonempty=True), "bucket": Int(minimum=1),
              "points": Check(List(_POINT), _points_problem)})

#: The whole decode profile, as :func:`attnreg.registry.jsonfile.read_json` checks it.
DECODE_PROFILE_SCHEMA_CHECK = Obj({
    "schema": Str(choices=(DECODE_PROFILE_SCHEMA,)),
    "schema_version": Int(minimum=DECODE_PROFILE_SCHEMA_VERSION,
                          maximum=DECODE_PROFILE_SCHEMA_VERSION),
    "platform": Check(Str(nonempty=True), _platform_problem),
    "heads": Int(minimum=1),
    "kv_dtype": Str(choices=tuple(d.value for d in DType)),
    "page_size": Int(minimum=1),
    "entries": Check(List(_ENTRY), _entries_problem),
    "dry_run": Bool(),
}, optional=("dry_run",))


def load_decode_profile(path: str | os.PathLike[str]) -> DecodeProfile:
    """Read and validate a decode profile JSON file.

    Raises
    ------
    DecodeProfileError
        The file is missing, not JSON, or not a valid decode profile.
    """
    p = Path(path)
    if not p.exists():
        raise DecodeProfileError(str(p), "no such file",
                                 hint="give the path `attnreg calibrate --decode` wrote")
    return DecodeProfile.from_dict(read_json(p, DecodeProfileError), source=str(p))


def save_decode_profile(data: DecodeProfile | Mapping[str, Any],
                        path: str | os.PathLike[str]) -> Path:
    """Validate and write a decode profile (never one that cannot be read back)."""
    out = data.to_dict() if isinstance(data, DecodeProfile) else dict(data)
    DecodeProfile.from_dict(out, source=str(path))
    return write_json(path, out, DecodeProfileError, what="the decode profile")
