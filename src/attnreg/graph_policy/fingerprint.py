"""PlanFingerprint: what every data-parallel rank must share, as one short stable hash.

:func:`~attnreg.graph_policy.sync` agrees on a bucket and a forward mode; that
answer means the same graph on every rank only if every rank captured the same
graphs.  Two ranks whose plans differ (rank 1 with decode buckets 1, 3, 5, 7
beside rank 0's defaults) would both agree on "replay bucket 4", and rank 1
never captured a bucket of 4.  So each rank's packed row carries its plan's
fingerprint, and :func:`~attnreg.graph_policy.unpack` refuses rows whose
fingerprints differ, on every rank.

The fingerprint covers what decides which graph a replay runs and what it
computes: per phase the graph mode, backend and pinned method; per captured
forward mode the buckets (batch sizes, token counts), request slots, query
tokens per sequence and longest sequence; the server features; the cost
profile that decides prefill batches (its content, not its path); the
packed-row format; and, for a :class:`~attnreg.graph_policy.ReplayGate`, the
hidden states its graphs captured and whether it runs an eager logprob tail.
It leaves out what does not change the graphs (the decision trace, messages,
the memory estimate).  Pure Python: no torch.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from .cost_profile import CostProfile
from .plan import GraphPlan, PhasePlan
from .sync import PACK_VERSION

__all__ = ["FINGERPRINT_HEX_DIGITS", "PlanFingerprint", "cost_profile_id", "plan_fingerprint"]

#: Hex digits of :attr:`PlanFingerprint.digest` (48 bits: two different plans share
#: a digest with odds of about 1 in 2.8e14; the value fits the packed int64 row).
FINGERPRINT_HEX_DIGITS = 12


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:FINGERPRINT_HEX_DIGITS]


def cost_profile_id(profile: CostProfile | None) -> str:
    """A stable id of a cost profile's content: ``"none"``, or ``"BACKEND@HASH"``.

    The hash covers the profile JSON (:meth:`CostProfile.to_dict`), not the file
    it was read from: two ranks that load the same profile from different paths
    share its id; a profile recalibrated in place gets another.
    """
    if profile is None:
        return "none"
    text = json.dumps(profile.to_dict(), sort_keys=True, separators=(",", ":"), default=str)
    return f"{profile.backend}@{_digest(text)}"


@dataclass(frozen=True)
class PlanFingerprint:
    """The facts every rank must share, in a fixed order, and their short hash.

    ``fields`` are ``(name, value)`` pairs (values are plain strings, so two
    fingerprints compare field by field: :meth:`differences`): ``pack_version``;
    per phase ``prefill.mode``, ``.backend``, ``.pinned_method``; per captured
    forward mode ``decode.batch_sizes``, ``.num_tokens``, ``.max_requests``,
    ``.query_len``, ``.max_seq_len`` (``extend.``, ``target_verify.``,
    ``draft_extend.`` likewise); ``features``; ``cost_profile``; and a gate's
    ``captured_hidden`` and ``eager_logprob_tail``.  ``str()`` is
    :attr:`digest`.

    docs/policy.md ("Data-parallel agreement") shows two plans that differ in
    their decode buckets and the fields :meth:`differences` names.
    """

    fields: tuple[tuple[str, str], ...]

    @property
    def digest(self) -> str:
        """:data:`FINGERPRINT_HEX_DIGITS` hex digits of SHA-256 over the fields."""
        return _digest(json.dumps(self.fields, separators=(",", ":")))

    def as_int(self) -> int:
        """The digest as a non-negative int (below 2**48): what a packed row carries."""
        return int(self.digest, 16)

    def as_dict(self) -> dict[str, str]:
        return dict(self.fields)

    def differences(self, other: PlanFingerprint | Mapping[str, str]) -> tuple[str, ...]:
        """The names of the fields whose values differ (or that only one side has)."""
        mine = self.as_dict()
        theirs = other.as_dict() if isinstance(other, PlanFingerprint) else dict(other)
        names = list(mine) + [n for n in theirs if n not in mine]
        return tuple(n for n in names if mine.get(n) != theirs.get(n))

    def describe_differences(self, other: PlanFingerprint | Mapping[str, str]) -> str:
        """``"name: mine vs theirs; ..."`` for every differing field."""
        mine = self.as_dict()
        theirs = other.as_dict() if isinstance(other, PlanFingerprint) else dict(other)
        return "; ".join(f"{n}: {mine.get(n, '(absent)')} vs {theirs.get(n, '(absent)')}"
                         for n in self.differences(theirs))

    def __str__(self) -> str:
        return self.digest


def _ints(values: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in values)


def _phase_fields(pp: PhasePlan) -> list[tuple[str, str]]:
    name = pp.phase.value
    out = [(f"{name}.mode", pp.mode.value), (f"{name}.backend", pp.backend),
           (f"{name}.pinned_method", pp.pinned_method.value if pp.pinned_method else "none")]
    for shapes in pp.captured:
        key = shapes.forward_mode.value  # a forward mode belongs to one phase
        out += [(f"{key}.batch_sizes", _ints(shapes.batch_sizes)),
                (f"{key}.num_tokens", _ints(shapes.num_tokens)),
                (f"{key}.max_requests", str(shapes.max_requests)),
                (f"{key}.query_len", str(shapes.query_len)),
                (f"{key}.max_seq_len", str(shapes.max_seq_len))]
    return out


def plan_fingerprint(plan: GraphPlan, *, cost_profile_id: str = "none",
                     gate_settings: Mapping[str, str] | None = None) -> PlanFingerprint:
    """The fingerprint of ``plan`` (see the module doc for what it covers).

    Parameters
    ----------
    plan
        the resolved plan every rank should share.
    cost_profile_id
        the id of the cost profile that decides prefill batches
        (:func:`cost_profile_id`; ``"none"`` without one).
    gate_settings
        further ``name -> value`` facts of the replay gate
        (:attr:`ReplayGate.fingerprint` passes its captured hidden states and
        eager logprob tail).
    """
    fields = [("pack_version", str(PACK_VERSION))]
    fields += _phase_fields(plan.prefill) + _phase_fields(plan.decode)
    fields += [("features", ",".join(plan.features.enabled()) or "none"),
               ("cost_profile", cost_profile_id)]
    fields += [(k, str(v)) for k, v in sorted((gate_settings or {}).items())]
    if plan.decode.bucket_backends:
        # only with per-bucket decode backends, so every other plan keeps its digest
        fields.append(("decode.bucket_backends",
                       ",".join(f"{b.bucket}:{b.backend}" for b in plan.decode.bucket_backends)))
    return PlanFingerprint(tuple(fields))
