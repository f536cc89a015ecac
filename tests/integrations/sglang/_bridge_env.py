"""A tiny sglang server's attention state on the cpu, built from sglang 0.5.23's real classes.

:class:`TinyServer` holds a real ``ReqToTokenPool`` and ``MLATokenToKVPool``
(two layers), real ``RadixAttention`` layers (the absorbed ``attn_mqa`` and
the MHA companion ``attn_mha`` of each layer), and hands out requests the way
sglang's allocator does: a ``req_to_token`` row per request, pages from 1 up
(page 0 is sglang's padding page), in a shuffled order so that a paging bug
shows.  It writes the cached prefix through sglang's own ``set_kv_buffer``
(an fp8 layer's rows divided by its ``k_scale`` first, as sglang's backends
do) and builds real ``ForwardBatch`` objects for EXTEND, DECODE and
TARGET_VERIFY.  The expected outputs come from attnreg's float64 oracle
(:func:`attnreg.testing.workload.oracle_mla`) over the rows as stored.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from attnreg.registry import ForwardMode, Phase
from attnreg.testing.batches import BatchSpec

HEADS = 2
LATENT, ROPE = 512, 64
ROW = LATENT + ROPE
#: A softmax scale unlike the default 1/sqrt(192), so a kernel that ignores it is caught.
SCALE = 0.09
#: fp8 layers get different scales, so a kernel that reads another layer's is caught.
FP8_SCALES = (0.5, 0.25)
MAX_CONTEXT = 64

_PUBLISHED = False


def publish_test_config() -> None:
    """sglang's pools read the process config (``set_kv_buffer``): publish a cpu one."""
    global _PUBLISHED
    if _PUBLISHED:
        return
    from sglang.srt.runtime_context import publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path="dummy", device="cpu"), role="test")
    _PUBLISHED = True


def verify_input(num_draft: int, topk: int = 1) -> Any:
    """sglang's ``EagleVerifyInput`` for a chain of ``num_draft`` tokens (what the bridge reads:
    ``draft_token_num`` and ``topk``)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    none = torch.full((0, num_draft), -1, dtype=torch.long)
    return EagleVerifyInput(
        draft_token=torch.empty((0,), dtype=torch.long), custom_mask=None,
        positions=torch.empty((0,), dtype=torch.long), retrieve_index=none,
        retrieve_next_token=none, retrieve_next_sibling=none, retrieve_cum_len=None,
        spec_steps=num_draft - 1, topk=topk, draft_token_num=num_draft,
        capture_hidden_mode=CaptureHiddenMode.FULL, seq_lens_sum=0,
        seq_lens_cpu=torch.empty((0,), dtype=torch.int64))


@dataclass
class Step:
    """One forward step: sglang's batch, each layer's q / k, and the oracle's rows."""

    forward_batch: Any
    spec: BatchSpec
    q: list[torch.Tensor]
    k: list[torch.Tensor]
    rows: list[list[torch.Tensor]]      # per layer, per sequence: [seq_len, 576] as stored
    new_slots: torch.Tensor


