"""A DeepSeek-shaped stack of MLA attention layers for one decode step (P4).

Real projection shapes, random weights, absorbed decode as an engine runs it:

    h      = rms_norm(x)
    q      = q_b(rms_norm(q_a(h)))               -> q_nope [B,H,128], q_pe [B,H,64]
    c_kv, k_pe = kv_a(h)                         -> [B,512] (rms_norm), [B,64]
    q_pe, k_pe = rope(q_pe, k_pe, positions)
    q_abs  = q_nope @ W_UK                       -> [B,H,512]   (W_UK absorbed into q)
    attn   = backend.forward_decode([q_abs, q_pe], c_kv, k_pe, pool)  -> [B,H,512]
    x      = x + o_proj(attn @ W_UV)             -> [B,7168]

Only the attention block of each layer is modelled (no MoE / MLP), so the
step's cost is the attention layers' weights and KV reads plus the launches
between them: the part whose launch overhead CUDA graphs remove.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from attnreg.commands.calibrate import LayerShape

from .metrics import mla_layer_weight_bytes

__all__ = ["DEEPSEEK", "MLAStack", "StackShape"]


@dataclass(frozen=True)
class StackShape(LayerShape):
    """Layer count and head count on top of one layer's projection widths
    (:class:`attnreg.commands.calibrate.LayerShape`, DeepSeek-V3 by default)."""

    layers: int = 8
    heads: int = 128

    @property
    def weight_bytes(self) -> int:
        """bf16 projection weights of all layers (what a step must read at least once)."""
        return self.layers * mla_layer_weight_bytes(self.hidden, self.q_lora, self.kv_lora,
                                                    self.rope, self.nope, self.v_dim,
                                                    self.heads)


DEEPSEEK = StackShape()


class MLAStack:
    """Weights and the forward of ``shape.layers`` absorbed-MLA attention layers.

    Parameters
    ----------
    torch : module
        The torch module (passed in: this file is imported without torch by tests).
    shape : StackShape
    device : str
    max_positions : int
        Rows of the rope table.
    seed : int
    """

    def __init__(self, torch: Any, shape: StackShape, device: str, max_positions: int,
                 seed: int = 0) -> None:
        self.torch = torch
        self.shape = shape
        s = shape
        gen = torch.Generator(device=device).manual_seed(seed)
        bf16 = torch.bfloat16

        def weight(*dims: int, fan_in: int) -> Any:
            # ~N(0, 1/fan_in): activations keep unit scale through the stack.
            w = torch.empty(*dims, dtype=bf16, device=device)
            return w.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)

        self.layers = []
        for _ in range(s.layers):
            self.layers.append({
                "in_norm": torch.ones(s.hidden, dtype=bf16, device=device),
                "q_a": weight(s.q_lora, s.hidden, fan_in=s.hidden),
                "q_a_norm": torch.ones(s.q_lora, dtype=bf16, device=device),
                "q_b": weight(s.heads * (s.nope + s.rope), s.q_lora, fan_in=s.q_lora),
                "kv_a": weight(s.kv_lora + s.rope, s.hidden, fan_in=s.hidden),
                "kv_a_norm": torch.ones(s.kv_lora, dtype=bf16, device=device),
                # kv_b split per head: W_UK [H, nope, kv_lora] and W_UV [H, kv_lora, v]
                "w_uk": weight(s.heads, s.nope, s.kv_lora, fan_in=s.kv_lora),
                "w_uv": weight(s.heads, s.kv_lora, s.v_dim, fan_in=s.kv_lora),
                "o": weight(s.hidden, s.heads * s.v_dim, fan_in=s.heads * s.v_dim),
            })
        half = s.rope // 2
        inv_freq = 1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float32,
                                                   device=device) / half))
        angles = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] \
            * inv_freq[None, :]
        self.cos = angles.cos().to(bf16)
        self.sin = angles.sin().to(bf16)

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:
        half = self.shape.rope // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, x: Any, positions: Any, backend: Any, pools: list[Any],
                batch: Any = None) -> Any:
        """One decode step: ``x [B, hidden]`` -> ``[B, hidden]``.

        ``batch`` is the eager batch, or None under graph capture (the backend
        then reads the metadata bound by ``init_forward_metadata_capture``).
        """
        torch = self.torch
        F = torch.nn.functional
        s = self.shape
        B = x.shape[0]
        cos = self.cos[positions]
        sin = self.sin[positions]
        for w, pool in zip(self.layers, pools):
            h = F.rms_norm(x, (s.hidden,), w["in_norm"], eps=1e-6)
            qa = F.rms_norm(F.linear(h, w["q_a"]), (s.q_lora,), w["q_a_norm"], eps=1e-6)
            q = F.linear(qa, w["q_b"]).view(B, s.heads, s.nope + s.rope)
            q_nope, q_pe = q.split([s.nope, s.rope], dim=-1)
            c_kv, k_pe = F.linear(h, w["kv_a"]).split([s.kv_lora, s.rope], dim=-1)
            c_kv = F.rms_norm(c_kv, (s.kv_lora,), w["kv_a_norm"], eps=1e-6)
            q_pe = self._rope(q_pe, cos[:, None, :], sin[:, None, :])
            k_pe = self._rope(k_pe, cos, sin)
            q_abs = torch.bmm(q_nope.transpose(0, 1), w["w_uk"]).transpose(0, 1)
            q_full = torch.cat([q_abs, q_pe], dim=-1)
            attn = backend.forward_decode(q_full, c_kv, k_pe, pool, batch)
            o = torch.bmm(attn.transpose(0, 1), w["w_uv"]).transpose(0, 1)
            x = x + F.linear(o.reshape(B, s.heads * s.v_dim), w["o"])
        return x
