"""Sparse attention meets declarations: which backends can run a sparse (DSA) model.

A model with ``sparse_top_k`` set ("attention is sparse with top-k K") runs a
backend's declared sparse MLA kernels (``Capabilities.sparse_kernels``) and
nothing else; a dense model never runs them.  No rule here reads a model or
backend name: the top-k, dtypes, heads and page size are checked against the
declarations, and the declaration a sparse phase is planned with is
:meth:`~attnreg.registry.Capabilities.sparse_view` (its sparse kernels and
their capture support), so every capture rule reads the sparse facts.
"""

from __future__ import annotations

from ..registry.capabilities import Capabilities, Phase
from .engine import EngineFacts
from .model import ModelFacts

__all__ = ["planned_declaration", "sparse_rejections"]


def sparse_rejections(caps: Capabilities, phase: Phase, model: ModelFacts,
                      engine: EngineFacts) -> list[str]:
    """Why no sparse kernel of ``caps`` runs ``phase`` of the sparse ``model`` (empty =
    one does)."""
    return caps.check_sparse_request(phase, top_k=model.sparse_top_k, q_dtype=model.act_dtype,
                                     kv_dtype=model.kv_dtype, page_size=engine.page_size,
                                     num_heads=model.num_heads)


def planned_declaration(caps: Capabilities, model: ModelFacts) -> Capabilities:
    """The declaration the policy plans ``model`` with: the sparse view for a sparse model,
    ``caps`` itself for a dense one."""
    return caps.sparse_view() if model.sparse else caps
