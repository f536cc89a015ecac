"""One tiny vLLM 0.33 engine on CPU for attnreg's backends behind vLLM's MLA interface.

Real vLLM: the backend class vLLM's registry resolves for ``ATTNREG_<NAME>``
(``AttentionBackendEnum[...].get_class()``); vLLM's ``MLAAttention`` layer
built with it (its constructor builds the impl, registers the layer in
``static_forward_context``, sets up ``_k_scale``; ``process_weights_after_loading``
splits ``kv_b_proj`` into ``W_UK`` / ``W_UV``; ``forward_impl`` splits the
step, absorbs ``W_UK``, calls ``forward_mqa`` / ``forward_mha`` and applies
``W_UV``); the metadata builder and impl (subclasses of vLLM's
``MLACommonMetadataBuilder`` / ``MLACommonImpl``, whose constructors and
``build`` run as they are); ``CacheConfig``, ``ParallelConfig``,
``SchedulerConfig``, ``AttentionConfig``, ``CompilationConfig``,
``KernelConfig``, ``MLAAttentionSpec``, ``CommonAttentionMetadata`` and vLLM's
CPU MLA prefill backend (``CPUSDPAMLAPrefillBackend``, which the layer builds
and the base builder clones and prepares).

Stood in, because they cannot be built on this machine or need a whole model:

* the model config (a real ``ModelConfig`` / ``VllmConfig`` cannot infer a
  device here; as in :mod:`._vllm_env`): the fields the builder reads;
* ``compilation_config.custom_ops`` is ``["none"]`` (what ``VllmConfig.__post_init__``
  fills in, which does not run on the stand-in config);
* ``kv_b_proj``: a bias-free linear returning ``(out, None)`` as vLLM's
  ``ColumnParallelLinear`` does (the real one needs tensor-parallel groups);
* the layer's cache write (``MLAAttention.forward`` calls vLLM's
  ``concat_and_cache_mla``, a custom op not built for CPU, so the tests call
  ``forward_impl``, the part after the write): rows go to
  ``cache.view(-1, 576)[slot_mapping]``, the layout that op writes;
* every vLLM module's ``PIN_MEMORY`` is False during ``build`` (what vLLM's CPU platform
  reports; without a platform plugin vLLM's ``UnspecifiedPlatform`` says True here,
  and a pinned host tensor then fails without an accelerator).
"""

from __future__ import annotations

import contextlib
import math
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    KernelConfig,
    ParallelConfig,
    SchedulerConfig,
    set_current_vllm_config,
)
from vllm.model_executor.layers.attention.mla_attention import MLAAttention
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from attnreg.integrations.vllm.registration import register_backends, vllm_name

HEADS, LATENT, ROPE, NOPE, VDIM = 2, 512, 64, 128, 128
ROW = LATENT + ROPE
SCALE = 1.0 / math.sqrt(NOPE + ROPE)
BLOCK = 16
LAYER = "model.layers.0.self_attn.attn"
BF16 = torch.bfloat16


