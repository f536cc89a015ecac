"""Graph configuration: per-phase modes, what the user locked, capture sizes.

Defaults (documented in docs/policy.md): decode FULL; prefill BREAKABLE on
CUDA, TC_PIECEWISE elsewhere, as sglang does today.  A key the user set
explicitly is *locked*: soft rules never change it, and a hard rule that
forbids it fails startup instead of silently downgrading.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from ..registry.capabilities import VALID_GRAPH_MODES, GraphMode, Phase
from ..registry.platform import Platform, Vendor

__all__ = [
    "DEFAULT_CAPTURE_BUDGET_FRACTION",
    "DEFAULT_DECODE_BATCH_SIZES",
    "DEFAULT_MAX_SEQ_LEN",
    "DEFAULT_PREFILL_NUM_TOKENS",
    "LOCKABLE_KEYS",
    "GraphConfig",
    "default_mode",
    "mode_key",
]

#: Request slots captured for decode (attnreg's default; engines pass their own).
DEFAULT_DECODE_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160,
                                               192, 256)
#: Token buckets captured for prefill (attnreg's default; engines pass their own).
DEFAULT_PREFILL_NUM_TOKENS: tuple[int, ...] = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
#: Largest number of requests in one captured prefill batch (attnreg's default).
DEFAULT_PREFILL_MAX_REQUESTS = 64
#: Longest sequence a captured graph serves when the engine does not say
#: (``MLAConfig.max_context_len`` uses the same default).
DEFAULT_MAX_SEQ_LEN = 8192
#: The default capture memory budget, as a fraction of one device's memory (a
#: policy choice, see docs/decisions.md): an engine keeps most of the device for
#: weights and the KV pool (sglang's static fraction is 0.8-0.9 by default), so
#: captured graphs that need more than a tenth of it are not a default.
DEFAULT_CAPTURE_BUDGET_FRACTION = 0.10

#: Prefill default per vendor; anything not listed gets TC_PIECEWISE.
_DEFAULT_PREFILL_BY_VENDOR: dict[Vendor, GraphMode] = {Vendor.CUDA: GraphMode.BREAKABLE}
_DEFAULT_PREFILL_OTHERWISE = GraphMode.TC_PIECEWISE
_DEFAULT_DECODE = GraphMode.FULL


def mode_key(phase: Phase) -> str:
    """The config key of a phase's mode (``"prefill_mode"`` / ``"decode_mode"``)."""
    return f"{phase.value}_mode"


LOCKABLE_KEYS = frozenset({"prefill_mode", "decode_mode", "capture_memory_budget_bytes"})


def default_mode(platform: Platform, phase: Phase) -> GraphMode:
    """The built-in default mode of ``phase`` on ``platform`` (before any rule)."""
    if phase is Phase.DECODE:
        return _DEFAULT_DECODE
    return _DEFAULT_PREFILL_BY_VENDOR.get(platform.vendor, _DEFAULT_PREFILL_OTHERWISE)


def _check_buckets(name: str, values: Iterable[int]) -> tuple[int, ...]:
    out = tuple(values)
    if not out or any(v < 1 for v in out) or list(out) != sorted(set(out)):
        raise ValueError(f"{name} must be a non-empty increasing tuple of positive ints, "
                         f"got {out!r}")
    return out


