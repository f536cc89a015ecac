"""vote(): make every data-parallel rank take the same replay-or-eager decision.

Each rank computes its local eligibility with :class:`ReplayGate`; ranks
whose decisions differ would issue mismatched collectives inside and outside
the graph, so the schedule-time decision is the AND over ranks, computed with
``all_reduce(MIN)`` on a one-element int tensor.

Superseded by :func:`~attnreg.graph_policy.sync`, which also agrees on the
bucket and forward mode, checks that every rank shares one plan (its
fingerprint), waits at most a timeout, and has a documented vote for an idle
rank; ``vote`` has none of those.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["vote"]


def vote(eligible: bool, group: Any = None) -> bool:
    """True only if ``eligible`` is True on every rank of ``group``.

    Parameters
    ----------
    eligible
        this rank's local decision.
    group
        a ``torch.distributed`` process group (None = the default group).  The
        tensor lives where the group's backend communicates: CPU for gloo, the
        current CUDA device for NCCL.

    Returns
    -------
    bool
        the AND over all ranks; ``eligible`` itself when no process group is
        initialised (single process), without importing torch if it was not
        imported yet.
    """
    if "torch.distributed" not in sys.modules:
        return bool(eligible)  # nobody can have initialised a process group
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return bool(eligible)
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    flag = torch.tensor([1 if eligible else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
