"""The typed pieces of a :class:`~attnreg.runtime.GraphSession` step: its inputs, result,
counters, static buffers, the step a session calls, and the one ``ForwardBatch`` ->
``ReplayBatch`` conversion the gate is asked with."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import FrozenInstanceError, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from attnreg.graph_policy import ReplayBatch, ReplayReason
from attnreg.registry import ForwardMode

from .batch import ForwardBatch

if TYPE_CHECKING:
    from .session import GraphSession

__all__ = ["SYNC_EAGER", "AgreedStep", "BucketKey", "SessionCounts", "SessionError",
           "SessionStep", "StaticBuffers", "StepFn", "StepInputs", "StepResult", "replay_batch"]


#: The count key of a step the gate would replay but that ran eagerly because another
#: data-parallel rank could not replay it (``Agreed.replay`` False).
SYNC_EAGER = "sync.other_rank_eager"


class AgreedStep(Protocol):
    """What a data-parallel group agreed for a step (:class:`attnreg.graph_policy.sync`'s
    ``Agreed``): replay or not, and the bucket every rank pads to."""

    @property
    def replay(self) -> bool: ...

    @property
    def bucket(self) -> int | None: ...


#: A captured graph of a session: (forward mode, bucket).  Decode-phase buckets are
#: batch sizes, prefill buckets token counts.
BucketKey = tuple[ForwardMode, int]


class SessionError(RuntimeError):
    """The session was asked for something its captured graphs cannot do.

    Raised when a replay gate answers a bucket the session never captured (its
    plan and the session's buckets differ), when :meth:`GraphSession.replay`
    is asked to replay a batch no graph holds, or when inputs do not match the
    session's layers.
    """


def replay_batch(batch: ForwardBatch, **facts: Any) -> ReplayBatch:
    """The :class:`~attnreg.graph_policy.ReplayBatch` the gate is asked about for ``batch``.

    The one conversion from a runtime batch to the gate's torch-free facts:
    forward mode, batch size, tokens and every request's host lengths (so no
    rule of the gate is answered from a missing fact).  ``facts`` are the
    engine facts a ForwardBatch does not carry (``lora``,
    ``has_input_embeds``, ``capture_hidden``, ``return_logprob``, ...).

    >>> from attnreg.runtime import MLAConfig, decode_batch
    >>> pool = MLAConfig(num_heads=2, page_size=16).make_pool(4)
    >>> replay_batch(decode_batch(pool, [5, 9])).seq_lens
    (5, 9)
    """
    packed = batch.packed
    if not facts and packed is not None and packed.serves(batch):
        # built (and checked) by ForwardBatch.build and unchanged since: no per-length checks
        seq, prefix, extend = packed.host_lens
        return ReplayBatch.checked(batch.forward_mode, len(seq), sum(extend), prefix, extend,
                                   seq)
    return ReplayBatch(forward_mode=batch.forward_mode, batch_size=batch.batch_size,
                       num_tokens=batch.num_tokens, prefix_lens=batch.prefix_lens_cpu,
                       extend_lens=batch.extend_lens_cpu, seq_lens=batch.seq_lens_cpu,
                       **facts)


@dataclass
class StepInputs:
    """The attention inputs of one step, one entry per layer the session attends.

    ``q[i]``, ``latent_new[i]``, ``rope_new[i]`` are layer ``i``'s query rows and
    the new tokens' cache rows (``None``: the caller wrote them already, or the
    session does not write the KV).  ``k`` / ``v``: the ragged MHA inputs of
    prefix + new tokens (the MHA method only), shared by the layers.
    ``q_scale[i]``: layer ``i``'s float32 ``[1]`` dequantisation scale when its q is
    fp8 (a kernel declaring fp8 queries), else None.
    """

    q: list[torch.Tensor]
    latent_new: list[torch.Tensor | None] = field(default_factory=list)
    rope_new: list[torch.Tensor | None] = field(default_factory=list)
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    q_scale: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.q)
        if not self.latent_new:
            self.latent_new = [None] * n
        if not self.rope_new:
            self.rope_new = [None] * n
        if not self.q_scale:
            self.q_scale = [None] * n
        if len(self.latent_new) != n or len(self.rope_new) != n or len(self.q_scale) != n:
            raise ValueError(f"StepInputs: {n} q, {len(self.latent_new)} latent_new, "
                             f"{len(self.rope_new)} rope_new and {len(self.q_scale)} "
                             "q_scale; give one of each per layer")

    @classmethod
    def one(cls, q: torch.Tensor, latent_new: torch.Tensor | None = None,
            rope_new: torch.Tensor | None = None, *, k: torch.Tensor | None = None,
            v: torch.Tensor | None = None, q_scale: torch.Tensor | None = None) -> StepInputs:
        """The inputs of a one-layer step."""
        return cls([q], [latent_new], [rope_new], k, v, [q_scale])

    @property
    def layers(self) -> int:
        return len(self.q)

    @property
    def rows(self) -> int:
        return int(self.q[0].shape[0])


@dataclass(init=False)
class StepResult:
    """What :meth:`GraphSession.run` returns.

    ``outputs``: every layer's attention output, real rows only (a replay's are
    views of the session's static outputs, valid until the next step; clone
    what you keep).  ``replayed``: whether a graph ran; ``bucket``: the one it
    ran (None when eager); ``reason``: this rank's gate answer (``gate.ok`` on
    a replay, the rule that sent it eager otherwise); ``rule``: what decided
    the step (the reason's rule, or :data:`SYNC_EAGER` when the gate said
    replay but another data-parallel rank could not).

    Immutable, as a frozen dataclass (assigning a field raises
    ``dataclasses.FrozenInstanceError``); written by hand because a frozen
    dataclass's generated ``__init__`` sets each field through
    ``object.__setattr__``, 0.45 of the 0.7 us one result cost per session step
    (issue 26: host time of a step).
    """

    outputs: list[torch.Tensor]
    replayed: bool
    bucket: int | None
    reason: ReplayReason
    rule: str = ""

    def __init__(self, outputs: list[torch.Tensor], replayed: bool, bucket: int | None,
                 reason: ReplayReason, rule: str = "") -> None:
        # the instance dict directly: __setattr__ refuses every assignment
        self.__dict__.update(outputs=outputs, replayed=replayed, bucket=bucket, reason=reason,
                             rule=rule or reason.rule)

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    @property
    def output(self) -> torch.Tensor:
        """Layer 0's output (the only one of a one-layer session)."""
        return self.outputs[0]


