"""One class per conformance check: what it is, whether it runs on cpu, how it runs.

:data:`CHECKS` is the one table the harness dispatches through
(``CHECKS[claim.check].run(harness, claim)``); a check's class says which
:class:`~attnreg.testing.harness.Harness` procedure runs it and with which
options, and whether its capture claims run without a device graph (on cpu,
under ``capturing(mode)`` with capture and replay emulated by the graph
runner).  The claims a check makes are expanded in
:mod:`attnreg.testing.claims` (keyed by the same :class:`Check`).

Pure at import (no torch): the harness is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from attnreg.registry import GraphMode

from .claims import MULTI_LAYER_COUNT, Check, Claim, ClaimKind

if TYPE_CHECKING:
    from .harness import Harness

__all__ = ["CHECKS", "CPU_RUNNABLE_CAPTURE_CHECKS", "ConformanceCheck", "GraphOptions",
           "needs_device_graphs"]


@dataclass(frozen=True)
class GraphOptions:
    """How :meth:`Harness.check_graph` runs a FULL / BREAKABLE capture claim."""

    #: pool layers captured in one graph over one captured plan
    layers: int = 1
    #: fill the output with NaN before each replay; padding rows must come out zero
    padded: bool = False
    #: capture under the sync guard and account the allocator around the capture
    sync_check: bool = False
    #: allocate and free large tensors between replays
    churn: bool = False
    #: only the capture-mode code path (no device graph), even on cuda
    path_only: bool = False


class ConformanceCheck:
    """A check: its :class:`Check` value, its claim kind, where it runs, how it runs."""

    check: ClassVar[Check]
    #: the kinds of claim it makes (multi-layer: eager and capture)
    kinds: ClassVar[tuple[ClaimKind, ...]]
    #: whether its capture claims run on cpu (without a device graph)
    runs_on_cpu: ClassVar[bool] = True

    def run(self, harness: Harness, claim: Claim) -> None:
        """Check ``claim``: return when it holds, raise ClaimRefuted when it does not."""
        raise NotImplementedError


CHECKS: dict[Check, ConformanceCheck] = {}


def _register(cls: type[ConformanceCheck]) -> type[ConformanceCheck]:
    if cls.check in CHECKS:
        raise AssertionError(f"two classes for check {cls.check}")
    CHECKS[cls.check] = cls()
    return cls


# -- eager ----------------------------------------------------------------------------
@_register
class MatchesReference(ConformanceCheck):
    """Each declared input configuration computes what the float64 oracle computes."""

    check = Check.MATCHES_REFERENCE
    kinds = (ClaimKind.EAGER,)

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_eager(claim)


@_register
class Lse(ConformanceCheck):
    """``return_lse=True`` returns the oracle's natural-log log-sum-exp."""

    check = Check.LSE
    kinds = (ClaimKind.EAGER,)

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_eager(claim, with_lse=True)


@_register
class MultiLayer(ConformanceCheck):
    """Several layers of one pool, one plan per step: each layer matches its own oracle
    (eagerly, and captured in one graph)."""

    check = Check.MULTI_LAYER
    kinds = (ClaimKind.EAGER, ClaimKind.CAPTURE)

    def run(self, harness: Harness, claim: Claim) -> None:
        if claim.kind is ClaimKind.EAGER:
            harness.check_eager(claim, layers=MULTI_LAYER_COUNT)
        else:
            harness.check_graph(claim, GraphOptions(layers=MULTI_LAYER_COUNT))


# -- refusals ---------------------------------------------------------------------------
class _Refusal(ConformanceCheck):
    """An input outside the declaration is refused with UnsupportedError before a launch."""

    kinds = (ClaimKind.REFUSAL,)

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_refusal(claim)


for _check in (Check.PAGE_SIZE, Check.Q_DTYPE, Check.KV_DTYPE, Check.HEAD_DIMS,
               Check.NUM_HEADS, Check.INDEX_DTYPE, Check.METHOD):
    _register(type(f"Refuses_{_check.value}", (_Refusal,),
                   {"check": _check, "__doc__": f"{_Refusal.__doc__} ({_check.value})"}))


# -- capture ----------------------------------------------------------------------------
@_register
class RefusesCapture(ConformanceCheck):
    """A mode declared UNSUPPORTED is refused when a capture is prepared."""

    check = Check.REFUSES_CAPTURE
    kinds = (ClaimKind.CAPTURE,)

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_refuses_capture(claim)


