"""attnreg inside vLLM: attnreg's declarations decide vLLM's CUDA-graph mode for MLA
backends, and attnreg's backends run as vLLM attention backends.

Install ``attnreg[vllm]`` and set ``ATTNREG_VLLM=1``: vLLM's plugin loader
(entry-point group ``vllm.general_plugins``) calls
:func:`attnreg.integrations.vllm.plugin.register`, which makes the
``AttentionCGSupport`` of every vLLM attention backend attnreg has a
declaration for, and the ``cudagraph_mode`` vLLM resolves from it, come from
attnreg's graph policy, and registers each attnreg backend with vLLM as
``ATTNREG_<NAME>``.  See docs/integrations/vllm.md.

Modules (:mod:`.names`, :mod:`.vocabulary`, :mod:`.plugin` and
:mod:`.registration` import without vLLM; :mod:`.batches` needs only torch):

* :mod:`.names`: vLLM's backend and KV-dtype names -> attnreg's;
* :mod:`.vocabulary`: the one table between attnreg's plan and vLLM's
  ``CUDAGraphMode`` / ``AttentionCGSupport``;
* :mod:`.facts`: a ``VllmConfig`` (and the KV-cache spec) -> :class:`~.facts.VllmFacts`;
* :mod:`.adapter`: the one call into :func:`attnreg.graph_policy.resolve`;
* :mod:`.decision`: one engine's outcome in vLLM's words, logged on ``vllm.attnreg``;
* :mod:`.hooks`: the two vLLM functions the bridge wraps;
* :mod:`.plugin`: the entry point, the switch and the release check;
* :mod:`.registration`: ``ATTNREG_<NAME>`` in vLLM's attention-backend registry;
* :mod:`.batches`: a vLLM step's decode and prefill parts as attnreg batches;
* :mod:`.backend`: the vLLM backend, metadata builder and impl classes of each
  attnreg backend (vLLM's ``MLACommonBackend`` / ``MLACommonMetadataBuilder`` /
  ``MLACommonImpl``).
"""

ENV_SWITCH = "ATTNREG_VLLM"

#: vLLM releases the bridge was tested with (``major.minor``); on any other it stands aside.
TESTED_RELEASES = ("0.33",)

__all__ = ["ENV_SWITCH", "TESTED_RELEASES"]
