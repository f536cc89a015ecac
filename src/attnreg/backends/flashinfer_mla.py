"""The ``flashinfer_mla`` backend: flashinfer's paged MLA and ragged MHA prefill.

* absorbed MLA (decode and extend): ``BatchMLAPagedAttentionWrapper``
  (``fa3`` on sm90a, ``fa2`` elsewhere, or forced with ``mla_backend=``) over
  the pool's 512 latent + 64 rope columns, page sizes 1..64;
* MHA prefill (192/128, 128/128): ``BatchPrefillWithRaggedKVCacheWrapper``,
  bottom-right causal over prefix + new tokens, eager only.

flashinfer plans on the host (``plan()`` reads lengths on the CPU and uploads a
work schedule) and launches in ``run()``.  Eager batches are planned on their
first forward (once for all layers); captured graphs get one
``use_cuda_graph=True`` wrapper per captured shape, planned in
``init_forward_metadata_capture`` and again in every
``init_forward_metadata_replay`` -- never inside the captured region.

Launch grid under graphs: the MLA scheduler picks a cluster size from the
*average* packed query length (rows x heads / requests), and the grid is
frozen into the graph at capture.  A replay whose average fell on the other
side of the threshold would run the new schedule on the old grid.  So every
plan of a captured shape has the same requests and query rows:

* decode (one row per sequence, not causal): ``bs`` requests, the padding
  sequences each owning one padding row and attending no key.  flashinfer
  writes exact zeros for a request with no key (measured on the H200, fa3 and
  fa2, eager and replayed: ``scripts/probe_padding_launch.py``; the
  conformance claims that read every padding row prove it on every run), so
  nothing is zeroed after the kernel and a full replay runs the raw plan;
* every other captured mode (several causal rows per sequence): ``bs + 1``
  requests, zero-length padding sequences and one filler request that owns
  the padding rows (attending over the reserved padding page); its rows are
  zeroed inside the graph after the kernel.

The average -- and the grid -- is then the same for every replay of that
shape; a replay whose grid still differs is refused rather than run wrong.
Either way a padded replay gives zero output rows for the missing sequences.

Speculative batches (target verify, draft extend) are decode-phase batches
with several causal query tokens per request: the same MLA wrapper, planned
with ``causal=True`` and their ``qo_indptr``, eagerly or in a FULL decode graph
(one graph wrapper per captured forward mode and shape).  Chunked-prefix MHA
plans one ragged wrapper for the new tokens and one (``causal=False``) per
prefix chunk, once per batch for every layer.  LSE outputs are converted to
natural logs (the kernels work in base 2).

flashinfer 0.6 plans with positional arguments; the 0.7 wrapper takes
keywords (``metadata=MLAPlanMetadata.csr(...)``).  The form is picked from the
installed ``plan`` signature.  FP8 KV pools need ``run(..., ckv_scale=,
kpe_scale=)`` (flashinfer >= 0.7, fa3/sm90); without it FP8 is refused.
"""

from __future__ import annotations

import array
import importlib
import inspect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from attnreg.registry import (
    BackendUnavailableError,
    CaptureShape,
    ForwardMethod,
    ForwardMode,
    UnsupportedError,
)
from attnreg.registry.spec import installed_version
from attnreg.runtime import (
    PADDING_PAGE,
    AttentionBackend,
    ForwardBatch,
    ForwardMetadata,
    GraphState,
    KernelErrors,
    MLAConfig,
    MLAKVLayer,
    PrefixChunk,
    torch_dtype,
)

from .declarations.flashinfer_mla import FLOAT_WORKSPACE_BYTES, graph_index_sizes

__all__ = [
    "MLA_BACKENDS",
    "FlashInferGraphBuffers",
    "FlashInferMLABackend",
    "FlashInferMLAKernels",
    "FlashInferPlan",
    "PlannedMLA",
    "PlannedRagged",
    "import_flashinfer",
    "warm_jit_cache",
]

#: Values of the ``mla_backend`` option (flashinfer's ``backend=``).
MLA_BACKENDS = ("auto", "fa3", "fa2")
INSTALL_HINT = "install attnreg[flashinfer]"

_REFUSED_HINT = "flashinfer refused the inputs before launching"
#: flashinfer's LSEs are base 2 (``log2(sum(exp2(...)))``); attnreg's are natural logs.
_LN2 = math.log(2.0)


def import_flashinfer(backend: str) -> ModuleType:
    """Import flashinfer (with its ``mla``, ``prefill`` and ``decode`` modules).

    Raises
    ------
    BackendUnavailableError
        When it is missing or fails to import, with the install hint.
    """
    try:
        fi = importlib.import_module("flashinfer")
        for sub in ("mla", "prefill", "decode"):
            importlib.import_module(f"flashinfer.{sub}")
    except Exception as exc:  # ImportError, or a broken CUDA/JIT setup inside flashinfer
        raise BackendUnavailableError(
            backend, f"flashinfer-python could not be imported ({type(exc).__name__}: {exc}); "
            f"{INSTALL_HINT}") from exc
    return fi