@_register
class CapturePath(ConformanceCheck):
    """The capture-mode code path (capture metadata, replay metadata per batch) is right
    without a device graph, and a NATIVE mode is served natively."""

    check = Check.CAPTURE_PATH
    kinds = (ClaimKind.CAPTURE,)

    def run(self, harness: Harness, claim: Claim) -> None:
        if claim.graph_mode is GraphMode.TC_PIECEWISE:
            harness.check_piecewise(claim, path_only=True)
        else:
            harness.check_graph(claim, GraphOptions(path_only=True))


@_register
class FallbackServed(ConformanceCheck):
    """A FALLBACK mode is served by the declared ``fallback_to``."""

    check = Check.FALLBACK_SERVED
    kinds = (ClaimKind.CAPTURE,)

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_fallback_served(claim)


@_register
class Pinning(ConformanceCheck):
    """Under a pinning mode the pinned method runs and every other one is refused."""

    check = Check.PINNING
    kinds = (ClaimKind.CAPTURE,)

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_pinning(claim)


@_register
class Replay(ConformanceCheck):
    """Captured once, the graph replays new batches correctly."""

    check = Check.REPLAY
    kinds = (ClaimKind.CAPTURE,)
    runs_on_cpu = False

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_graph(claim, GraphOptions())


@_register
class AllocatorChurn(ConformanceCheck):
    """Replays stay right with large tensors allocated and freed between them."""

    check = Check.ALLOCATOR_CHURN
    kinds = (ClaimKind.CAPTURE,)
    runs_on_cpu = False

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_graph(claim, GraphOptions(churn=True))


@_register
class NoSyncAlloc(ConformanceCheck):
    """Nothing in the captured region syncs with the host or allocates outside the pool."""

    check = Check.NO_SYNC_ALLOC
    kinds = (ClaimKind.CAPTURE,)
    runs_on_cpu = False

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_graph(claim, GraphOptions(sync_check=True))


@_register
class SplitKV(ConformanceCheck):
    """Split-KV survives capture as declared: short capture, long replays."""

    check = Check.SPLIT_KV
    kinds = (ClaimKind.CAPTURE,)
    runs_on_cpu = False

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_graph(claim, GraphOptions())


@_register
class PaddedRows(ConformanceCheck):
    """A smaller batch replayed through a bigger graph gets exactly zero padding rows."""

    check = Check.PADDED_ROWS
    kinds = (ClaimKind.CAPTURE,)

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_graph(claim, GraphOptions(padded=True))


@_register
class CaptureMemory(ConformanceCheck):
    """What the capture allocates is within the declared CaptureMemory estimate."""

    check = Check.CAPTURE_MEMORY
    kinds = (ClaimKind.CAPTURE,)

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_capture_memory(claim)


@_register
class Piecewise(ConformanceCheck):
    """Attention runs eagerly between captured TC_PIECEWISE graph pieces."""

    check = Check.PIECEWISE
    kinds = (ClaimKind.CAPTURE,)
    runs_on_cpu = False

    def run(self, harness: Harness, claim: Claim) -> None:
        harness.check_piecewise(claim)


# -- availability ------------------------------------------------------------------------
@_register
class Available(ConformanceCheck):
    """A requested backend can run here (its claim is always skipped with the reason)."""

    check = Check.AVAILABLE
    kinds = (ClaimKind.AVAILABILITY,)

    def run(self, harness: Harness, claim: Claim) -> None:
        from .errors import HarnessLimitation

        raise HarnessLimitation(f"nothing to run for a {claim.kind} claim")


from . import sparse_checks  # noqa: E402,F401  (registers the sparse checks)

_missing = set(Check) - set(CHECKS)
if _missing:  # a Check value without its class would be dispatched nowhere
    raise AssertionError(f"checks without a class: {sorted(_missing)}")

#: Capture checks that also run without a CUDA graph: on cpu under
#: ``capturing(mode)`` with capture and replay emulated by the graph runner
#: (capture memory is then read from the backend's typed graph state).
CPU_RUNNABLE_CAPTURE_CHECKS = frozenset(
    c.check for c in CHECKS.values() if c.runs_on_cpu and ClaimKind.CAPTURE in c.kinds)


def needs_device_graphs(check: Check) -> bool:
    """Whether ``check``'s capture claims need a real device graph (skipped on cpu)."""
    return not CHECKS[check].runs_on_cpu