@dataclass(frozen=True)
class GraphConfig:
    """Per-phase graph modes and capture sizes.

    Parameters
    ----------
    prefill_mode, decode_mode
        the mode asked for; None means the platform default.  A value that is
        not in ``locked`` is an engine default that soft rules may adjust.
    locked
        keys the user set explicitly (``"prefill_mode"``, ``"decode_mode"``,
        ``"capture_memory_budget_bytes"``).  Use :meth:`from_user` to lock
        whatever the user passed.
    capture_memory_budget_bytes
        soft budget for all captured phases together (backend capture
        buffers + model capture pool); None = the default budget,
        ``capture_budget_fraction`` of the device memory.  A value given by
        the user (locked) always replaces the default.
    capture_budget_fraction
        the default budget as a fraction of one device's memory
        (:data:`DEFAULT_CAPTURE_BUDGET_FRACTION`); 0 turns the default
        budget off.
    decode_batch_sizes, prefill_num_tokens, prefill_max_requests
        what is captured: decode request-slot buckets, prefill token buckets,
        and the largest request count of a captured prefill batch.
    padding_waste_factor
        a prefill batch whose bucket exceeds its token count by more than this
        factor runs eagerly (seed 000: 2x).
    """

    prefill_mode: GraphMode | None = None
    decode_mode: GraphMode | None = None
    locked: frozenset[str] = frozenset()
    capture_memory_budget_bytes: int | None = None
    capture_budget_fraction: float = DEFAULT_CAPTURE_BUDGET_FRACTION
    decode_batch_sizes: tuple[int, ...] = DEFAULT_DECODE_BATCH_SIZES
    prefill_num_tokens: tuple[int, ...] = DEFAULT_PREFILL_NUM_TOKENS
    prefill_max_requests: int = DEFAULT_PREFILL_MAX_REQUESTS
    padding_waste_factor: float = 2.0

    def __post_init__(self) -> None:
        for phase in Phase:
            key = mode_key(phase)
            value = getattr(self, key)
            if value is not None:
                value = cast(GraphMode, GraphMode.parse(value))
                object.__setattr__(self, key, value)
                allowed = (GraphMode.DISABLED, *VALID_GRAPH_MODES[phase])
                if value not in allowed:
                    raise ValueError(
                        f"{phase} cannot use graph mode {value}; choose one of "
                        f"{', '.join(m.value for m in allowed)}")
        locked = frozenset(self.locked)
        unknown = locked - LOCKABLE_KEYS
        if unknown:
            raise ValueError(f"unknown locked keys {sorted(unknown)}; lockable: "
                             f"{sorted(LOCKABLE_KEYS)}")
        for key in locked:
            if getattr(self, key) is None:
                raise ValueError(f"{key} is locked but has no value")
        object.__setattr__(self, "locked", locked)
        object.__setattr__(self, "decode_batch_sizes",
                           _check_buckets("decode_batch_sizes", self.decode_batch_sizes))
        object.__setattr__(self, "prefill_num_tokens",
                           _check_buckets("prefill_num_tokens", self.prefill_num_tokens))
        if self.prefill_max_requests < 1:
            raise ValueError("prefill_max_requests must be >= 1")
        if self.padding_waste_factor < 1.0:
            raise ValueError("padding_waste_factor must be >= 1.0 (1.0 = exact buckets only)")
        if self.capture_memory_budget_bytes is not None and self.capture_memory_budget_bytes < 0:
            raise ValueError("capture_memory_budget_bytes must be >= 0")
        if not 0.0 <= self.capture_budget_fraction <= 1.0:
            raise ValueError(f"capture_budget_fraction must be within 0..1, got "
                             f"{self.capture_budget_fraction}")

    @classmethod
    def from_user(cls, *, prefill: GraphMode | str | None = None,
                  decode: GraphMode | str | None = None,
                  capture_memory_budget_bytes: int | None = None,
                  **sizes: object) -> GraphConfig:
        """A config where every mode/budget the user passed is locked.

        Examples
        --------
        >>> GraphConfig.from_user(prefill="tc_piecewise").locked
        frozenset({'prefill_mode'})
        """
        locked = set()
        if prefill is not None:
            locked.add("prefill_mode")
        if decode is not None:
            locked.add("decode_mode")
        if capture_memory_budget_bytes is not None:
            locked.add("capture_memory_budget_bytes")
        return cls(prefill_mode=cast(GraphMode | None, prefill),
                   decode_mode=cast(GraphMode | None, decode),
                   locked=frozenset(locked),
                   capture_memory_budget_bytes=capture_memory_budget_bytes,
                   **sizes)  # type: ignore[arg-type]

    def is_locked(self, phase: Phase) -> bool:
        return mode_key(phase) in self.locked

    def requested_mode(self, platform: Platform, phase: Phase) -> GraphMode:
        """The mode asked for (config value, else the platform default)."""
        value = cast(GraphMode | None, getattr(self, mode_key(phase)))
        return value if value is not None else default_mode(platform, phase)

    def max_slots(self, phase: Phase) -> int:
        """Request slots of the largest captured batch of ``phase``."""
        if phase is Phase.DECODE:
            return self.decode_batch_sizes[-1]
        return self.prefill_max_requests

    def max_tokens(self, phase: Phase) -> int:
        """Query rows of the largest captured batch of ``phase``."""
        if phase is Phase.DECODE:
            return self.decode_batch_sizes[-1]
        return self.prefill_num_tokens[-1]

    def to_dict(self) -> dict[str, object]:
        return {
            "prefill_mode": self.prefill_mode.value if self.prefill_mode else None,
            "decode_mode": self.decode_mode.value if self.decode_mode else None,
            "locked": sorted(self.locked),
            "capture_memory_budget_bytes": self.capture_memory_budget_bytes,
            "capture_budget_fraction": self.capture_budget_fraction,
            "decode_batch_sizes": list(self.decode_batch_sizes),
            "prefill_num_tokens": list(self.prefill_num_tokens),
            "prefill_max_requests": self.prefill_max_requests,
            "padding_waste_factor": self.padding_waste_factor,
        }
