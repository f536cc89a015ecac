"""The runtime contract an engine drives: config, KV pool, batches, typed metadata,
the backend lifecycle and the graph runner.

Between ``graph_policy`` (what to capture) and ``backends`` (the kernels):
every backend subclasses :class:`AttentionBackend`, every capture in attnreg
goes through :class:`GraphRunner`.  Importing this package imports torch.
See docs/runtime.md.

Modules: :mod:`.config` (``MLAConfig``, no torch), :mod:`.dtypes` (torch dtype
and device helpers), :mod:`.pool` (``MLAKVPool`` of N layers, ``MLAKVLayer``),
:mod:`.batch` (``ForwardBatch`` and its builders: decode, extend, verify,
draft extend), :mod:`.lse` (the log-sum-exp convention, ``merge_attention_states``),
:mod:`.metadata` (``ForwardMetadata``),
:mod:`.validation` (pure input checks), :mod:`.graph_buffers` (``GraphState``),
:mod:`.errors` (kernel-error translation), :mod:`.backend`
(``AttentionBackend``), :mod:`.graph_runner` (``GraphRunner``), :mod:`.session`
(``GraphSession``: bucket, pad, replay metadata, replay or eager) and
:mod:`.session_types` (its inputs, result and counters).
"""

from .backend import AttentionBackend
from .batch import (
    SPECULATIVE_MODES,
    ForwardBatch,
    PrefixChunk,
    decode_batch,
    draft_extend_batch,
    extend_batch,
    verify_batch,
)
from .config import MLAConfig
from .dtypes import (
    FP8_E4M3_MAX,
    device_num_sms,
    device_sm,
    dtype_from_torch,
    output_dtype,
    quantize_q_fp8,
    resolve_device,
    torch_dtype,
)
from .errors import KernelErrors
from .graph_buffers import GraphState, tensor_bytes
from .graph_runner import (
    CAPTURE_ERROR_MODES,
    CapturedGraph,
    CaptureStats,
    CudaGraphRecorder,
    EagerStep,
    GraphCaptureError,
    GraphRecorder,
    GraphRunner,
    UnreplayableBreakError,
)
from .index_buffer import IndexBuffer
from .indices import BatchIndices, IndexLayout, PackedIndices
from .lse import PrefixDecompress, merge_attention_states
from .metadata import ATTENTION_CAPTURE_MODES, DEFAULT_CAPTURE_MODE, ForwardMetadata, phase_of
from .pool import PADDING_PAGE, MLAKVLayer, MLAKVPool
from .session import GraphSession
from .session_types import (
    SYNC_EAGER,
    AgreedStep,
    BucketKey,
    SessionCounts,
    SessionError,
    SessionStep,
    StaticBuffers,
    StepInputs,
    StepResult,
    replay_batch,
)

# The stable surface (docs/api.md): changed only through a deprecation.  The other
# names imported above stay importable from here for compatibility, but are not
# promised: import them from their module if you must.
__all__ = [
    "PADDING_PAGE",
    "SPECULATIVE_MODES",
    "SYNC_EAGER",
    "AgreedStep",
    "AttentionBackend",
    "BucketKey",
    "CaptureStats",
    "CapturedGraph",
    "EagerStep",
    "ForwardBatch",
    "ForwardMetadata",
    "GraphCaptureError",
    "GraphRunner",
    "GraphSession",
    "GraphState",
    "IndexBuffer",
    "IndexLayout",
    "KernelErrors",
    "MLAConfig",
    "MLAKVLayer",
    "MLAKVPool",
    "PrefixChunk",
    "SessionCounts",
    "SessionError",
    "StepInputs",
    "StepResult",
    "UnreplayableBreakError",
    "decode_batch",
    "draft_extend_batch",
    "dtype_from_torch",
    "extend_batch",
    "merge_attention_states",
    "output_dtype",
    "quantize_q_fp8",
    "replay_batch",
    "torch_dtype",
    "verify_batch",
]
