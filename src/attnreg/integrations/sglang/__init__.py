"""attnreg inside sglang: attnreg decides sglang's CUDA-graph modes and runs its backends.

Install ``attnreg[sglang]`` and set ``ATTNREG_SGLANG=1``: sglang's own plugin
loader (entry-point group ``sglang.srt.plugins``) finds
:func:`attnreg.integrations.sglang.plugin.register`, which replaces sglang's
graph-compatibility steps with attnreg's policy through sglang's
``HookRegistry`` and registers attnreg's backends as sglang attention
backends ``attnreg_<name>``.  See docs/integrations/sglang.md.

Modules (only :mod:`.names`, :mod:`.plugin` and :mod:`.registration` import
without sglang):

* :mod:`.names`: sglang's backend and graph-mode names <-> attnreg's;
* :mod:`.facts`: a resolving ``ServerArgs`` -> :class:`~.facts.SglangFacts`;
* :mod:`.engine_rules`: sglang rules attnreg has no fact for, kept as engine rules;
* :mod:`.adapter`: the one call into :func:`attnreg.graph_policy.resolve`;
* :mod:`.steps`: the resolution steps that replace sglang's;
* :mod:`.runtime_gate`: attnreg's replay gate in sglang's prefill runner and DP vote;
* :mod:`.plugin`: the entry point and the switch;
* :mod:`.kv_cache`: sglang's MLA KV pool as an attnreg pool, without a copy;
* :mod:`.batches`: sglang's ``ForwardBatch`` as an attnreg batch;
* :mod:`.backend`: :class:`~.backend.AttnregAttentionBackend`, sglang's interface
  over one attnreg backend;
* :mod:`.registration`: ``register_attention_backends()``, the ``attnreg_<name>`` names.
"""

ENV_SWITCH = "ATTNREG_SGLANG"

__all__ = ["ENV_SWITCH"]