@dataclass
class SessionCounts:
    """Steps a session ran, by rule id: ``replayed["gate.ok"]``, ``eager["gate.batch_slots"]``.

    Keys are the gate's rule ids, and :data:`SYNC_EAGER` for a step another
    data-parallel rank sent eager.
    """

    replayed: Counter[str] = field(default_factory=Counter)
    eager: Counter[str] = field(default_factory=Counter)

    def record(self, replayed: bool, rule: str) -> None:
        (self.replayed if replayed else self.eager)[rule] += 1

    @property
    def replays(self) -> int:
        return sum(self.replayed.values())

    @property
    def eager_runs(self) -> int:
        return sum(self.eager.values())

    def to_dict(self) -> dict[str, dict[str, int]]:
        return {"replayed": dict(self.replayed), "eager": dict(self.eager)}


@dataclass
class StaticBuffers:
    """The tensors every graph of a session reads and writes, sized for its largest bucket.

    A bucket's graph records views of their first rows.  ``latents`` / ``ropes``
    are empty when the session does not write the KV; ``k`` / ``v`` exist for the
    MHA method only; ``q_scales`` (one float32 ``[1]`` per layer) for fp8 queries only.
    """

    qs: list[torch.Tensor]
    latents: list[torch.Tensor]
    ropes: list[torch.Tensor]
    outs: list[torch.Tensor]
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    q_scales: list[torch.Tensor] = field(default_factory=list)

    def named(self) -> dict[str, torch.Tensor]:
        """Every static tensor by name (``q[layer 1]`` ... for several layers)."""
        out: dict[str, torch.Tensor] = {}
        n = len(self.qs)
        for i in range(n):
            at = f"[layer {i}]" if n > 1 else ""
            out[f"q{at}"] = self.qs[i]
            if self.q_scales:
                out[f"q_scale{at}"] = self.q_scales[i]
            if self.latents:
                out[f"latent_new{at}"] = self.latents[i]
                out[f"rope_new{at}"] = self.ropes[i]
            out[f"out{at}"] = self.outs[i]
        if self.k is not None and self.v is not None:
            out.update(k=self.k, v=self.v)
        return out


@dataclass(frozen=True)
class SessionStep:
    """What the step function of a session gets: one call of attention over every layer.

    ``batch`` is None inside a captured graph (the backend reads its graph
    metadata) and the batch when it runs eagerly (or as TC_PIECEWISE's eager
    attention).  ``inputs`` / ``outputs`` are the tensors to attend and write:
    views of the static buffers in a graph, the caller's inputs (outputs None:
    allocated by the backend) on an eager run.  ``bucket``: the captured bucket
    this call is part of (None on an eager run): a step with tensors of its own
    picks that bucket's.
    """

    session: GraphSession
    forward_mode: ForwardMode
    batch: ForwardBatch | None
    inputs: StepInputs | None
    outputs: list[torch.Tensor] | None
    bucket: int | None = None


#: A session's step: attention over its layers (default :meth:`GraphSession.attend`).
StepFn = Callable[[SessionStep], Any]
