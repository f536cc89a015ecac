"""Stand-ins for flashinfer and flash-attn-4 on a CPU machine.

They reproduce the parts of the real APIs the backends rely on -- the call
signatures (0.6.13 positional ``plan`` or the 0.7 keyword form), the buffer
copies of ``use_cuda_graph`` wrappers, the scheduler's cluster-size choice
that fixes the launch grid, the trtllm kernels' shape checks -- and compute
the attention they would compute in float32, from exactly the arguments they
were given.  So a CPU test checks the backends' argument plumbing (page
indices, padding of captured shapes, routing) against the reference backend,
and records every call.
"""

from __future__ import annotations

import math
import sys
import types
from dataclasses import dataclass, field
from typing import Any

import torch

from attnreg.backends.reference import attention_with_lse, causal_attention

NUM_SMS = 132
#: flashinfer's kernels return base-2 LSEs unless asked for natural logs
_LOG2E = 1.0 / math.log(2.0)


def _attend_lse(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 attention of ``q [E, H, D]`` over one sequence's ``keys [L, D]``, and its
    natural-log LSE ``[E, H]``."""
    return attention_with_lse(q, keys[:, None, :], values[:, None, :], scale, causal=causal)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
            causal: bool) -> torch.Tensor:
    return _attend_lse(q, keys, values, scale, causal)[0]


def _paged_rows(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    ps = cache.shape[1]
    pos = torch.arange(length)
    slots = pages.long().cpu()[pos // ps] * ps + pos % ps
    return cache.reshape(-1, cache.shape[-1])[slots.to(cache.device)].float()


@dataclass
class Calls:
    """What the fake library was asked to do."""

    mla_plans: list[dict[str, Any]] = field(default_factory=list)
    mla_runs: list[dict[str, Any]] = field(default_factory=list)
    ragged_plans: list[dict[str, Any]] = field(default_factory=list)
    ragged_runs: list[tuple[int, ...]] = field(default_factory=list)
    trtllm_decode: list[dict[str, Any]] = field(default_factory=list)
    trtllm_ragged: list[dict[str, Any]] = field(default_factory=list)
    wrappers: list[Any] = field(default_factory=list)


class _FakeMLAWrapperBase:
    calls: Calls

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
                 kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None,
                 backend: str = "auto") -> None:
        self.use_cuda_graph = use_cuda_graph
        self.backend = backend
        self._bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        self._plan_info: list[int] | None = None
        self.calls.wrappers.append(self)

    def _do_plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor, kv_len_arr: torch.Tensor, num_heads: int,
                 head_dim_ckv: int, head_dim_kpe: int, page_size: int, causal: bool,
                 sm_scale: float, q_data_type: torch.dtype, kv_data_type: torch.dtype) -> None:
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                        ("kv_indices", kv_indices), ("kv_len_arr", kv_len_arr)):
            if t.dtype != torch.int32:
                raise ValueError(f"{name} must be int32, got {t.dtype}")
        if self.use_cuda_graph:
            qo_buf, kv_buf, idx_buf, len_buf = self._bufs
            # the real wrapper copies into its fixed buffers: shapes must match exactly
            qo_buf.copy_(qo_indptr)
            kv_buf.copy_(kv_indptr)
            idx_buf[: len(kv_indices)].copy_(kv_indices)
            len_buf.copy_(kv_len_arr)
        else:
            self._indices = kv_indices.clone()
        self._host = (qo_indptr.cpu().clone(), kv_indptr.cpu().clone(), kv_len_arr.cpu().clone())
        self._causal, self._scale, self._page_size = causal, sm_scale, page_size
        self._dtypes = (q_data_type, kv_data_type)
        # flashinfer's MLAPlan: two-CTA clusters when the average packed query length
        # (rows x heads / requests) exceeds 64; the grid is (cluster, sms / cluster).
        rows = int(qo_indptr[-1])
        avg = rows * num_heads // max(1, len(kv_len_arr))
        cluster = 2 if avg > 64 else 1
        self._plan_info = [cluster, NUM_SMS // cluster]
        self.calls.mla_plans.append({
            "wrapper": self, "graph": self.use_cuda_graph, "causal": causal,
            "requests": len(kv_len_arr), "rows": rows, "kv_lens": kv_len_arr.tolist(),
            "q_dtype": q_data_type, "kv_dtype": kv_data_type, "grid": tuple(self._plan_info)})

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, return_lse: bool = False,
            return_lse_base_on_e: bool = False, **kwargs: Any) -> Any:
        if self._plan_info is None:
            raise RuntimeError("run() before plan()")
        if (q_nope.dtype, ckv_cache.dtype) != self._dtypes:
            raise ValueError(f"planned {self._dtypes}, got {(q_nope.dtype, ckv_cache.dtype)}")
        if return_lse and lse is not None and (tuple(lse.shape) != tuple(q_nope.shape[:2])
                                               or lse.dtype != torch.float32):
            raise ValueError(f"lse must be float32 {tuple(q_nope.shape[:2])}")
        if return_lse and lse is None:
            lse = torch.empty(q_nope.shape[:2], dtype=torch.float32, device=q_nope.device)
        self.calls.mla_runs.append({"wrapper": self, "rows": q_nope.shape[0],
                                    "causal": self._causal, "lse": return_lse, **kwargs})
        qo, kv, lens = self._host
        indices = self._bufs[2] if self.use_cuda_graph else self._indices
        scale = float(kwargs.get("ckv_scale") or 1.0)
        cache = torch.cat([ckv_cache.float(), kpe_cache.float()], dim=-1) * scale
        q = torch.cat([q_nope, q_pe], dim=-1)
        latent = ckv_cache.shape[-1]
        assert out is not None
        for i in range(len(lens)):
            rows = slice(int(qo[i]), int(qo[i + 1]))
            if rows.stop == rows.start:
                continue
            # as flashinfer's MLA kernels read them: kv_indptr[i] is where request i's
            # pages start, kv_len how many tokens it has (kv_indptr[i + 1] is not read)
            ps = cache.shape[1]
            pages = indices[int(kv[i]):int(kv[i]) + -(-int(lens[i]) // ps)]
            # a request with no key gets zero rows, as the real kernels write them (fa3 and
            # fa2 on the H200, scripts/probe_padding_launch.py): attention_with_lse's 0
            keys = _paged_rows(cache, pages, int(lens[i]))
            o, row_lse = _attend_lse(q[rows].float(), keys, keys[:, :latent], self._scale,
                                     self._causal)
            out[rows] = o.to(out.dtype)
            if return_lse:
                assert lse is not None
                lse[rows] = row_lse if return_lse_base_on_e else row_lse * _LOG2E
        return (out, lse) if return_lse else out


class FakeMLAWrapper06(_FakeMLAWrapperBase):
    """flashinfer 0.6.13's ``BatchMLAPagedAttentionWrapper``: positional ``plan``."""

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
             page_size: int, causal: bool, sm_scale: float, q_data_type: torch.dtype,
             kv_data_type: torch.dtype, use_profiler: bool = False) -> None:
        if kv_data_type == torch.float8_e4m3fn:
            raise AssertionError("0.6.13 has no fp8 MLA: the backend must refuse before plan")
        self._do_plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
                      head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type)