class KVBProj(torch.nn.Module):
    """``kv_b_proj`` of one layer: latent ``[n, 512]`` -> ``[n, H * (nope + v)]``, returned
    as ``(out, None)`` like vLLM's ``ColumnParallelLinear``."""

    #: unquantised (what vLLM's ``get_and_maybe_dequant_weights`` asks)
    quant_method = None

    def __init__(self, gen: torch.Generator) -> None:
        super().__init__()
        weight = torch.randn(HEADS * (NOPE + VDIM), LATENT, generator=gen) / math.sqrt(LATENT)
        self.weight = torch.nn.Parameter(weight.to(BF16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(x, self.weight), None


@dataclass
class Step:
    """One vLLM step: requests in vLLM's order (decodes first), their rows, the metadata.

    ``written``: per request the ``[seq_len, 576]`` bf16 rows the model computed (the new
    tokens' are what the layer hands ``forward_mha``); ``rows``: the same as the cache
    reads them back (float32; dequantised with the layer's scale for an fp8 cache).
    """

    context: list[int]
    query: list[int]
    written: list[torch.Tensor]
    rows: list[torch.Tensor]
    common: CommonAttentionMetadata

    @property
    def num_tokens(self) -> int:
        return sum(self.query)


class TinyEngine:
    """vLLM's builder and impl of ``ATTNREG_<NAME>`` for one MLA layer, and its cache."""

    def __init__(self, name: str, *, draft: int = 0, num_blocks: int = 16,
                 kv: str = "auto", k_scale: float = 1.0, seed: int = 0) -> None:
        register_backends([name])
        self.backend_name = name
        self.backend_cls = AttentionBackendEnum[vllm_name(name)].get_class()
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        model = SimpleNamespace(
            dtype=BF16, max_model_len=512, use_mla=True, is_multimodal_model=False,
            hf_text_config=SimpleNamespace(model_type="deepseek_v3"),
            get_num_attention_heads=lambda parallel_config: HEADS,
            get_head_size=lambda: ROW)
        spec_config = (SimpleNamespace(num_speculative_tokens=draft, parallel_drafting=False,
                                       method="mtp") if draft else None)
        self.vllm_config = SimpleNamespace(
            model_config=model, cache_config=CacheConfig(block_size=BLOCK, cache_dtype=kv),
            parallel_config=ParallelConfig(),
            scheduler_config=SchedulerConfig(max_model_len=512, is_encoder_decoder=False),
            attention_config=AttentionConfig(),
            compilation_config=CompilationConfig(custom_ops=["none"]),
            kernel_config=KernelConfig(), speculative_config=spec_config,
            use_v2_model_runner=False)
        self.kv_b_proj = KVBProj(self.gen)
        self.fp8 = kv == "fp8"
        self.k_scale = k_scale
        # vLLM keeps an fp8 cache as uint8 storage; its layer views it as float8_e4m3fn
        # before it calls the impl (MLAAttention.forward_impl)
        kv_spec = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=ROW,
                                   dtype=torch.uint8 if self.fp8 else BF16)
        with set_current_vllm_config(self.vllm_config):
            self.layer = MLAAttention(
                num_heads=HEADS, scale=SCALE, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                v_head_dim=VDIM, q_lora_rank=None, kv_lora_rank=LATENT,
                kv_b_proj=self.kv_b_proj, cache_config=self.vllm_config.cache_config,
                prefix=LAYER, attn_backend=self.backend_cls,
                prefill_backend_cls=CPUSDPAMLAPrefillBackend)
            self.layer.process_weights_after_loading(BF16)
            # what a checkpoint's k_scale sets (vLLM loads weights before the cache)
            self.layer._k_scale.fill_(k_scale)
            self.layer._k_scale_float = k_scale
            self.impl = self.layer.impl
            self.builder = self.backend_cls.get_builder_cls()(
                kv_spec, [LAYER], self.vllm_config, torch.device("cpu"))
        #: vLLM's cache of this layer: [num_blocks, block_size, 576]; block 0 is vLLM's
        #: null block, never a request's
        self.kv_cache = torch.zeros(num_blocks, BLOCK, ROW,
                                    dtype=torch.float8_e4m3fn if self.fp8 else BF16)
        self._free = list(range(1, num_blocks))
        self.rng.shuffle(self._free)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(BF16)

    def step(self, context: list[int], query: list[int]) -> Step:
        """A step of requests with ``context`` cached and ``query`` new tokens each; every
        row (cached and new) is written to the cache first, as the layer would."""
        seq = [c + q for c, q in zip(context, query)]
        width = max(-(-n // BLOCK) for n in seq)
        table = torch.zeros(len(seq), width, dtype=torch.int32)
        written, rows, slots = [], [], []
        cache = self.kv_cache.view(-1, ROW)
        for i, (n, c) in enumerate(zip(seq, context)):
            blocks = [self._free.pop() for _ in range(-(-n // BLOCK))]
            table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            seq_slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(n)])
            r = self.randn(n, ROW)
            # concat_and_cache_mla's layout: one row per slot; fp8 stores value / k_scale
            cache[seq_slots] = (r.float() / self.k_scale).to(cache.dtype) if self.fp8 else r
            stored = cache[seq_slots].float()
            written.append(r)
            rows.append(stored * self.k_scale if self.fp8 else stored)
            slots.append(seq_slots[c:])
        qsl = torch.tensor([0] + [sum(query[:i + 1]) for i in range(len(query))],
                           dtype=torch.int32)
        seq_t = torch.tensor(seq, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_t,
            num_reqs=len(seq), num_actual_tokens=sum(query), max_query_len=max(query),
            max_seq_len=max(seq), block_table_tensor=table,
            slot_mapping=torch.cat(slots).to(torch.int64),
            seq_lens_cpu_upper_bound=seq_t.clone())
        return Step(list(context), list(query), written, rows, common)

    def build(self, step: Step) -> Any:
        with set_current_vllm_config(self.vllm_config), _no_pinned_memory():
            return self.builder.build(0, step.common)


@contextlib.contextmanager
def _no_pinned_memory() -> Iterator[None]:
    """vLLM's modules read ``PIN_MEMORY`` from the platform at import: False, as vLLM's
    CPU platform says, for the duration."""
    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if name.startswith("vllm") and getattr(module, "PIN_MEMORY", None) is True:
                stack.enter_context(mock.patch.object(module, "PIN_MEMORY", False))
        yield