@dataclass
class TinyServer:
    """Pools and layers of a two-layer MLA model on the cpu (see the module doc)."""

    page_size: int = 16
    kv_dtype: torch.dtype = torch.bfloat16
    num_layers: int = 2
    seed: int = 0
    device: str = "cpu"
    req_pool: Any = None
    kv_pool: Any = None
    mqa: list[Any] = field(default_factory=list)
    mha: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        from sglang.srt.layers.radix_attention import RadixAttention
        from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool, ReqToTokenPool

        publish_test_config()
        self.gen = torch.Generator().manual_seed(self.seed)
        self.rng = random.Random(self.seed)
        self.req_pool = ReqToTokenPool(size=8, max_context_len=MAX_CONTEXT,
                                       device=self.device, enable_memory_saver=False)
        self.kv_pool = MLATokenToKVPool(
            size=self.req_pool.size * MAX_CONTEXT, page_size=self.page_size, dtype=self.kv_dtype,
            kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, layer_num=self.num_layers,
            device=self.device, enable_memory_saver=False)
        for i in range(self.num_layers):
            mqa = RadixAttention(HEADS, ROW, SCALE, num_kv_heads=1, layer_id=i,
                                 v_head_dim=LATENT)
            if self.is_fp8:
                mqa.k_scale = torch.tensor(FP8_SCALES[i % len(FP8_SCALES)])
                mqa.k_scale_float = float(mqa.k_scale)
            self.mqa.append(mqa)
            self.mha.append(RadixAttention(HEADS, 192, SCALE, num_kv_heads=HEADS, layer_id=i,
                                           v_head_dim=128))
        self.free_pages = list(range(1, self.kv_pool.size // self.page_size + 1))
        self.rng.shuffle(self.free_pages)
        self.free_rows = list(range(1, self.req_pool.size + 1))
        self.contents: dict[int, list[list[torch.Tensor]]] = {}

    @property
    def is_fp8(self) -> bool:
        return self.kv_dtype == torch.float8_e4m3fn

    def layer_scale(self, i: int) -> float:
        return float(self.mqa[i].k_scale_float) if self.is_fp8 else 1.0

    def stored(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """What layer ``i`` reads back after storing ``x`` (float32)."""
        s = self.layer_scale(i)
        return (x.float() / s).to(self.kv_dtype).float() * s

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).bfloat16().to(self.device)

    # -- requests -----------------------------------------------------------------------
    def new_request(self, prefix: int) -> int:
        """A request row whose first ``prefix`` tokens are cached in every layer."""
        row = self.free_rows.pop(0)
        pages = [self.free_pages.pop() for _ in range(MAX_CONTEXT // self.page_size)]
        slots = torch.tensor([pages[t // self.page_size] * self.page_size + t % self.page_size
                              for t in range(MAX_CONTEXT)], dtype=torch.int32,
                             device=self.device)
        self.req_pool.req_to_token[row] = slots
        self.contents[row] = []
        for i in range(self.num_layers):
            rows = self.randn(prefix, ROW)
            self._sglang_write(i, slots[:prefix], rows)
            self.contents[row].append([self.stored(rows, i).cpu()])
        return row

    def _sglang_write(self, i: int, slots: torch.Tensor, rows: torch.Tensor) -> None:
        # sglang's backends divide an fp8 layer's rows by k_scale before set_kv_buffer
        k = rows.float() / self.layer_scale(i) if self.is_fp8 else rows
        self.kv_pool.set_kv_buffer(self.mqa[i], slots.long(), k[:, None, :], None)

    def slots(self, row: int, start: int, stop: int) -> torch.Tensor:
        return self.req_pool.req_to_token[row, start:stop].long()

    def read_back(self, i: int, slots: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s rows at ``slots`` straight from sglang's buffer (float32)."""
        raw = self.kv_pool.kv_buffer[i][slots, 0]
        if self.is_fp8:
            return raw.view(torch.float8_e4m3fn).float() * self.layer_scale(i)
        return raw.float()

    # -- steps --------------------------------------------------------------------------
    def step(self, mode: str, rows: list[int], prefix: list[int], extend: list[int]) -> Step:
        """sglang's ``ForwardBatch`` of ``mode`` for requests ``rows`` and the step's inputs."""
        from sglang.srt.model_executor import forward_batch_info as sglang_batch

        sg_mode = sglang_batch.ForwardMode[mode]
        seq = [p + e for p, e in zip(prefix, extend)]
        loc = torch.cat([self.slots(r, p, s) for r, p, s in zip(rows, prefix, seq)])
        tokens = sum(extend)
        dev = self.device
        fields: dict[str, Any] = dict(
            forward_mode=sg_mode, batch_size=len(rows),
            input_ids=torch.zeros(tokens, dtype=torch.long, device=dev),
            req_pool_indices=torch.tensor(rows, dtype=torch.long, device=dev),
            out_cache_loc=loc,
            positions=torch.cat([torch.arange(p, s) for p, s in zip(prefix, seq)]).to(dev))
        if mode == "DECODE":
            lens = seq
        elif mode == "TARGET_VERIFY":
            lens = prefix  # sglang: the committed tokens; the drafts come on top
            fields["spec_info"] = verify_input(extend[0])
        else:
            lens = seq
            fields.update(extend_prefix_lens=torch.tensor(prefix, device=dev),
                          extend_seq_lens=torch.tensor(extend, device=dev),
                          extend_prefix_lens_cpu=prefix,
                          extend_seq_lens_cpu=extend, extend_num_tokens=tokens)
        fb = sglang_batch.ForwardBatch(seq_lens=torch.tensor(lens, device=dev),
                                       seq_lens_cpu=torch.tensor(lens),
                          seq_lens_sum=sum(lens), **fields)
        q, k, stored = [], [], []
        for i in range(self.num_layers):
            q.append(self.randn(tokens, HEADS, ROW))
            k.append(self.randn(tokens, 1, ROW))
            new = self.stored(k[i][:, 0], i).cpu()
            seqs, start = [], 0
            for r, e in zip(rows, extend):
                cached = torch.cat(self.contents[r][i]) if self.contents[r][i] else \
                    torch.zeros(0, ROW)
                seqs.append(torch.cat([cached, new[start:start + e]]))
                start += e
            stored.append(seqs)
        phase = Phase.PREFILL if mode in ("EXTEND", "MIXED") else Phase.DECODE
        fmode = {"DECODE": ForwardMode.DECODE, "TARGET_VERIFY": ForwardMode.TARGET_VERIFY}.get(
            mode, ForwardMode.EXTEND)
        spec = BatchSpec(f"sglang_{mode.lower()}", phase, tuple(zip(prefix, extend)),
                         f"a hand-built sglang {mode} batch", fmode)
        return Step(fb, spec, q, k, stored, loc)

    def commit(self, step: Step, rows: list[int]) -> None:
        """The step's new tokens are now cached (as a real server keeps them)."""
        for i in range(self.num_layers):
            for b, r in enumerate(rows):
                self.contents[r][i] = [step.rows[i][b]]