@dataclass(frozen=True)
class FakeMLAPlanMetadata:
    """flashinfer 0.7's ``MLAPlanMetadata`` (CSR form only)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_len_arr: torch.Tensor

    @classmethod
    def csr(cls, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            kv_len_arr: torch.Tensor) -> FakeMLAPlanMetadata:
        return cls(qo_indptr, kv_indptr, kv_indices, kv_len_arr)


class FakeMLAWrapper07(_FakeMLAWrapperBase):
    """flashinfer 0.7's wrapper: keyword ``plan(metadata=...)``, FP8 with kv scales."""

    def plan(self, qo_indptr: Any = None, kv_indptr: Any = None, kv_indices: Any = None,
             kv_len_arr: Any = None, num_heads: Any = None, head_dim_ckv: Any = None,
             head_dim_kpe: Any = None, page_size: Any = None, causal: Any = None,
             sm_scale: Any = None, q_data_type: Any = None, kv_data_type: Any = None,
             use_profiler: bool = False, *, metadata: FakeMLAPlanMetadata | None = None,
             query_layout: str | None = None, kv_cache_layout: str | None = None) -> None:
        if qo_indptr is not None or metadata is None:
            raise AssertionError("the backend should use the keyword metadata form on 0.7")
        if (query_layout, kv_cache_layout) != ("split", "split"):
            raise AssertionError("split q / cache views need split layouts")
        self._do_plan(metadata.qo_indptr, metadata.kv_indptr, metadata.kv_indices,
                      metadata.kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
                      causal, sm_scale, q_data_type, kv_data_type)

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, return_lse: bool = False, *,
            ckv_scale: float | None = None, kpe_scale: float | None = None,
            return_lse_base_on_e: bool = False, **kwargs: Any) -> Any:
        if (ckv_cache.dtype == torch.float8_e4m3fn) != (ckv_scale is not None):
            raise ValueError("ckv_scale goes with an FP8 cache, and only with one")
        if ckv_scale is not None:
            kwargs.update(ckv_scale=ckv_scale, kpe_scale=kpe_scale)
        return super().run(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse,
                           return_lse_base_on_e, **kwargs)


