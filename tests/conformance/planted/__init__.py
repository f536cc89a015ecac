"""Planted-defect backends: test-only attnreg plugins, each the Triton backend with one
thing broken, registered through the same hook as any third-party plugin.

The conformance suite must refute each one, with a message pointing at the cause:

* ``planted_ragged_absorbed`` (a): under capture, extend goes to a ragged MHA kernel
  that asserts on absorbed (576, 576, 512) tensors, as trtllm's ragged kernel does;
* ``planted_split_assert`` (b): declares split-KV under BREAKABLE capture for an
  absorbed extend kernel that asserts with more than one split (flash_attn's qv path);
* ``planted_dispose_inputs`` (c): frees its input tensors after the KV write with a
  dispose guarded only for TC_PIECEWISE (seed 000 defect 3);
  ``planted_dispose_in_graph`` (c, GPU): frees a pre-capture scratch buffer the graph
  recorded, during real stream capture;
* ``planted_frozen_splits`` (d): decode split plan (chunk size) frozen at capture from the
  capture batch, never re-planned at replay (sglang #26019);
  ``planted_frozen_splits_wide_pages`` (d, GPU): the same, only on the split path of pages
  of 64 tokens or more (caught only by the split-KV claims' page and dtype variants);
* ``planted_int64_lengths`` (e): declares int32 index tensors but skips the dtype check,
  and its decode reads an int64 ``seq_lens`` buffer as int32;
* ``planted_pin_mismatch`` (f): declares MLA pinned under BREAKABLE but runs the MHA
  companion when asked to;
* ``planted_memory_overdeclared`` / ``planted_memory_undeclared`` /
  ``planted_padding_rows`` (g, ``capture_declared``): capture memory far from what
  is declared, either way, and padding output rows left unwritten;
  ``planted_padding_rows_wide`` (g): padding rows of non-zero values from 64 heads up only
  (refuted by the padding claim at the widest head count, on cuda or exhaustive);
* ``planted_fixed_scale`` / ``planted_heads_block8`` (k, l, ``config_facts``): the
  softmax scale fixed at 1/sqrt(192) whatever ``MLAConfig.sm_scale`` says, and
  heads beyond the first 8 given the first 8's output;
* ``planted_fp8_q_unscaled`` (m, ``fp8_q_unscaled``): over an FP8 pool, q cast to fp8
  e4m3 without a scale (|q| > 448 saturates or becomes NaN), as ``trtllm_mla`` did;
* ``planted_fp8_q_scale_ignored`` / ``planted_fp8_q_scale_kept`` (n, ``fp8_q_scale``):
  an engine's fp8 query whose ``q_scale`` is dropped, or whose first scale per layer is
  reused for every later step (``planted_fp8_q_scale_correct`` is their control).
* ``planted_kv_scale_frozen`` (s, ``kv_scale``): a captured forward's fp8 scale kept as
  the host float of its first graph forward;
* ``planted_q_rounded_undeclared`` / ``planted_q_rounding_undone`` (q, ``q_rounding``):
  q rounded to fp8 where the declaration says it is used as given, and a rounding
  declared for kernels that do not do it.

Load one with ``--attnreg-plugin planted.<module>`` (``tests/conformance`` on
``PYTHONPATH``) or ``load_registry(extra_plugins=[("planted", module)])``.
"""
