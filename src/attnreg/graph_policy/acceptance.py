"""Kernel acceptance: can a backend's kernels run what this model and engine need?

Selection by need starts here.  The model's facts decide which forward
methods a phase may run (decode: absorbed MLA; prefill: absorbed MLA, or the
MHA companion unless the model is DSA-sparse, whose prefill is always
absorbed), with which head dims and dtypes; the engine's facts add the page
size and the longest context.  A backend that accepts none of a phase's
methods cannot serve that phase.
"""

from __future__ import annotations

from ..registry.capabilities import METHOD_HEAD_DIMS, Capabilities, DType, ForwardMethod, Phase
from .engine import EngineFacts
from .model import AttentionKind, ModelFacts

__all__ = ["method_attempts", "model_rejections", "pinned_method_rejections"]

_NO_ENGINE = EngineFacts()


def method_attempts(model: ModelFacts,
                    phase: Phase) -> list[tuple[ForwardMethod, tuple[int, int], DType]]:
    """(method, head dims, dtype of the K/V the kernel reads) a phase may run.

    Kernels that read the paged pool (absorbed MLA, MHA decode) see the KV
    dtype; a ragged MHA prefill reads K/V materialised in the activation
    dtype.  A DSA-sparse MLA model's prefill runs absorbed MLA only (its
    indexer selects latent-cache tokens; there is no MHA companion).
    """
    if model.attention is AttentionKind.MLA:
        mla = (ForwardMethod.MLA, METHOD_HEAD_DIMS[ForwardMethod.MLA], model.kv_dtype)
        if phase is Phase.DECODE or not model.has_mha_companion:
            return [mla]
        mha_dims = METHOD_HEAD_DIMS[ForwardMethod.MHA]
        return [mla, (ForwardMethod.MHA, mha_dims, model.act_dtype),
                (ForwardMethod.MHA_CHUNKED_KV, mha_dims, model.act_dtype)]
    if phase is Phase.DECODE:
        return [(ForwardMethod.MHA, model.mha_head_dims, model.kv_dtype)]
    return [(ForwardMethod.MHA, model.mha_head_dims, model.act_dtype),
            (ForwardMethod.MHA_CHUNKED_KV, model.mha_head_dims, model.act_dtype)]


def _check(caps: Capabilities, method: ForwardMethod, phase: Phase, dims: tuple[int, int],
           kv: DType, model: ModelFacts, engine: EngineFacts) -> list[str]:
    return caps.check_request(method, phase, head_dims=dims, q_dtype=model.act_dtype,
                              kv_dtype=kv, num_heads=model.num_heads,
                              page_size=engine.page_size, max_seq_len=engine.max_context_len)


def model_rejections(caps: Capabilities, phase: Phase, model: ModelFacts,
                     engine: EngineFacts | None = None) -> list[str]:
    """Why no kernel of ``caps`` can run ``phase`` of ``model`` on this engine
    (empty = accepted)."""
    eng = engine if engine is not None else _NO_ENGINE
    reasons: list[str] = []
    tried = False
    for method, dims, kv in method_attempts(model, phase):
        if not caps.kernels_for(method, phase):
            continue
        tried = True
        found = _check(caps, method, phase, dims, kv, model, eng)
        if not found:
            return []
        reasons.extend(found)
    if not tried:
        have = ", ".join(m.value for m in caps.methods(phase)) or "none"
        needs = ", ".join(sorted({m.value for m, _, _ in method_attempts(model, phase)}))
        why = " (DSA-sparse: prefill runs absorbed MLA only)" \
            if phase is Phase.PREFILL and model.dsa_sparse else ""
        reasons.append(f"{caps.backend} has no kernel for {phase} of a {model.attention} model "
                       f"on {caps.platform}: the model needs {needs}{why}, {caps.backend} has "
                       f"{have}")
    return reasons


def pinned_method_rejections(caps: Capabilities, phase: Phase, method: ForwardMethod,
                             model: ModelFacts, engine: EngineFacts | None = None) -> list[str]:
    """Why the kernels of a pinned ``method`` cannot run ``model`` (empty = they can)."""
    eng = engine if engine is not None else _NO_ENGINE
    for m, dims, kv in method_attempts(model, phase):
        if m is method:
            return _check(caps, m, phase, dims, kv, model, eng)
    return [(f"{caps.backend} pins {method}, which a {model.attention} model does not run in "
            f"{phase}")]
