"""attnreg's backends behind sglang's ``AttentionBackend`` interface.

:class:`AttnregAttentionBackend` wraps one attnreg backend (by registry name)
and is registered with sglang as ``attnreg_<name>`` (:mod:`.registration`),
so ``--attention-backend attnreg_triton`` runs attnreg's Triton kernels inside
sglang.  Per step it converts sglang's batch (:mod:`.batches`); it reads and
writes sglang's own KV buffers through a zero-copy view (:mod:`.kv_cache`).

How sglang's calls map (sglang 0.5.23):

| sglang | attnreg |
|---|---|
| ``init_forward_metadata(fb)`` (eager, once per step) | ``init_forward_metadata(batch)`` |
| ``forward_decode`` / ``forward_extend(q, k, v, layer, fb, save_kv_cache)`` | ``forward(q, latent_new, rope_new, pool, batch, layer_id=layer.layer_id - start_layer)`` (DECODE to ``forward_decode``, EXTEND / TARGET_VERIFY to ``forward_extend``) |
| absorbed layer (``attn_mqa``: q ``[T, H, 576]``, k ``[T, 1, 576]``, or q / k split with ``q_rope`` / ``k_rope``) | ``method=MLA``; k's 512 + 64 columns are the new latent / rope rows, written when ``save_kv_cache`` |
| MHA companion (``attn_mha``: q, k ``[T, H, 192]``, v ``[T, H, 128]``, ``save_kv_cache=False``) | ``method=MHA``, k / v over prefix + new tokens |
| ``init_cuda_graph_state(max_bs, max_num_tokens)`` | ``init_cuda_graph_state(..., graph_modes={"decode": "full"})`` |
| ``init_forward_metadata_out_graph(fb, in_capture=True)`` (decode runner, before capture) | ``init_forward_metadata_capture(bs, num_tokens, forward_mode=...)`` |
| ``init_forward_metadata_out_graph(fb)`` (before each replay; ``fb`` is the padded replay view) | ``init_forward_metadata_replay(bs, num_tokens, real batch)``: attnreg pads |
| ``get_cuda_graph_seq_len_fill_value()`` | 1 (what sglang's padded sequences carry; the bridge drops them) |

Everything outside the attnreg backend's declaration is refused before a
kernel launch with :class:`~attnreg.registry.UnsupportedError` (a
``ValueError``): at construction what the pool and model already say (page
size, KV dtype, heads), per call what a layer or batch asks for (the MHA
companion where undeclared, a speculative batch shape, sinks, soft-capping,
sliding windows, sglang's chunked-prefix MHA).  See docs/integrations/sglang.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from attnreg.registry import (
    BackendRegistry,
    DType,
    ForwardMethod,
    ForwardMode,
    GraphMode,
    Phase,
    UnsupportedError,
    get_registry,
)
from attnreg.runtime import MLAConfig, dtype_from_torch

from .batches import attnreg_mode, is_idle, to_attnreg_batch
from .kv_cache import SglangKVCache, wrap_mla_pool
from .names import BRIDGE_PREFIX

__all__ = ["AttnregAttentionBackend"]

#: Keyword arguments sglang passes to a backend's forward that the bridge maps;
#: any other keyword with a value other than None / False is refused.
_MAPPED_KWARGS = frozenset({"q_rope", "k_rope"})


class AttnregAttentionBackend(AttentionBackend):
    """One attnreg backend as an sglang attention backend (``attnreg_<name>``).

    Parameters
    ----------
    backend_name
        attnreg registry name (``triton``, ``reference``, ``flashinfer_mla`` ...).
    req_to_token_pool, token_to_kv_pool
        The model runner's pools: sglang's ``ReqToTokenPool`` and
        ``MLATokenToKVPool`` (viewed without a copy).
    num_heads
        Query heads per rank (the absorbed layer's ``tp_q_head_num``).
    sm_scale
        The layers' softmax scale (``RadixAttention.scaling``, with DeepSeek's
        YaRN factor); every forward checks its layer has it.
    q_dtype
        The activations' dtype (sglang's ``model_runner.dtype``).
    qk_nope_head_dim, v_head_dim
        The MHA companion's head dims (192 = nope + rope, 128).
    kv_scales
        Per-layer fp8 scales of this rank's layers (``layer.k_scale``; 1.0 where none).
    max_context_len
        Longest sequence (sizes graph buffers); default: ``req_to_token``'s width.
    phases
        The phases sglang runs this backend for (``--prefill-attention-backend`` /
        ``--decode-attention-backend`` may split them); default both.  Startup
        checks the declaration for these.
    registry
        Default :func:`attnreg.registry.get_registry`.

    Build it from a model runner with :meth:`from_model_runner` (what sglang's
    ``--attention-backend attnreg_<name>`` does).
    """

    # sglang fills host copies of the lengths for backends that ask: attnreg plans on them.
    needs_cpu_seq_lens = True

    def __init__(self, backend_name: str, *, req_to_token_pool: Any, token_to_kv_pool: Any,
                 num_heads: int, sm_scale: float, q_dtype: torch.dtype | str = "bf16",
                 qk_nope_head_dim: int = 128, v_head_dim: int = 128,
                 kv_scales: float | list[float] = 1.0, max_context_len: int | None = None,
                 phases: tuple[Phase, ...] = (Phase.DECODE, Phase.PREFILL),
                 registry: BackendRegistry | None = None) -> None:
        super().__init__()
        self.sglang_name = BRIDGE_PREFIX + backend_name
        self.kv_cache: SglangKVCache = wrap_mla_pool(token_to_kv_pool, scales=kv_scales)
        self.req_to_token: torch.Tensor = req_to_token_pool.req_to_token
        self.page_size = self.kv_cache.page_size
        pool = self.kv_cache.pool
        q_dt = dtype_from_torch(q_dtype) if isinstance(q_dtype, torch.dtype) \
            else DType.parse(q_dtype)
        if q_dt is None:
            raise UnsupportedError(self.sglang_name, f"activation dtype {q_dtype}",
                                   "it has no attnreg name", "serve the model in bf16 or fp16")
        self.config = MLAConfig(
            num_heads=int(num_heads), kv_lora_rank=pool.kv_lora_rank,
            qk_rope_head_dim=pool.rope_dim, qk_nope_head_dim=int(qk_nope_head_dim),
            v_head_dim=int(v_head_dim), page_size=self.page_size,
            kv_dtype=self.kv_cache.kv_dtype, q_dtype=q_dt, device=str(pool.device),
            sm_scale=float(sm_scale),
            max_context_len=int(max_context_len or self.req_to_token.shape[1]))
        self.attnreg = (registry or get_registry()).create(backend_name, self.config)
        self.phases = tuple(Phase.parse(p) for p in phases)
        self._refuse_undeclared()
        # sglang reads these off any backend (fp8 fuse checks); declared None in its base
        self.data_type = q_dtype if isinstance(q_dtype, torch.dtype) else None
        self.kv_cache_dtype = token_to_kv_pool.dtype
        #: the step's attnreg batch (eager), or None while graph metadata is bound
        self._batch: Any = None
        #: captured shapes: (forward mode, bs) -> tokens
        self._graph_tokens: dict[tuple[ForwardMode, int], int] = {}
        #: layers already checked against the config (object ids)
        self._checked_layers: set[int] = set()

    # ------------------------------------------------------------------------------
    # construction from sglang's model runner
    # ------------------------------------------------------------------------------
    @classmethod
    def from_model_runner(cls, backend_name: str, runner: Any, *,
                          registry: BackendRegistry | None = None) -> AttnregAttentionBackend:
        """What ``--attention-backend attnreg_<name>`` builds: read the runner's pools and model.

        The heads, softmax scale and fp8 scales come from the model's own
        absorbed attention layers (sglang builds the attention backend after
        loading the model), so nothing here restates a model's formula.
        """
        name = BRIDGE_PREFIX + backend_name
        if not getattr(runner, "use_mla_backend", False):
            raise UnsupportedError(name, "a model without MLA attention",
                                   "attnreg's backends run MLA models (DeepSeek-V2/V3/R1, "
                                   "Kimi-K2, ...)", "use one of sglang's own attention backends")
        from sglang.srt.runtime_context import get_parallel

        if int(get_parallel().attn_dcp_size) > 1:
            raise UnsupportedError(name, "decode context parallelism (--dcp-size > 1)",
                                   "attnreg's forwards attend the whole sequence on one rank",
                                   "drop --dcp-size or use an sglang backend that supports it")
        translator = getattr(runner, "kv_index_translator", None)
        if translator is not None and getattr(translator, "is_translating", False):
            raise UnsupportedError(name, "a unified (translating) KV pool",
                                   "req_to_token holds virtual ids there; attnreg reads "
                                   "physical slots", "use sglang's plain MLA KV pool")
        layers = _absorbed_layers(runner.model, runner.model_config)
        if not layers:
            raise UnsupportedError(name, "a model without an absorbed MLA attention layer",
                                   "found no RadixAttention with head dims "
                                   "(kv_lora_rank + rope, kv_lora_rank)", "")
        heads = {layer.tp_q_head_num for layer in layers.values()}
        scales = {float(layer.scaling) for layer in layers.values()}
        if len(heads) > 1 or len(scales) > 1:
            raise UnsupportedError(name, "layers of different shapes",
                                   f"heads {sorted(heads)}, softmax scales {sorted(scales)}",
                                   "attnreg plans one step for every layer of one shape")
        pool = runner.token_to_kv_pool
        kv_scales = [_k_scale(layers.get(pool.start_layer + i))
                     for i in range(len(pool.kv_buffer))]
        mc = runner.model_config
        return cls(backend_name, req_to_token_pool=runner.req_to_token_pool,
                   token_to_kv_pool=pool, num_heads=heads.pop(), sm_scale=scales.pop(),
                   q_dtype=runner.dtype, qk_nope_head_dim=mc.qk_nope_head_dim,
                   v_head_dim=mc.v_head_dim, kv_scales=kv_scales,
                   max_context_len=runner.req_to_token_pool.max_context_len,
                   phases=_phases_served(runner, name), registry=registry)

    def _refuse_undeclared(self) -> None:
        """Refuse at startup what the declaration does not serve for this pool and model."""
        cfg = self.config
        reasons = []
        for phase in self.phases:
            for r in self.attnreg.capabilities.check_request(
                    ForwardMethod.MLA, phase, head_dims=cfg.mla_head_dims, q_dtype=cfg.q_dtype,
                    kv_dtype=cfg.kv_dtype, page_size=cfg.page_size, num_heads=cfg.num_heads):
                reasons.append(f"{phase}: {r}")
        if reasons:
            raise UnsupportedError(self.sglang_name, "this server's KV pool and model", reasons,
                                   "change --page-size / --kv-cache-dtype to what `attnreg "
                                   "backends` declares, or choose another backend")

    # ------------------------------------------------------------------------------
    # metadata
    # ------------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Eager: convert sglang's batch and plan it once for every layer."""
        if is_idle(forward_batch):
            self._batch = None
            return
        batch = to_attnreg_batch(forward_batch, self.req_to_token, self.page_size,
                                 backend=self.sglang_name)
        self.attnreg.init_forward_metadata(batch)
        self._batch = batch

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, **_: Any) -> None:
        """sglang's decode graph runner, once: attnreg's graph buffers for FULL decode graphs
        (verify graphs included: ``max_num_tokens = max_bs x draft tokens``)."""
        self.attnreg.init_cuda_graph_state(max_bs, max_num_tokens,
                                           graph_modes={Phase.DECODE: GraphMode.FULL})
        self._graph_tokens.clear()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False
                                        ) -> None:
        """Before a capture (``in_capture``) or a replay of sglang's decode graph runner."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise UnsupportedError(self.sglang_name, "metadata preparation inside a graph",
                                   "attnreg copies each replay's batch from the host",
                                   "leave SGLANG_ENABLE_METADATA_GLUE_GRAPH off")
        mode = attnreg_mode(forward_batch.forward_mode, self.sglang_name)
        if mode is ForwardMode.EXTEND:
            raise UnsupportedError(self.sglang_name, "full prefill CUDA graphs",
                                   "attnreg captures prefill only as breakable graphs, where "
                                   "sglang runs attention eagerly",
                                   "use --cuda-graph-backend-prefill breakable or disabled")
        bs = int(forward_batch.batch_size)
        if in_capture:
            tokens = bs if mode is ForwardMode.DECODE else _num_tokens(forward_batch)
            self.attnreg.init_forward_metadata_capture(bs, tokens, forward_mode=mode)
            self._graph_tokens[(mode, bs)] = tokens
        else:
            tokens = self._graph_tokens.get((mode, bs), 0)
            if not tokens:
                raise UnsupportedError(self.sglang_name, f"replay of a {mode} graph of {bs}",
                                       f"no such graph was captured (captured: "
                                       f"{sorted((str(m), b) for m, b in self._graph_tokens)})",
                                       "")
            real = bs - int(getattr(forward_batch, "num_padding", 0) or 0)
            if _mode_name(getattr(forward_batch, "actual_forward_mode", None)) == "IDLE":
                real = 0
            # packed into the graph's own index buffer: sglang prepares one replay at a time,
            # right before it (replay_prepare, then replay), so nothing is copied at replay
            state = self.attnreg.graph_state
            batch = to_attnreg_batch(forward_batch, self.req_to_token, self.page_size,
                                     batch_size=real, forward_mode=mode,
                                     backend=self.sglang_name,
                                     layout=None if state is None else state.index_buffer)
            self.attnreg.init_forward_metadata_replay(bs, tokens, batch)
        self._batch = None  # forwards read the graph metadata just bound

    # ------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                       layer: Any, forward_batch: Any, save_kv_cache: bool = True,
                       **kwargs: Any) -> Any:
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                       layer: Any, forward_batch: Any, save_kv_cache: bool = True,
                       **kwargs: Any) -> Any:
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache, kwargs)

    def _forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                 layer: Any, forward_batch: Any, save_kv_cache: bool,
                 kwargs: dict[str, Any]) -> Any:
        heads = self.config.num_heads
        rows = q.shape[0]
        if is_idle(forward_batch):
            return q.new_empty((rows, heads * layer.v_head_dim))
        extra = sorted(key for key, value in kwargs.items()
                       if key not in _MAPPED_KWARGS and value is not None and value is not False)
        if extra:
            raise UnsupportedError(self.sglang_name, f"forward arguments {extra}",
                                   "attnreg's forwards take no attention sinks, score "
                                   "modifiers, sparse indices, fused rope or LSE requests",
                                   "use one of sglang's own attention backends for this model")
        method = self._method_of(layer)
        layer_id = self.kv_cache.layer_index(layer.layer_id)
        pool = self.kv_cache.pool
        if method is ForwardMethod.MLA:
            self._sync_scale(layer, layer_id)
            q3 = self._absorbed_q(q, kwargs.get("q_rope"), rows)
            latent = rope = None
            if save_kv_cache and k is not None:
                latent, rope = self._new_rows(k, kwargs.get("k_rope"), rows)
            out = self.attnreg.forward(q3, latent, rope, pool, self._batch, layer_id=layer_id)
            return out.view(rows, heads * self.config.kv_lora_rank)
        # the MHA companion: sglang writes the latent cache itself (save_kv_cache=False)
        if save_kv_cache:
            raise UnsupportedError(self.sglang_name, "a KV write from the MHA companion",
                                   "the MLA pool stores latent rows; MHA's k / v are "
                                   "decompressed", "call attn_mha with save_kv_cache=False")
        if getattr(forward_batch, "attn_attend_prefix_cache", False) or \
                getattr(forward_batch, "mha_return_lse", False):
            raise UnsupportedError(self.sglang_name, "sglang's chunked-prefix MHA",
                                   "sglang calls it once per prefix chunk and merges by LSE "
                                   "itself; attnreg's MHA_CHUNKED_KV runs the chunk loop",
                                   "run such batches with the absorbed MLA method")
        qk_dim, v_dim = self.config.mha_head_dims
        assert k is not None and v is not None
        out = self.attnreg.forward_extend(
            q.reshape(rows, heads, qk_dim), None, None, None, self._batch,
            method=ForwardMethod.MHA, k=k.reshape(-1, heads, qk_dim),
            v=v.reshape(-1, heads, v_dim).contiguous(), layer_id=layer_id)
        return out.view(rows, heads * v_dim)

    def _method_of(self, layer: Any) -> ForwardMethod:
        """Which attnreg method a sglang layer runs; refuses layers attnreg cannot run."""
        cfg = self.config
        dims = (int(layer.qk_head_dim), int(layer.v_head_dim))
        method = ForwardMethod.MLA if dims == cfg.mla_head_dims else ForwardMethod.MHA
        if id(layer) in self._checked_layers:
            return method
        problems = []
        if dims not in (cfg.mla_head_dims, cfg.mha_head_dims):
            problems.append(f"head dims {dims}: attnreg runs absorbed MLA "
                            f"{cfg.mla_head_dims} and its MHA companion {cfg.mha_head_dims}")
        if int(layer.tp_q_head_num) != cfg.num_heads:
            problems.append(f"{layer.tp_q_head_num} query heads, the backend was built for "
                            f"{cfg.num_heads}")
        if not math.isclose(float(layer.scaling), cfg.softmax_scale, rel_tol=1e-6):
            problems.append(f"softmax scale {layer.scaling}, the backend was built for "
                            f"{cfg.softmax_scale}")
        if float(getattr(layer, "logit_cap", 0.0) or 0.0) > 0:
            problems.append("logit soft-capping")
        if int(getattr(layer, "sliding_window_size", -1) or -1) > -1:
            problems.append("a sliding window")
        if getattr(layer, "is_cross_attention", False):
            problems.append("cross attention")
        if not 0 <= self.kv_cache.layer_index(layer.layer_id) < self.kv_cache.pool.num_layers:
            problems.append(f"layer_id {layer.layer_id} is not a layer of this rank's pool")
        if problems:
            raise UnsupportedError(self.sglang_name, f"attention layer {layer.layer_id}",
                                   problems, "use one of sglang's own attention backends")
        self._checked_layers.add(id(layer))
        return method

    def _sync_scale(self, layer: Any, layer_id: int) -> None:
        """An fp8 layer's scale is sglang's ``k_scale`` (it may be loaded after startup)."""
        if self.kv_cache.kv_dtype is not DType.FP8_E4M3:
            return
        kv = self.kv_cache.pool.layer(layer_id)
        scale = _k_scale(layer)
        if scale != kv.scale:
            kv.set_scale(scale)

    def _absorbed_q(self, q: torch.Tensor, q_rope: torch.Tensor | None, rows: int
                    ) -> torch.Tensor:
        heads, latent = self.config.num_heads, self.config.kv_lora_rank
        if q_rope is None:
            return q.reshape(rows, heads, self.config.kv_row_dim)
        # sglang's split form (q_nope absorbed, q_pe apart): attnreg takes one 576 row
        return torch.cat([q.reshape(rows, heads, latent),
                          q_rope.reshape(rows, heads, self.config.qk_rope_head_dim)], dim=-1)

    def _new_rows(self, k: torch.Tensor, k_rope: torch.Tensor | None, rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        latent = self.config.kv_lora_rank
        if k_rope is None:
            k2 = k.reshape(rows, self.config.kv_row_dim)
            return k2[:, :latent], k2[:, latent:]
        return k.reshape(rows, latent), k_rope.reshape(rows, self.config.qk_rope_head_dim)


def _mode_name(mode: Any) -> str:
    return str(getattr(mode, "name", mode))


def _num_tokens(forward_batch: Any) -> int:
    """Query tokens of a captured speculative shape (sglang sizes its static buffers so)."""
    for name in ("out_cache_loc", "input_ids", "positions"):
        t = getattr(forward_batch, name, None)
        if t is not None:
            return int(t.shape[0])
    raise UnsupportedError("sglang bridge", "captured batch without tokens",
                           "out_cache_loc, input_ids and positions are all missing", "")


def _k_scale(layer: Any) -> float:
    """sglang's fp8 KV scale of a layer (1.0 when it has none)."""
    if layer is None or getattr(layer, "k_scale", None) is None:
        return 1.0
    value = getattr(layer, "k_scale_float", None)
    return float(value) if value is not None else float(layer.k_scale)


def _phases_served(runner: Any, name: str) -> tuple[Phase, ...]:
    """The phases sglang resolved ``name`` for (both when the runner does not say)."""
    server_args = getattr(runner, "server_args", None)
    if server_args is None:
        return (Phase.DECODE, Phase.PREFILL)
    from sglang.srt.arg_groups.overrides import attention_backends_of, resolved_view

    prefill, decode = attention_backends_of(resolved_view(server_args))
    phases = tuple(p for p, b in ((Phase.DECODE, decode), (Phase.PREFILL, prefill))
                   if b == name)
    return phases or (Phase.DECODE, Phase.PREFILL)


def _absorbed_layers(model: Any, model_config: Any) -> dict[int, Any]:
    """The model's absorbed MLA attention layers by ``layer_id``."""
    from sglang.srt.layers.radix_attention import RadixAttention

    latent = int(model_config.kv_lora_rank)
    row = latent + int(model_config.qk_rope_head_dim)
    found: dict[int, Any] = {}
    for module in model.modules():
        if isinstance(module, RadixAttention) and module.qk_head_dim == row \
                and module.v_head_dim == latent:
            found.setdefault(int(module.layer_id), module)
    return found