class FakeRaggedWrapper:
    """``BatchPrefillWithRaggedKVCacheWrapper``: bottom-right causal ragged MHA."""

    calls: Calls

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, **kwargs: Any) -> None:
        assert kv_layout == "NHD"

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, head_dim_vo: int | None = None, *,
             causal: bool = False, sm_scale: float | None = None,
             q_data_type: Any = "float16", kv_data_type: Any = None, **kwargs: Any) -> None:
        self._plan = (qo_indptr.cpu().clone(), kv_indptr.cpu().clone(), causal, sm_scale)
        self.calls.ragged_plans.append({"causal": causal, "head_dims": (head_dim_qk,
                                                                        head_dim_vo),
                                        "wrapper": self, "kv_lens":
                                        (kv_indptr[1:] - kv_indptr[:-1]).tolist()})

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
            out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False, **kwargs: Any) -> Any:
        qo, kv, causal, scale = self._plan
        self.calls.ragged_runs.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        assert out is not None
        if int(qo[-1]) != q.shape[0] or int(kv[-1]) != k.shape[0]:
            raise ValueError(f"planned {int(qo[-1])} queries / {int(kv[-1])} keys, got "
                             f"{q.shape[0]} / {k.shape[0]}")
        if return_lse and lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        for i in range(len(qo) - 1):
            rows, keys = slice(int(qo[i]), int(qo[i + 1])), slice(int(kv[i]), int(kv[i + 1]))
            if rows.stop > rows.start:
                o, row_lse = attention_with_lse(q[rows], k[keys], v[keys], scale,
                                                causal=causal)
                out[rows] = o.to(out.dtype)
                if return_lse:
                    assert lse is not None
                    lse[rows] = row_lse * _LOG2E  # base 2, as the real kernels
        return (out, lse) if return_lse else out