def lookup(fi: ModuleType, module: str, name: str, *, owner: str = "flashinfer",
           required: bool = True) -> Any:
    """``flashinfer.<module>.<name>``, else ``flashinfer.<name>`` (None if absent and optional).

    Raises
    ------
    BackendUnavailableError
        When a required name is missing (a flashinfer older than 0.6.13).
    """
    for holder in (getattr(fi, module, None), fi):
        if holder is not None and hasattr(holder, name):
            return getattr(holder, name)
    if required:
        have = installed_version("flashinfer-python") or "unknown"
        raise BackendUnavailableError(
            owner, f"flashinfer {have} has no {module}.{name}; {INSTALL_HINT} "
            "(flashinfer-python >= 0.6.13)")
    return None


def _parameters(fn: Any) -> Sequence[str]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _host_int32(values: Iterable[int]) -> torch.Tensor:
    """A host int32 tensor of ``values``.

    Through an ``array`` (filled in C) and ``torch.frombuffer`` (no copy; the tensor
    keeps the array alive): ``torch.tensor(list)`` converts element by element, which
    is most of the cost of the plan's small CSR arrays at a few hundred sequences.
    """
    buf = array.array("i", values)
    if not buf:  # frombuffer refuses an empty buffer
        return torch.empty((0,), dtype=torch.int32)
    return torch.frombuffer(buf, dtype=torch.int32)


def _cumsum(values: Iterable[int]) -> torch.Tensor:
    """``[0, v0, v0 + v1, ...]`` as a host int32 tensor (the sum runs in C, not bytecode)."""
    return _host_int32(itertools.accumulate(map(int, values), initial=0))


@dataclass
class MLAPlanInputs:
    """What ``BatchMLAPagedAttentionWrapper.plan`` takes: host CSR arrays and device pages."""

    qo_indptr: torch.Tensor    # host int32 [n + 1]
    kv_indptr: torch.Tensor    # host int32 [n + 1], in pages
    kv_indices: torch.Tensor   # device int32 [kv_indptr[-1]]
    kv_lens: torch.Tensor      # host int32 [n], in tokens


@dataclass
class PlannedMLA:
    """A planned MLA wrapper and what it was planned for."""

    wrapper: Any
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    causal: bool
    graph: bool = False
    grid: tuple[int, int] | None = None
    #: a captured decode plan whose padding requests attend no key, for which the kernel
    #: writes zero rows itself: nothing to zero after it (module docstring)
    kernel_zeroes_padding: bool = False


@dataclass
class PlannedRagged:
    """The planned ragged-MHA wrapper and its (q dtype, k dtype, qk dim, v dim)."""

    key: tuple[torch.dtype, torch.dtype, int, int]
    wrapper: Any


@dataclass
class FlashInferPlan:
    """What flashinfer planned for one batch or captured shape (each planned on first use).

    ``chunk_new`` / ``chunks``: chunked-prefix MHA's ragged wrappers for the new
    tokens and per prefix chunk (by chunk index), planned once for every layer.
    """

    mla: PlannedMLA | None = None
    ragged: PlannedRagged | None = None
    chunk_new: PlannedRagged | None = None
    chunks: dict[int, PlannedRagged] = field(default_factory=dict)


