"""The MLA attention layer that calibration and the benchmarks run: real shapes, random weights.

One DeepSeek-shaped attention block, as an engine runs it::

    h      = rms_norm(x)
    q      = q_b(rms_norm(q_a(h)))              -> q_nope [N,H,nope], q_pe [N,H,rope]
    c_kv, k_pe = kv_a(h)                        -> [N,kv_lora] (rms_norm), [N,rope]
    q_pe, k_pe = rope(q_pe, k_pe, positions)
    absorbed:  q = [q_nope @ W_UK, q_pe]  -> attention over the latent pool -> @ W_UV
    MHA:       k, v = kv_b(latent rows)   -> ragged attention (192 / 128 wide heads)
    x      = x + o_proj(attention output)

``kv_b`` [H * (nope + v), kv_lora] is one matrix whose per-head blocks are
``W_UK`` and ``W_UV``, so the absorbed and the MHA form compute the same
function (calibration compares them).  Only the attention block is modelled
(no MoE / MLP).  torch is passed in, so importing this module never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["DRY_LAYER", "LayerShape", "MLALayer"]


@dataclass(frozen=True)
class LayerShape:
    """Projection widths of one MLA attention block (DeepSeek-V3 by default)."""

    hidden: int = 7168
    q_lora: int = 1536
    kv_lora: int = 512
    rope: int = 64
    nope: int = 128
    v_dim: int = 128

    def weight_bytes(self, heads: int, elem_bytes: int = 2) -> int:
        """Bytes of the layer's projection weights (no norms): what a step reads at least once.

        q_a ``hidden x q_lora``, q_b ``q_lora x H(nope + rope)``, kv_a
        ``hidden x (kv_lora + rope)``, kv_b (W_UK and W_UV) ``kv_lora x H(nope + v)``,
        o ``H v x hidden``.

        >>> LayerShape().weight_bytes(128) // 2**20
        356
        """
        params = (self.hidden * self.q_lora + self.q_lora * heads * (self.nope + self.rope)
                  + self.hidden * (self.kv_lora + self.rope)
                  + self.kv_lora * heads * (self.nope + self.v_dim)
                  + heads * self.v_dim * self.hidden)
        return params * elem_bytes


#: Tiny widths for dry runs (kv_lora, rope, nope, v_dim are the kernels' fixed dims).
DRY_LAYER = LayerShape(hidden=256, q_lora=128)


class MLALayer:
    """One MLA attention layer with random bf16 weights: the projections around attention.

    ``pre`` -> (absorbed: ``absorb`` -> attention -> ``unabsorb``; MHA:
    ``decompress`` -> attention) -> ``post``.

    Parameters
    ----------
    torch : module
        torch (passed in so that importing this module never imports it).
    shape : LayerShape
    heads : int
        Attention heads on this rank.
    device : str
    seed : int
    max_positions : int
        Rows of the rope tables.
    """

    def __init__(self, torch: Any, shape: LayerShape, heads: int, device: str, *, seed: int,
                 max_positions: int) -> None:
        self.torch = torch
        self.shape = shape
        self.heads = heads
        s, h = shape, heads
        bf16 = torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(seed)

        def weight(*dims: int, fan_in: int) -> Any:
            # ~N(0, 1/fan_in): activations keep unit scale through the layer.
            w = torch.empty(*dims, dtype=bf16, device=device)
            return w.normal_(0.0, fan_in ** -0.5, generator=gen)

        def ones(n: int) -> Any:
            return torch.ones(n, dtype=bf16, device=device)

        self.in_norm, self.q_a_norm, self.kv_a_norm = ones(s.hidden), ones(s.q_lora), \
            ones(s.kv_lora)
        self.q_a = weight(s.q_lora, s.hidden, fan_in=s.hidden)
        self.q_b = weight(h * (s.nope + s.rope), s.q_lora, fan_in=s.q_lora)
        self.kv_a = weight(s.kv_lora + s.rope, s.hidden, fan_in=s.hidden)
        self.kv_b = weight(h * (s.nope + s.v_dim), s.kv_lora, fan_in=s.kv_lora)
        per_head = self.kv_b.view(h, s.nope + s.v_dim, s.kv_lora)
        self.w_uk = per_head[:, :s.nope, :].contiguous()                  # [H, nope, kv_lora]
        self.w_uv = per_head[:, s.nope:, :].transpose(1, 2).contiguous()  # [H, kv_lora, v]
        self.o = weight(s.hidden, h * s.v_dim, fan_in=h * s.v_dim)
        half = s.rope // 2
        inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32, device=device)
                                      / half))
        angles = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] \
            * inv_freq[None, :]
        self.cos, self.sin = angles.cos().to(bf16), angles.sin().to(bf16)

    def rope_at(self, positions: Any) -> tuple[Any, Any]:
        """``(cos, sin)`` rows of ``positions``; a stack of layers computes them once per step."""
        return self.cos[positions], self.sin[positions]

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = self.shape.rope // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def pre(self, x: Any, positions: Any = None, *, rope: tuple[Any, Any] | None = None
            ) -> tuple[Any, Any, Any, Any]:
        """``x [N, hidden]`` -> ``q_nope [N,H,nope], q_pe [N,H,rope], c_kv [N,kv_lora],
        k_pe [N,rope]``; ``rope`` is :meth:`rope_at` of ``positions`` when given."""
        F = self.torch.nn.functional
        s, n = self.shape, x.shape[0]
        h = F.rms_norm(x, (s.hidden,), self.in_norm, eps=1e-6)
        qa = F.rms_norm(F.linear(h, self.q_a), (s.q_lora,), self.q_a_norm, eps=1e-6)
        q = F.linear(qa, self.q_b).view(n, self.heads, s.nope + s.rope)
        q_nope, q_pe = q.split([s.nope, s.rope], dim=-1)
        c_kv, k_pe = F.linear(h, self.kv_a).split([s.kv_lora, s.rope], dim=-1)
        c_kv = F.rms_norm(c_kv, (s.kv_lora,), self.kv_a_norm, eps=1e-6)
        cos, sin = rope if rope is not None else self.rope_at(positions)
        q_pe = self._rope(q_pe, cos[:, None, :], sin[:, None, :])
        k_pe = self._rope(k_pe, cos, sin)
        return q_nope, q_pe, c_kv, k_pe

    def absorb(self, q_nope: Any, q_pe: Any) -> Any:
        """The absorbed query ``[N, H, kv_lora + rope]``: ``q_nope @ W_UK`` then the rope part."""
        torch = self.torch
        q_abs = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)
        return torch.cat([q_abs, q_pe], dim=-1)

    def unabsorb(self, attn: Any) -> Any:
        """``[N, H, kv_lora]`` -> ``[N, H, v]`` with ``W_UV``."""
        return self.torch.bmm(attn.transpose(0, 1), self.w_uv).transpose(0, 1)

    def decompress(self, rows: Any) -> tuple[Any, Any]:
        """Latent rows ``[Tk, kv_lora + rope]`` -> ``k [Tk, H, nope + rope]``, ``v [Tk, H, v]``."""
        torch = self.torch
        F = torch.nn.functional
        s, tk = self.shape, rows.shape[0]
        kv = F.linear(rows[:, :s.kv_lora], self.kv_b).view(tk, self.heads, s.nope + s.v_dim)
        k_nope, v = kv.split([s.nope, s.v_dim], dim=-1)
        k_pe = rows[:, None, s.kv_lora:].expand(tk, self.heads, s.rope)
        return torch.cat([k_nope, k_pe], dim=-1), v.contiguous()

    def post(self, x: Any, out: Any) -> Any:
        """Residual add of ``o_proj(out [N, H, v])``."""
        F = self.torch.nn.functional
        return x + F.linear(out.reshape(x.shape[0], self.heads * self.shape.v_dim), self.o)

    def forward_decode(self, x: Any, rope: tuple[Any, Any], backend: Any, pool: Any,
                       batch: Any) -> Any:
        """One absorbed decode step of this layer (``batch`` None under capture)."""
        q_nope, q_pe, c_kv, k_pe = self.pre(x, rope=rope)
        attn = backend.forward_decode(self.absorb(q_nope, q_pe), c_kv, k_pe, pool, batch)
        return self.post(x, self.unabsorb(attn))

    def forward_absorbed(self, x: Any, positions: Any, backend: Any, pool: Any,
                         batch: Any) -> Any:
        """The prefill graph path: absorbed MLA extend (``batch`` None under capture)."""
        from attnreg.registry import ForwardMethod

        q_nope, q_pe, c_kv, k_pe = self.pre(x, positions)
        attn = backend.forward_extend(self.absorb(q_nope, q_pe), c_kv, k_pe, pool, batch,
                                      method=ForwardMethod.MLA)
        return self.post(x, self.unabsorb(attn))

    def forward_mha(self, x: Any, positions: Any, backend: Any, pool: Any, batch: Any,
                    kv_slots: Any) -> Any:
        """The eager prefill path: write the new rows, decompress prefix + new tokens, ragged MHA.

        ``kv_slots``: flat pool slots of every sequence's tokens in ``kv_indptr`` order.
        """
        from attnreg.registry import ForwardMethod

        torch = self.torch
        q_nope, q_pe, c_kv, k_pe = self.pre(x, positions)
        pool.write(batch.out_cache_loc, c_kv, k_pe)
        k, v = self.decompress(pool.buffer.view(-1, pool.row_dim)[kv_slots])
        attn = backend.forward_extend(torch.cat([q_nope, q_pe], dim=-1), None, None, pool,
                                      batch, method=ForwardMethod.MHA, k=k, v=v)
        return self.post(x, attn)
