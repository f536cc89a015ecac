"""What a forward reads (:class:`ForwardMetadata`, typed by the backend's plan), and the
phase and graph mode it runs under."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from attnreg.graph_policy.capture import current_capture, in_eager_break
from attnreg.registry import ForwardMode, GraphMode, Phase
from attnreg.registry.capabilities import PHASE_FORWARD_MODES

from .batch import ForwardBatch, PrefixChunk
from .indices import BatchIndices, IndexFields, accepts_index_keywords

__all__ = [
    "ATTENTION_CAPTURE_MODES",
    "DEFAULT_CAPTURE_MODE",
    "ForwardMetadata",
    "PlanT",
    "graph_mode_now",
    "phase_of",
]

#: What a backend plans per batch (a dataclass of its own: split counts, workspaces,
#: planned library wrappers).  ``None`` for backends that plan nothing.
PlanT = TypeVar("PlanT")

#: Graph modes under which attention itself is recorded into a graph.  Under
#: TC_PIECEWISE attention is a splitting op that runs eagerly between pieces.
ATTENTION_CAPTURE_MODES: tuple[GraphMode, ...] = (GraphMode.FULL, GraphMode.BREAKABLE)

#: The graph mode assumed when attention is captured with no ``capturing()``
#: context: the mode that captures attention in each phase.
DEFAULT_CAPTURE_MODE: Mapping[Phase, GraphMode] = {
    Phase.DECODE: GraphMode.FULL,
    Phase.PREFILL: GraphMode.BREAKABLE,
}


#: Forward mode -> the phase whose graphs serve it, read from the registry's
#: :data:`~attnreg.registry.capabilities.PHASE_FORWARD_MODES` (the one source of the mapping):
#: DECODE, TARGET_VERIFY and DRAFT_EXTEND are decode-phase batches, EXTEND prefill.
_PHASE_OF: Mapping[ForwardMode, Phase] = {
    mode: phase for phase, modes in PHASE_FORWARD_MODES.items() for mode in modes}


def graph_mode_now(phase: Phase | str, device: torch.device) -> GraphMode:
    """The graph mode code on ``device`` runs under, for ``phase``: the ``capturing()``
    mode (:func:`~attnreg.graph_policy.capture.current_capture`), DISABLED inside an
    ``eager_break``; a CUDA stream capturing with no ``capturing()`` context is taken to
    capture attention (:data:`DEFAULT_CAPTURE_MODE`), so a backend that cannot be
    captured still refuses with a clear error."""
    if in_eager_break():
        return GraphMode.DISABLED
    mode = current_capture()
    if mode is not None:
        return mode
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return DEFAULT_CAPTURE_MODE[Phase.parse(phase)]
    return GraphMode.DISABLED


def phase_of(forward_mode: ForwardMode | str) -> Phase:
    """The phase of a forward mode (``PHASE_FORWARD_MODES``): speculative batches
    (TARGET_VERIFY, DRAFT_EXTEND) are decode-phase batches, captured with the decode
    graphs; EXTEND is prefill."""
    return _PHASE_OF[ForwardMode.parse(forward_mode)]


@accepts_index_keywords
@dataclass
class ForwardMetadata(IndexFields, Generic[PlanT]):
    """What the forward hooks read: device tensors, host bounds and the backend's plan.

    ``indices`` (:class:`~attnreg.runtime.BatchIndices`) holds the device index
    tensors, readable by their names (``md.seq_lens``, ``md.page_table`` ...).
    Eager metadata shares the batch's own ``indices`` and carries host copies
    of the lengths (``seq_lens_cpu`` ...).  Graph metadata references slices of
    the preallocated graph buffers; its host copies are None (lengths change
    at every replay without the host being asked), and ``max_seq_len`` /
    ``max_extend_len`` are the capture-time bounds.  ``plan`` is what the
    backend planned for this batch or captured shape, a dataclass of its own
    (``TritonPlan``, ``FlashInferPlan`` ...): its planning hooks set it.
    """

    forward_mode: ForwardMode
    batch_size: int
    num_tokens: int
    indices: BatchIndices
    max_seq_len: int
    max_extend_len: int
    graph_mode: GraphMode = GraphMode.DISABLED
    batch: ForwardBatch | None = None
    seq_lens_cpu: tuple[int, ...] | None = None
    prefix_lens_cpu: tuple[int, ...] | None = None
    extend_lens_cpu: tuple[int, ...] | None = None
    num_kv_tokens: int | None = None
    plan: PlanT | None = None
    #: chunked-prefix MHA: the batch's prefix chunks per chunk size, computed once
    #: for every layer of the step (eager metadata only)
    prefix_chunk_cache: dict[int, list[PrefixChunk]] = field(default_factory=dict)

    @property
    def phase(self) -> Phase:
        return phase_of(self.forward_mode)

    @property
    def is_decode(self) -> bool:
        """One new token per sequence (forward mode DECODE); verify and draft-extend
        batches are decode-phase but carry several."""
        return self.forward_mode is ForwardMode.DECODE

    @property
    def is_graph(self) -> bool:
        """Whether this is the metadata of a captured shape (graph buffers, no host lengths)."""
        return self.graph_mode is not GraphMode.DISABLED

    @classmethod
    def from_batch(cls, batch: ForwardBatch) -> ForwardMetadata[PlanT]:
        """Eager metadata referencing ``batch``'s tensors (no plan yet)."""
        return cls(
            forward_mode=batch.forward_mode, batch_size=batch.batch_size,
            num_tokens=batch.num_tokens, indices=batch.indices, max_seq_len=batch.max_seq_len, max_extend_len=batch.max_extend_len,
            batch=batch, seq_lens_cpu=batch.seq_lens_cpu,
            prefix_lens_cpu=batch.prefix_lens_cpu, extend_lens_cpu=batch.extend_lens_cpu,
            num_kv_tokens=batch.num_kv_tokens)