@dataclass
class FlashInferGraphBuffers:
    """int32 index buffers every ``use_cuda_graph`` wrapper slices (sized by the declaration)."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_lens: torch.Tensor
    kv_indices: torch.Tensor


def _plan_grid(wrapper: Any) -> tuple[int, int] | None:
    """The launch grid a 0.6-style plan chose (``plan_info[0:2]``), if it is visible."""
    info = getattr(wrapper, "_plan_info", None)
    try:
        return int(info[0]), int(info[1])  # type: ignore[index]
    except (TypeError, IndexError, ValueError):
        return None


class FlashInferMLAKernels:
    """flashinfer's paged MLA and ragged MHA wrappers behind attnreg's metadata.

    Shared by :class:`FlashInferMLABackend` and the capture fallback of
    ``trtllm_mla``.  Owns one float workspace (allocated once), the eager
    wrappers and one graph wrapper per captured shape.

    Parameters
    ----------
    owner : str
        Backend name used in error messages.
    config : MLAConfig
    device : torch.device
    mla_backend : {"auto", "fa3", "fa2"}
        flashinfer's ``backend=`` for the paged MLA wrappers.
    """

    def __init__(self, owner: str, config: MLAConfig, device: torch.device, *,
                 mla_backend: str = "auto") -> None:
        if mla_backend not in MLA_BACKENDS:
            raise ValueError(f"mla_backend must be one of {MLA_BACKENDS}, got {mla_backend!r}")
        fi = import_flashinfer(owner)
        self.owner = owner
        self.config = config
        self.device = device
        self.mla_backend = mla_backend
        self.mla_wrapper_cls = lookup(fi, "mla", "BatchMLAPagedAttentionWrapper", owner=owner)
        self.ragged_wrapper_cls = lookup(fi, "prefill", "BatchPrefillWithRaggedKVCacheWrapper",
                                         owner=owner)
        self.plan_metadata_cls = lookup(fi, "mla", "MLAPlanMetadata", owner=owner,
                                        required=False)
        plan_params = _parameters(self.mla_wrapper_cls.plan)
        if "metadata" in plan_params:
            # flashinfer 0.7: keyword plans; positional ones are deprecated.
            self.plan_style = "metadata" if self.plan_metadata_cls is not None else "keywords"
        else:
            self.plan_style = "positional"
        run_params = _parameters(self.mla_wrapper_cls.run)
        self.run_takes_kv_scales = "ckv_scale" in run_params
        #: flashinfer >= 0.6.13 returns a natural-log LSE itself when asked
        self.run_lse_base_e = "return_lse_base_on_e" in run_params
        self.workspace = torch.empty(FLOAT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._eager_mla: Any = None
        self._eager_ragged: Any = None
        #: chunked-prefix MHA: the new tokens' wrapper, then one per prefix chunk
        self._chunk_wrappers: list[Any] = []
        self._graph_wrappers: dict[tuple[ForwardMode, int, int], Any] = {}

    # -- errors ------------------------------------------------------------------------
    def errors(self, what: str) -> KernelErrors:
        """flashinfer's pre-launch ``ValueError`` -> :class:`UnsupportedError` (``with`` block)."""
        return KernelErrors(self.owner, what, _REFUSED_HINT)

    # -- planning inputs ---------------------------------------------------------------
    def plan_inputs(self, seq_lens: Sequence[int], extend_lens: Sequence[int],
                    page_table: torch.Tensor, *, pad_to: tuple[int, int] | None = None,
                    one_row_padding: bool = False) -> MLAPlanInputs:
        """CSR plan inputs of a batch; ``pad_to=(bs, num_tokens)`` for a captured shape.

        Padded: ``bs - B`` zero-length sequences, then one filler request that
        owns the ``num_tokens - T`` padding query rows and attends over as many
        rows of the padding page, so every plan of the shape has ``bs + 1``
        requests and ``num_tokens`` rows (see the module docstring).  With
        ``one_row_padding`` (a decode shape: one row per sequence,
        ``num_tokens == bs``) each padding sequence owns one padding row and there
        is no filler: ``bs`` requests.
        """
        ps = self.config.page_size
        seq = list(map(int, seq_lens))
        ext = list(map(int, extend_lens))
        pages = list(seq) if ps == 1 else [-(-s // ps) for s in seq]
        indices = [self._page_indices(page_table, pages)]
        if pad_to is not None:
            bs, num_tokens = pad_to
            filler = num_tokens - sum(ext)
            if len(seq) > bs or filler < 0 or (one_row_padding and (
                    num_tokens != bs or sum(ext) != len(seq))):
                raise UnsupportedError(self.owner, "batch for this captured shape",
                                       f"{len(seq)} sequences / {sum(ext)} tokens do not fit "
                                       f"bs={bs}, num_tokens={num_tokens}",
                                       "pad it to a captured shape or run it eagerly")
            pad = bs - len(seq)
            if one_row_padding:  # each padding sequence: one row, no key, no page
                seq += [0] * pad
                ext += [1] * pad
                pages += [0] * pad
            else:  # zero-length padding sequences, then the filler over the padding page
                filler_pages = -(-filler // ps)
                seq += [0] * pad + [filler]
                ext += [0] * pad + [filler]
                pages += [0] * pad + [filler_pages]
                indices.append(torch.full((filler_pages,), PADDING_PAGE, dtype=torch.int32,
                                          device=page_table.device))
        # torch.cat of one tensor would still copy every index: only join when padded.
        return MLAPlanInputs(qo_indptr=_cumsum(ext), kv_indptr=_cumsum(pages),
                             kv_indices=indices[0] if len(indices) == 1 else torch.cat(indices),
                             kv_lens=_host_int32(seq))

    def graph_plan_inputs(self, seq_lens: Sequence[int], extend_lens: Sequence[int],
                          table: torch.Tensor, bs: int, num_tokens: int, *,
                          one_row_padding: bool = False) -> MLAPlanInputs:
        """:meth:`plan_inputs` of a captured shape ``(bs, num_tokens)``, read in place from
        the graph buffers' page table ``table`` (``md.page_table``, already filled with the
        batch and padded with the padding page), with no device op.

        flashinfer's MLA plan and kernels read ``kv_indptr[i]`` only as where request
        ``i``'s pages start in ``kv_indices`` (its length comes from ``kv_len_arr``;
        ``scheduler.cuh`` ``MLAPlan``, ``mla_hopper.cuh`` / ``mla.cuh``), so the table's
        rows serve as they are: ``kv_indptr[i] = i * width``, ``kv_indices`` the table
        itself, and the filler request's pages the padding rows after the batch's.  The
        compacted form (:meth:`plan_inputs`) built the same pages by six device ops on
        the host path of every replay.  Falls back to it when the padding rows cannot
        hold the filler's pages (a draft-extend batch of ``bs`` sequences with fewer
        tokens than captured) or the table is not one block of rows.
        ``one_row_padding``: as :meth:`plan_inputs` (padding requests of one row and no
        key, no filler).
        """
        ps = self.config.page_size
        b, width = len(seq_lens), table.shape[1]
        filler = 0 if one_row_padding else num_tokens - sum(extend_lens)
        filler_pages = -(-filler // ps)
        if (b > bs or filler < 0 or filler_pages > (bs - b) * width or table.shape[0] < bs
                or not table.is_contiguous() or max(seq_lens, default=0) > width * ps
                or (one_row_padding and (num_tokens != bs or sum(extend_lens) != b))):
            return self.plan_inputs(seq_lens, extend_lens, table, pad_to=(bs, num_tokens),
                                    one_row_padding=one_row_padding)
        pad = bs - b
        base = b * width
        # padding requests start after the batch's rows
        starts = array.array("i", range(0, base, width))
        starts.extend(itertools.repeat(base, pad + 1))
        ext = array.array("i", extend_lens)
        lens = array.array("i", seq_lens)
        if one_row_padding:  # each padding request: one row, no key, no page
            ext.extend(itertools.repeat(1, pad))
            lens.extend(itertools.repeat(0, pad))
        else:  # zero-length padding requests, then the filler over the padding rows' pages
            starts.append(base + filler_pages)
            ext.extend(itertools.repeat(0, pad))
            ext.append(filler)
            lens.extend(itertools.repeat(0, pad))
            lens.append(filler)
        return MLAPlanInputs(qo_indptr=_cumsum(ext),
                             kv_indptr=torch.frombuffer(starts, dtype=torch.int32),
                             kv_indices=table[:bs].view(-1),
                             kv_lens=torch.frombuffer(lens, dtype=torch.int32))

    def _page_indices(self, page_table: torch.Tensor, pages: Sequence[int]) -> torch.Tensor:
        """The first ``pages[b]`` entries of each page-table row, concatenated (on device).

        Everything of size ``sum(pages)`` is built by device ops: the host only
        handles one value per sequence, and sends them in one small non-blocking
        copy.  The result's size is known on the host, so nothing waits for the
        device (a boolean mask over the table would: torch must read the size of
        the result back, once per plan, i.e. before every replay).  A table whose
        rows are all used whole is returned flattened, with no copy at all.
        """
        dev = page_table.device
        counts = list(pages)
        total = sum(counts)
        if total == 0:
            return torch.empty((0,), dtype=torch.int32, device=dev)
        width = page_table.shape[1]
        if max(counts) > width:
            raise UnsupportedError(self.owner, "page table",
                                   f"a sequence needs {max(counts)} pages, the page "
                                   f"table has {width} columns",
                                   "build batches with decode_batch() / extend_batch()")
        # rows beyond the batch (a captured graph's table has max_bs rows) are not read
        flat_table = page_table[: len(counts)].reshape(-1)
        if min(counts) == width:
            # Every row used whole (the table is as wide as the longest sequence):
            # the result is the table itself, read when the kernel runs, as the
            # other backends read md.page_table.
            return flat_table.to(torch.int32)
        # Entry j of the result, in row b, is flat entry j + b * width - starts[b] of the
        # table (starts[b]: entries of the rows before b).  The per-row shift is repeated
        # counts[b] times on the device.
        starts = itertools.accumulate(counts[:-1], initial=0)
        shift = [b * width - start for b, start in enumerate(starts)]
        host = torch.tensor([shift, counts], dtype=torch.int64)
        shift_dev, counts_dev = host.to(dev, non_blocking=True)
        flat = torch.arange(total, device=dev) + torch.repeat_interleave(
            shift_dev, counts_dev, output_size=total)
        return flat_table[flat].to(torch.int32)

    # -- MLA plan ----------------------------------------------------------------------
    def _check_kv_dtype(self, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        if kv_dtype != torch.float8_e4m3fn:
            return
        reasons = []
        if not self.run_takes_kv_scales:
            have = installed_version("flashinfer-python") or "unknown"
            reasons.append(f"the installed flashinfer ({have}) has no FP8-KV MLA path "
                           "(BatchMLAPagedAttentionWrapper.run takes no ckv_scale)")
        if self.mla_backend == "fa2":
            reasons.append("flashinfer's FP8-KV MLA exists only in the fa3 kernel")
        if q_dtype != torch.bfloat16:
            reasons.append(f"FP8-KV MLA takes bf16 queries, got {q_dtype}")
        if reasons:
            raise UnsupportedError(self.owner, "FP8 KV pool", reasons,
                                   "use a bf16/fp16 pool, or flashinfer-python >= 0.7 "
                                   "with the fa3 kernel (sm90)")

    def _plan(self, wrapper: Any, inputs: MLAPlanInputs, *, causal: bool,
              q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
        cfg = self.config
        self._check_kv_dtype(q_dtype, kv_dtype)
        common: dict[str, Any] = {
            "num_heads": cfg.num_heads, "head_dim_ckv": cfg.kv_lora_rank,
            "head_dim_kpe": cfg.qk_rope_head_dim, "page_size": cfg.page_size,
            "causal": causal, "sm_scale": cfg.softmax_scale, "q_data_type": q_dtype,
            "kv_data_type": kv_dtype}
        csr = (inputs.qo_indptr, inputs.kv_indptr, inputs.kv_indices, inputs.kv_lens)
        with self.errors("MLA plan"):
            if self.plan_style == "metadata":
                wrapper.plan(metadata=self.plan_metadata_cls.csr(*csr),
                             query_layout="split", kv_cache_layout="split", **common)
            elif self.plan_style == "keywords":
                wrapper.plan(qo_indptr=csr[0], kv_indptr=csr[1], kv_indices=csr[2],
                             kv_len_arr=csr[3], **common)
            else:
                wrapper.plan(*csr, common["num_heads"], common["head_dim_ckv"],
                             common["head_dim_kpe"], common["page_size"], causal,
                             common["sm_scale"], q_dtype, kv_dtype)

    def plan_eager(self, md: ForwardMetadata[Any], plan: FlashInferPlan, *,
                   q_dtype: torch.dtype, kv_dtype: torch.dtype) -> PlannedMLA:
        """Plan the eager MLA wrapper for ``md`` (host lengths) into ``plan.mla``."""
        if md.seq_lens_cpu is None or md.extend_lens_cpu is None:
            raise UnsupportedError(self.owner, "eager MLA plan on graph metadata",
                                   "graph metadata carries no host lengths",
                                   "plan graphs with init_forward_metadata_capture / _replay")
        if self._eager_mla is None:
            self._eager_mla = self.mla_wrapper_cls(self.workspace, backend=self.mla_backend)
        causal = _causal(md)
        inputs = self.plan_inputs(md.seq_lens_cpu, md.extend_lens_cpu, md.page_table)
        self._plan(self._eager_mla, inputs, causal=causal, q_dtype=q_dtype, kv_dtype=kv_dtype)
        plan.mla = PlannedMLA(self._eager_mla, q_dtype, kv_dtype, causal)
        return plan.mla

    # -- graphs ------------------------------------------------------------------------
    def init_graph_buffers(self, shape: CaptureShape) -> FlashInferGraphBuffers:
        """Index buffers every graph wrapper slices (each replay re-plans before it runs).

        Sized by the declaration's :func:`graph_index_sizes`, the formula its
        capture memory is estimated with.
        """
        sizes = graph_index_sizes(shape)

        def ints(n: int) -> torch.Tensor:
            return torch.zeros((n,), dtype=torch.int32, device=self.device)

        self._graph_wrappers.clear()
        return FlashInferGraphBuffers(qo_indptr=ints(sizes.qo_indptr),
                                      kv_indptr=ints(sizes.kv_indptr),
                                      kv_lens=ints(sizes.kv_lens),
                                      kv_indices=ints(sizes.kv_indices))

    def plan_capture(self, md: ForwardMetadata[Any], buffers: FlashInferGraphBuffers,
                     plan: FlashInferPlan, *, q_dtype: torch.dtype,
                     kv_dtype: torch.dtype) -> PlannedMLA:
        """Create (once) and plan the ``use_cuda_graph`` wrapper of ``md``'s shape."""
        bs, nt = md.batch_size, md.num_tokens
        key = (md.forward_mode, bs, nt)
        one_row = _one_row_padding(md)
        requests = bs if one_row else bs + 1  # the filler's request, when there is one
        wrapper = self._graph_wrappers.get(key)
        if wrapper is None:
            wrapper = self.mla_wrapper_cls(
                self.workspace, use_cuda_graph=True,
                qo_indptr=buffers.qo_indptr[:requests + 1],
                kv_indptr=buffers.kv_indptr[:requests + 1], kv_indices=buffers.kv_indices,
                kv_len_arr=buffers.kv_lens[:requests], backend=self.mla_backend)
            self._graph_wrappers[key] = wrapper
        planned = PlannedMLA(wrapper, q_dtype, kv_dtype, _causal(md), graph=True,
                             kernel_zeroes_padding=one_row)
        assert md.batch is not None
        self._plan_graph(planned, md, md.batch)
        planned.grid = _plan_grid(wrapper)
        plan.mla = planned
        return planned

    def plan_replay(self, md: ForwardMetadata[Any], plan: FlashInferPlan | None,
                    batch: ForwardBatch) -> None:
        """Re-plan the captured wrapper of ``md`` for ``batch`` (outside the graph)."""
        planned = plan.mla if plan is not None else None
        if planned is None or not planned.graph:
            raise UnsupportedError(self.owner, "replay of an uncaptured shape",
                                   "no flashinfer graph wrapper was planned for it",
                                   "call init_forward_metadata_capture for this shape first")
        self._plan_graph(planned, md, batch)
        grid = _plan_grid(planned.wrapper)
        if planned.grid is not None and grid is not None and grid != planned.grid:
            raise UnsupportedError(
                self.owner, "replay with a different launch grid",
                f"the plan for this batch launches {grid} blocks, the graph was captured "
                f"with {planned.grid}", "run this batch eagerly")

    def _plan_graph(self, planned: PlannedMLA, md: ForwardMetadata[Any],
                    batch: ForwardBatch) -> None:
        # the graph buffers hold the batch (filled before this plan): read their table
        inputs = self.graph_plan_inputs(batch.seq_lens_cpu, batch.extend_lens_cpu,
                                        md.page_table, md.batch_size, md.num_tokens,
                                        one_row_padding=planned.kernel_zeroes_padding)
        self._plan(planned.wrapper, inputs, causal=planned.causal, q_dtype=planned.q_dtype,
                   kv_dtype=planned.kv_dtype)

    # -- run ---------------------------------------------------------------------------
    def run_mla(self, q: torch.Tensor, kv: torch.Tensor, md: ForwardMetadata[Any],
                plan: FlashInferPlan, out: torch.Tensor, *, kv_scale: float = 1.0,
                lse: torch.Tensor | None = None) -> None:
        """Absorbed MLA of ``q [rows, H, 576]`` over the paged cache ``kv`` into ``out``
        (and the natural-log LSE into ``lse`` when given).

        Eager: plans ``plan.mla`` on first use (once per batch for all layers).
        """
        causal = _causal(md)
        planned = plan.mla
        if planned is None or (planned.q_dtype, planned.kv_dtype, planned.causal) != \
                (q.dtype, kv.dtype, causal):
            if md.is_graph:
                what = "nothing" if planned is None else \
                    f"q {planned.q_dtype} / kv {planned.kv_dtype}"
                raise UnsupportedError(
                    self.owner, "MLA forward under a captured graph",
                    f"the graph was planned for {what}, the forward has q {q.dtype} / kv "
                    f"{kv.dtype}", "capture with the MLAConfig dtypes the forward uses")
            planned = self.plan_eager(md, plan, q_dtype=q.dtype, kv_dtype=kv.dtype)
        latent = self.config.kv_lora_rank
        extra: dict[str, Any] = {}
        if kv.dtype == torch.float8_e4m3fn:
            extra = {"ckv_scale": float(kv_scale), "kpe_scale": float(kv_scale)}
        if lse is not None:
            extra.update(lse=lse, return_lse=True)
            if self.run_lse_base_e:
                extra["return_lse_base_on_e"] = True
        with KernelErrors(self.owner, "MLA inputs", _REFUSED_HINT):
            planned.wrapper.run(q_nope=q[..., :latent], q_pe=q[..., latent:],
                                ckv_cache=kv[..., :latent], kpe_cache=kv[..., latent:],
                                out=out, **extra)
        if lse is not None and not self.run_lse_base_e:
            lse.mul_(_LN2)

    def _plan_ragged(self, wrapper: Any, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                     q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                     what: str) -> None:
        heads = q.shape[1]
        with self.errors(what):
            wrapper.plan(qo_indptr=qo_indptr, kv_indptr=kv_indptr, num_qo_heads=heads,
                         num_kv_heads=heads, head_dim_qk=q.shape[-1],
                         head_dim_vo=v.shape[-1], causal=causal,
                         sm_scale=self.config.softmax_scale, q_data_type=q.dtype,
                         kv_data_type=k.dtype)

    def _run_ragged(self, planned: PlannedRagged, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor | None,
                    what: str) -> None:
        with self.errors(what):
            if lse is None:
                planned.wrapper.run(q, k, v, out=out)
            else:
                planned.wrapper.run(q, k, v, out=out, lse=lse, return_lse=True)
        if lse is not None:
            lse.mul_(_LN2)  # the ragged kernels' LSE is base 2

    def _host_lens(self, md: ForwardMetadata[Any], what: str
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        if md.is_graph or md.seq_lens_cpu is None or md.extend_lens_cpu is None:
            raise UnsupportedError(
                self.owner, f"{what} under a captured graph",
                "flashinfer's ragged prefill is planned per batch on the host and is "
                "never captured here", "run MHA batches eagerly, or capture MLA")
        return md.seq_lens_cpu, md.extend_lens_cpu

    def run_ragged(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   md: ForwardMetadata[Any], plan: FlashInferPlan, out: torch.Tensor, *,
                   lse: torch.Tensor | None = None) -> None:
        """Eager ragged MHA (bottom-right causal over prefix + new tokens) into ``out``."""
        key = (q.dtype, k.dtype, q.shape[-1], v.shape[-1])
        planned = plan.ragged
        if planned is None or planned.key != key:
            seq_lens, extend_lens = self._host_lens(md, "ragged MHA prefill")
            if self._eager_ragged is None:
                self._eager_ragged = self.ragged_wrapper_cls(self.workspace, kv_layout="NHD")
            self._plan_ragged(self._eager_ragged, _cumsum(extend_lens), _cumsum(seq_lens),
                              q, k, v, causal=True, what="ragged MHA plan")
            planned = plan.ragged = PlannedRagged(key, self._eager_ragged)
        self._run_ragged(planned, q, k, v, out, lse, "ragged MHA inputs")

    def _chunk_wrapper(self, slot: int) -> Any:
        while len(self._chunk_wrappers) <= slot:
            self._chunk_wrappers.append(self.ragged_wrapper_cls(self.workspace,
                                                                kv_layout="NHD"))
        return self._chunk_wrappers[slot]

    def run_chunk_new(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      md: ForwardMetadata[Any], plan: FlashInferPlan, out: torch.Tensor,
                      lse: torch.Tensor) -> None:
        """Chunked-prefix MHA: the new tokens, causal, over the new tokens' own k / v."""
        key = (q.dtype, k.dtype, q.shape[-1], v.shape[-1])
        planned = plan.chunk_new
        if planned is None or planned.key != key:
            _, extend_lens = self._host_lens(md, "chunked-prefix MHA")
            indptr = _cumsum(extend_lens)
            wrapper = self._chunk_wrapper(0)
            self._plan_ragged(wrapper, indptr, indptr, q, k, v, causal=True,
                              what="chunked-prefix MHA plan (new tokens)")
            planned = plan.chunk_new = PlannedRagged(key, wrapper)
        self._run_ragged(planned, q, k, v, out, lse, "chunked-prefix MHA inputs")

    def run_prefix_chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         md: ForwardMetadata[Any], chunk: PrefixChunk, plan: FlashInferPlan,
                         out: torch.Tensor, lse: torch.Tensor) -> None:
        """Chunked-prefix MHA: the new tokens over one prefix chunk, ``causal=False``."""
        key = (q.dtype, k.dtype, q.shape[-1], v.shape[-1])
        planned = plan.chunks.get(chunk.index)
        if planned is None or planned.key != key:
            _, extend_lens = self._host_lens(md, "chunked-prefix MHA")
            wrapper = self._chunk_wrapper(1 + chunk.index)
            self._plan_ragged(wrapper, _cumsum(extend_lens), _cumsum(chunk.kv_lens_cpu), q, k,
                              v, causal=False, what=f"prefix chunk {chunk.index} plan")
            planned = plan.chunks[chunk.index] = PlannedRagged(key, wrapper)
        self._run_ragged(planned, q, k, v, out, lse, f"prefix chunk {chunk.index} inputs")


def _one_row_padding(md: ForwardMetadata[Any]) -> bool:
    """Whether a captured shape's plans pad with one-row requests that attend no key (a
    decode shape: one query row per sequence, not causal), rather than with a filler."""
    return md.is_decode and md.num_tokens == md.batch_size


def _causal(md: ForwardMetadata[Any]) -> bool:
    """Whether a forward's queries are causal among themselves: every forward mode with
    several new tokens per sequence (decode's one token sees the whole sequence)."""
    return not md.is_decode


class FlashInferMLABackend(AttentionBackend[FlashInferPlan, FlashInferGraphBuffers]):
    """flashinfer paged MLA (decode, extend) and ragged MHA prefill.

    Parameters
    ----------
    config : MLAConfig
    capabilities : Capabilities
    mla_backend : {"auto", "fa3", "fa2"}
        flashinfer's paged-MLA implementation (``auto``: fa3 on sm90a, else fa2).

    Graphs: decode FULL and prefill BREAKABLE capture absorbed MLA with one
    ``use_cuda_graph`` wrapper per captured shape, re-planned on the host before
    every replay; ragged MHA runs eagerly only.  The output rows of padding are
    zero inside the graph: a decode plan's padding requests attend no key, for which
    the kernel writes zeros; other modes zero them after the kernel.
    """

    def __init__(self, config: MLAConfig, *, capabilities: Any, mla_backend: str = "auto",
                 **kwargs: Any) -> None:
        super().__init__(config, capabilities=capabilities, **kwargs)
        self.kernels = FlashInferMLAKernels(self.name, config, self.device,
                                            mla_backend=mla_backend)

    def _graph_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return torch_dtype(self.config.q_dtype), torch_dtype(self.config.kv_dtype)

    def _init_metadata_impl(self, md: ForwardMetadata[FlashInferPlan]) -> None:
        # planned on the first forward, which knows the q / kv dtypes
        md.plan = FlashInferPlan()

    def _init_graph_state_impl(self, state: GraphState[FlashInferGraphBuffers]) -> None:
        state.buffers = self.kernels.init_graph_buffers(state.capture_shape)

    def _init_capture_impl(self, md: ForwardMetadata[FlashInferPlan]) -> None:
        q_dtype, kv_dtype = self._graph_dtypes()
        md.plan = FlashInferPlan()
        self.kernels.plan_capture(md, self._require_buffers(), md.plan, q_dtype=q_dtype,
                                  kv_dtype=kv_dtype)

    def _init_replay_impl(self, md: ForwardMetadata[FlashInferPlan],
                          batch: ForwardBatch) -> None:
        self.kernels.plan_replay(md, md.plan, batch)

    def _plan_of(self, md: ForwardMetadata[FlashInferPlan]) -> FlashInferPlan:
        if md.plan is None:
            md.plan = FlashInferPlan()
        return md.plan

    def _forward_decode_impl(self, q: torch.Tensor, pool: MLAKVLayer,
                             md: ForwardMetadata[FlashInferPlan], out: torch.Tensor, *,
                             lse: torch.Tensor | None = None) -> None:
        plan = self._plan_of(md)
        self.kernels.run_mla(q, pool.buffer, md, plan, out, kv_scale=pool.kv_scale, lse=lse)
        if plan.mla is None or not plan.mla.kernel_zeroes_padding:
            # a filler request computed the padding rows: zero them
            self.zero_padded_rows(out, md)

    def _forward_extend_impl(self, q: torch.Tensor, pool: MLAKVLayer | None,
                             md: ForwardMetadata[FlashInferPlan], out: torch.Tensor, *,
                             method: ForwardMethod, k: torch.Tensor | None,
                             v: torch.Tensor | None, lse: torch.Tensor | None = None) -> None:
        if md.num_tokens == 0:
            return
        if method is ForwardMethod.MLA:  # extend, target verify, draft extend
            assert pool is not None  # checked by the base class
            self.kernels.run_mla(q, pool.buffer, md, self._plan_of(md), out,
                                 kv_scale=pool.kv_scale, lse=lse)
            self.zero_padded_rows(out, md)
        elif method is ForwardMethod.MHA_CHUNKED_KV:
            assert k is not None and v is not None and lse is not None
            self.kernels.run_chunk_new(q, k, v, md, self._plan_of(md), out, lse)
        else:
            assert k is not None and v is not None
            self.kernels.run_ragged(q, k, v, md, self._plan_of(md), out, lse=lse)

    def _forward_prefix_chunk_impl(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   md: ForwardMetadata[FlashInferPlan], chunk: PrefixChunk,
                                   out: torch.Tensor, lse: torch.Tensor) -> None:
        self.kernels.run_prefix_chunk(q, k, v, md, chunk, self._plan_of(md), out, lse)


def warm_jit_cache(sm: int, *, dtypes: Sequence[torch.dtype] = (torch.bfloat16, torch.float16),
                   mla_kernels: Sequence[str] | None = None,
                   mha: Sequence[tuple[torch.dtype, int, int]] = (
                       (torch.bfloat16, 192, 128), (torch.float16, 192, 128),
                       (torch.bfloat16, 128, 128)),
                   ) -> dict[str, str]:
    """Compile flashinfer's JIT variants this backend uses, all at once (before serving).

    flashinfer compiles a kernel variant on the first ``plan`` that needs it
    (20 s for a paged-MLA variant, 100-135 s for a 192/128 ragged prefill on
    an H200), one after another.  This builds them in parallel threads, each
    with its own ``JitSpec.build`` -- the module's own ninja log, which the
    lazy load in ``plan`` consults later.  (``flashinfer.jit.build_jit_specs``
    keeps a separate log, so the lazy load would compile everything again.)

    Parameters
    ----------
    sm : int
        Compute capability as an int (``90``); picks ``fa3`` (sm90) or ``fa2``.
    dtypes : sequence of torch.dtype
        Query/KV dtypes of the paged-MLA variants (an FP8 pool's is not built here).
    mla_kernels : sequence of str, optional
        flashinfer MLA ``backend=`` values; default the one ``auto`` picks on
        ``sm`` (plus ``fa2`` on sm90, which ``mla_backend="fa2"`` selects).
    mha : sequence of (torch.dtype, int, int)
        (dtype, qk head dim, vo head dim) of each ragged MHA prefill variant;
        the default is the set the conformance suite checks.

    Returns
    -------
    dict
        Module name -> ``"ok"`` or the error text.  Never raises for a
        build failure: the lazy path would report it at ``plan`` anyway.
    """
    try:
        from concurrent.futures import ThreadPoolExecutor

        from flashinfer.jit.attention import gen_batch_mla_module, gen_batch_prefill_module
    except Exception as exc:  # noqa: BLE001 - missing or differently laid out flashinfer
        return {"flashinfer.jit.attention": f"not importable: {type(exc).__name__}: {exc}"}
    native = "fa3" if sm == 90 else "fa2"
    kernels = list(mla_kernels) if mla_kernels is not None else (
        ["fa3", "fa2"] if native == "fa3" else ["fa2"])
    idx = torch.int32
    specs = []
    for kernel, dt in itertools.product(kernels, dtypes):
        # Only the native kernel gets fp16: mla_backend="fa2" on sm90 is a bf16 A/B knob.
        if kernel == native or dt == torch.bfloat16:
            specs.append(gen_batch_mla_module(kernel, dt, dt, dt, idx, 512, 64, False))
    specs += [gen_batch_prefill_module(native, dt, dt, dt, idx, qk, vo, 0, False, False, False)
              for dt, qk, vo in mha]

    def build(spec: Any) -> tuple[str, str]:
        try:
            spec.build(verbose=False)
            return spec.name, "ok"
        except Exception as exc:  # noqa: BLE001 - reported, not raised (see Returns)
            return spec.name, f"{type(exc).__name__}: {str(exc)[:300]}"

    with ThreadPoolExecutor(max_workers=max(1, len(specs))) as pool:
        return dict(pool.map(build, specs))
