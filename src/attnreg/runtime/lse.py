"""Log-sum-exp outputs and merging attention over disjoint key sets.

attnreg's LSE convention (every backend that declares ``KernelConstraints.lse``):
for query row ``t`` and head ``h``, over the keys ``j`` that row may see,

    ``lse[t, h] = ln( sum_j exp(sm_scale * q[t, h] . k[j]) )``

in float32, natural log, with ``k`` dequantised (an fp8 pool's ``stored *
scale``) and, for absorbed MLA, the 576-wide dot (latent + rope).  A row that
sees no key (a zero-length sequence, a padding row of a replayed graph) has
output 0 and LSE ``-inf``, so merging it changes nothing.  (flashinfer's kernels
work in base 2; its backend converts.)

Two attention results over disjoint key sets of the same queries merge into
the result over their union with :func:`merge_attention_states` -- what
chunked-prefix MHA does per prefix chunk, and what split-KV kernels do inside.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["PrefixDecompress", "merge_attention_states"]

#: ``decompress(latent [n, kv_lora_rank], rope [n, rope_dim]) -> (k [n, H, qk], v [n, H, v])``:
#: the engine's ``kv_b_proj`` applied to cached prefix rows (chunked-prefix MHA).
PrefixDecompress = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def merge_attention_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                           lse_b: torch.Tensor, *, out: torch.Tensor | None = None,
                           lse_out: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention over key sets A and B (disjoint) into attention over A and B.

    ``out = (exp(lse_a) * out_a + exp(lse_b) * out_b) / (exp(lse_a) + exp(lse_b))`` and
    ``lse = ln(exp(lse_a) + exp(lse_b))``, computed stably in float32.  A row whose
    LSE is ``-inf`` on one side takes the other side unchanged; ``-inf`` on both
    gives 0 and ``-inf``.  Device operations only (no host read): capture-safe.

    Parameters
    ----------
    out_a, out_b : Tensor [rows, H, D]
    lse_a, lse_b : float32 Tensor [rows, H] (natural log)
    out, lse_out : Tensor, optional
        Where to write (may be ``out_a`` / ``lse_a``: in place); default new
        tensors (``out`` in ``out_a``'s dtype).

    Returns
    -------
    (Tensor, Tensor)
        The merged output and LSE.

    Examples
    --------
    >>> o1, o2 = torch.ones(1, 1, 2), torch.zeros(1, 1, 2)
    >>> lse = torch.zeros(1, 1)
    >>> o, l = merge_attention_states(o1, lse, o2, lse)
    >>> o.tolist(), round(l.item(), 4)            # equal weights: the mean, ln 2
    ([[[0.5, 0.5]]], 0.6931)
    """
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a = torch.exp(lse_a - m_safe)
    w_b = torch.exp(lse_b - m_safe)
    total = w_a + w_b
    inv = torch.where(total > 0, 1.0 / torch.where(total > 0, total, torch.ones_like(total)),
                      torch.zeros_like(total))
    merged = (out_a.float() * (w_a * inv).unsqueeze(-1)
              + out_b.float() * (w_b * inv).unsqueeze(-1))
    lse = m_safe + torch.log(total)  # log(0) = -inf where neither side saw a key
    if out is None:
        out = merged.to(out_a.dtype)
    else:
        out.copy_(merged)
    if lse_out is None:
        lse_out = lse
    else:
        lse_out.copy_(lse)
    return out, lse_out
