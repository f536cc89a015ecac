"""Engine facts: what the serving engine knows about itself at startup.

:class:`ModelFacts` says what the model needs, :class:`GraphConfig` what the
user asked for; :class:`EngineFacts` says what the engine runs with: its KV
page size and pool, its longest context, how many requests it runs at once,
its device memory, its speculative-decoding draft length, and which graph
modes the host engine itself supports.  Backends that do not declare the page
size or context are skipped, captured shapes and the capture memory estimate
follow these numbers, and a mode the host engine lacks is never planned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import cast

from ..registry.capabilities import VALID_GRAPH_MODES, GraphMode, Phase
from .config import DEFAULT_MAX_SEQ_LEN

__all__ = ["EngineFacts"]


def _modes(phase: Phase, value: Iterable[GraphMode | str] | None) -> frozenset[GraphMode] | None:
    if value is None:
        return None
    modes = frozenset(cast(GraphMode, GraphMode.parse(m)) for m in value)
    allowed = {GraphMode.DISABLED, *VALID_GRAPH_MODES[phase]}
    unknown = sorted(m.value for m in modes - allowed)
    if unknown:
        raise ValueError(f"{phase} graph modes {unknown} do not exist for {phase}; "
                         f"choose among {', '.join(sorted(m.value for m in allowed))}")
    return modes | {GraphMode.DISABLED}  # eager always works


@dataclass(frozen=True)
class EngineFacts:
    """Facts about the serving engine that graph decisions depend on.

    Parameters
    ----------
    page_size
        tokens per KV-pool page; backends whose kernels do not declare it are
        skipped (None: the engine did not say, no page-size filter).
    max_context_len
        the longest sequence (cached + new tokens) the engine serves; graphs
        are captured for it, kernels declaring less are skipped, and the
        replay gate refuses longer sequences.  Default
        :data:`~attnreg.graph_policy.config.DEFAULT_MAX_SEQ_LEN`, the same
        default as ``MLAConfig``.
    max_running_requests
        the most requests the engine runs in one batch; decode buckets above
        the first one that holds it are not captured (None: no limit).
    kv_pool_bytes
        size of the engine's whole KV pool; capture memory of a fallback that
        converts or copies the pool inside the graph scales with it (0: not
        said, such memory is left out of the estimate and a decision says so).
    device_memory_bytes
        memory of one device; the default capture budget is
        ``GraphConfig.capture_budget_fraction`` of it (None: the platform's
        known default, see ``attnreg.registry.KNOWN_DEVICES``).
    num_draft_tokens
        speculative decoding: query tokens per sequence of a target-verify
        batch (sglang's ``speculative_num_draft_tokens``); 0 = off or unknown.
        Draft-extend batches carry 1..``num_draft_tokens`` tokens per sequence.
    prefill_graph_modes, decode_graph_modes
        the graph modes the host engine itself can run per phase (None: all
        of attnreg's).  A mode outside them is never planned, and a lock on
        it fails startup (``engine.mode_unsupported``).
    """

    page_size: int | None = None
    max_context_len: int = DEFAULT_MAX_SEQ_LEN
    max_running_requests: int | None = None
    kv_pool_bytes: int = 0
    device_memory_bytes: int | None = None
    num_draft_tokens: int = 0
    prefill_graph_modes: frozenset[GraphMode] | None = None
    decode_graph_modes: frozenset[GraphMode] | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.page_size is not None and self.page_size < 1:
            problems.append(f"page_size must be >= 1, got {self.page_size}")
        if self.max_context_len < 1:
            problems.append(f"max_context_len must be >= 1, got {self.max_context_len}")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            problems.append(f"max_running_requests must be >= 1, got "
                            f"{self.max_running_requests}")
        if self.kv_pool_bytes < 0:
            problems.append(f"kv_pool_bytes must be >= 0, got {self.kv_pool_bytes}")
        if self.device_memory_bytes is not None and self.device_memory_bytes < 1:
            problems.append(f"device_memory_bytes must be >= 1, got {self.device_memory_bytes}")
        if self.num_draft_tokens < 0:
            problems.append(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if problems:
            raise ValueError("invalid EngineFacts: " + "; ".join(problems))
        object.__setattr__(self, "prefill_graph_modes",
                           _modes(Phase.PREFILL, self.prefill_graph_modes))
        object.__setattr__(self, "decode_graph_modes",
                           _modes(Phase.DECODE, self.decode_graph_modes))

    def graph_modes(self, phase: Phase) -> frozenset[GraphMode] | None:
        """The host engine's modes for ``phase`` (None: every mode attnreg has)."""
        return self.prefill_graph_modes if phase is Phase.PREFILL else self.decode_graph_modes

    def supports_mode(self, phase: Phase, mode: GraphMode) -> bool:
        """Whether the host engine can run ``phase`` under ``mode`` (DISABLED always)."""
        modes = self.graph_modes(phase)
        return mode is GraphMode.DISABLED or modes is None or mode in modes

    def to_dict(self) -> dict[str, object]:
        def modes(phase: Phase) -> list[str] | None:
            found = self.graph_modes(phase)
            return None if found is None else sorted(m.value for m in found)

        return {
            "page_size": self.page_size,
            "max_context_len": self.max_context_len,
            "max_running_requests": self.max_running_requests,
            "kv_pool_bytes": self.kv_pool_bytes,
            "device_memory_bytes": self.device_memory_bytes,
            "num_draft_tokens": self.num_draft_tokens,
            "prefill_graph_modes": modes(Phase.PREFILL),
            "decode_graph_modes": modes(Phase.DECODE),
        }