def _fake_trtllm_decode(calls: Calls) -> Any:
    def trtllm_batch_decode_with_kv_cache_mla(*, query: torch.Tensor, kv_cache: torch.Tensor,
                                              block_tables: torch.Tensor,
                                              seq_lens: torch.Tensor, out: torch.Tensor,
                                              bmm1_scale: float | torch.Tensor,
                                              bmm2_scale: float,
                                              **kwargs: Any) -> torch.Tensor:
        # 0.6.13 takes a float32 tensor bmm1_scale (trtllm-gen), anything else is refused
        if isinstance(bmm1_scale, torch.Tensor) and bmm1_scale.dtype != torch.float32:
            raise TypeError("bmm1_scale tensor must have dtype torch.float32")
        # the checks of flashinfer 0.6.13's _check_trtllm_gen_mla_shape and the dispatcher
        if query.ndim != 4:
            raise ValueError(f"Expected query.ndim == 4, got {query.ndim}")
        ps = kv_cache.shape[-2]
        if block_tables.shape[0] != query.shape[0]:
            raise ValueError(f"Expected batch size {query.shape[0]} for query and "
                             f"block_table, got {block_tables.shape[0]}")
        if block_tables.shape[-1] % (128 // ps):
            raise ValueError(f"Expected block_num % (128 / block_size) == 0, got "
                             f"{block_tables.shape[-1]=} and {ps=}")
        if out.dtype != torch.bfloat16 or tuple(out.shape) != tuple(query.shape[:-1]) + (512,):
            raise ValueError(f"out must be bf16 {tuple(query.shape[:-1]) + (512,)}, got "
                             f"{out.dtype} {tuple(out.shape)}")
        calls.trtllm_decode.append({"query": tuple(query.shape), "dtype": query.dtype,
                                    "tables": tuple(block_tables.shape),
                                    "seq_lens": [int(n) for n in seq_lens],
                                    "bmm1_scale": bmm1_scale, **kwargs})
        scale = float(bmm1_scale.reshape(-1)[0]) if isinstance(bmm1_scale, torch.Tensor) \
            else bmm1_scale
        cache = kv_cache.float() * bmm2_scale
        for b in range(query.shape[0]):
            keys = _paged_rows(cache, block_tables[b], int(seq_lens[b]))
            # [q_len, H, 576]: token i of q_len sees keys 0 .. seq_len - q_len + i (the
            # causal bound the kernel takes from seq_lens; flashinfer's test checks it
            # against its paged MLA planned causal)
            o = _attend(query[b].float(), keys, keys[:, :512], scale / bmm2_scale, True)
            out[b] = o.to(out.dtype)
        return out

    return trtllm_batch_decode_with_kv_cache_mla


def _fake_trtllm_ragged(calls: Calls) -> Any:
    def trtllm_ragged_attention_deepseek(*, query: torch.Tensor, key: torch.Tensor,
                                         value: torch.Tensor, cum_seq_lens_q: torch.Tensor,
                                         cum_seq_lens_kv: torch.Tensor, bmm1_scale: float,
                                         is_causal: bool, out: torch.Tensor,
                                         **kwargs: Any) -> torch.Tensor:
        dims = (query.shape[2], key.shape[2], value.shape[2])
        # the real function asserts exactly this
        assert dims in ((192, 192, 128), (128, 128, 128), (256, 256, 256)), (
            f"Unsupported head dimensions: query={dims[0]}, key={dims[1]}, value={dims[2]}")
        calls.trtllm_ragged.append({"dims": dims, "is_causal": is_causal, **kwargs})
        qo, kv = cum_seq_lens_q.cpu(), cum_seq_lens_kv.cpu()
        for i in range(len(qo) - 1):
            rows, keys = slice(int(qo[i]), int(qo[i + 1])), slice(int(kv[i]), int(kv[i + 1]))
            out[rows] = causal_attention(query[rows], key[keys], value[keys],
                                         bmm1_scale).to(out.dtype)
        return out

    return trtllm_ragged_attention_deepseek


def install_fake_flashinfer(monkeypatch: Any, *, version: str = "0.6") -> Calls:
    """Put a fake ``flashinfer`` into ``sys.modules``; return its call log.

    ``version="0.6"``: positional plan, no FP8 MLA; ``"0.7"``: keyword plan with
    ``MLAPlanMetadata`` and ``run(..., ckv_scale=, kpe_scale=)``.
    """
    calls = Calls()
    base = FakeMLAWrapper07 if version == "0.7" else FakeMLAWrapper06
    mla_cls = type("BatchMLAPagedAttentionWrapper", (base,), {"calls": calls})
    ragged_cls = type("BatchPrefillWithRaggedKVCacheWrapper", (FakeRaggedWrapper,),
                      {"calls": calls})
    fi = types.ModuleType("flashinfer")
    mla = types.ModuleType("flashinfer.mla")
    prefill = types.ModuleType("flashinfer.prefill")
    decode = types.ModuleType("flashinfer.decode")
    mla.BatchMLAPagedAttentionWrapper = mla_cls  # type: ignore[attr-defined]
    if version == "0.7":
        mla.MLAPlanMetadata = FakeMLAPlanMetadata  # type: ignore[attr-defined]
    prefill.BatchPrefillWithRaggedKVCacheWrapper = ragged_cls  # type: ignore[attr-defined]
    prefill.trtllm_ragged_attention_deepseek = _fake_trtllm_ragged(calls)  # type: ignore
    decode.trtllm_batch_decode_with_kv_cache_mla = _fake_trtllm_decode(calls)  # type: ignore
    fi.mla, fi.prefill, fi.decode = mla, prefill, decode  # type: ignore[attr-defined]
    for name, module in (("flashinfer", fi), ("flashinfer.mla", mla),
                         ("flashinfer.prefill", prefill), ("flashinfer.decode", decode)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def install_fake_flash_attn_cute(monkeypatch: Any) -> list[dict[str, Any]]:
    """Put a fake ``flash_attn.cute`` into ``sys.modules``; return its call log."""
    calls: list[dict[str, Any]] = []

    def flash_attn_varlen_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               qv: torch.Tensor | None = None, *,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: Any = None,
                               seqused_k: Any = None, page_table: Any = None,
                               softmax_scale: float, causal: bool, num_splits: int = 1,
                               **kwargs: Any) -> tuple[torch.Tensor, None]:
        calls.append({"qv": qv is not None, "num_splits": num_splits, "causal": causal,
                      "dims": (q.shape[-1], v.shape[-1]), **kwargs})
        cu_q = cu_seqlens_q.cpu()
        if qv is None:
            out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype)
            cu_k = cu_seqlens_k.cpu()
            for i in range(len(cu_q) - 1):
                rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
                keys = slice(int(cu_k[i]), int(cu_k[i + 1]))
                out[rows] = causal_attention(q[rows], k[keys], v[keys],
                                             softmax_scale).to(q.dtype)
            return out, None
        assert page_table is not None and cu_seqlens_k is None
        out = torch.zeros(qv.shape[0], qv.shape[1], v.shape[-1], dtype=qv.dtype)
        cache = torch.cat([v.squeeze(2), k.squeeze(2)], dim=-1)  # latent then rope
        full_q = torch.cat([qv, q], dim=-1)
        latent = v.shape[-1]
        for i in range(len(cu_q) - 1):
            rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
            keys = _paged_rows(cache, page_table[i], int(seqused_k[i]))
            out[rows] = _attend(full_q[rows].float(), keys, keys[:, :latent], softmax_scale,
                                causal).to(qv.dtype)
        return out, None

    flash_attn = types.ModuleType("flash_attn")
    cute = types.ModuleType("flash_attn.cute")
    cute.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    flash_attn.cute = cute  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", cute)
    return calls
