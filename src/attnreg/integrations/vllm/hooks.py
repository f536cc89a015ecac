"""The two vLLM functions the bridge wraps, and what each wrapper does.

* ``VllmConfig.__post_init__``: before vLLM fills in its defaults, record
  whether the user set ``compilation_config.cudagraph_mode`` (vLLM leaves it
  None otherwise).  The record is an attribute of the ``CompilationConfig``,
  so it travels with the config to vLLM's worker processes (pickled with it).
* ``AttentionMetadataBuilder.get_cudagraph_support`` (the base classmethod
  every MLA builder of vLLM 0.33 inherits; each states only its
  ``_cudagraph_support``): vLLM's model runner calls it per backend right
  before ``resolve_cudagraph_mode_and_sizes``.  For a backend attnreg has a
  declaration for, the wrapper returns the support the declaration states
  and sets ``cudagraph_mode`` to attnreg's plan, so vLLM's resolution
  (which runs unchanged after it) confirms the plan rather than guessing.

The wrappers keep vLLM's originals in ``__wrapped__``; :func:`uninstall`
puts them back.  This module imports vLLM.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm.config import VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.v1.attention.backend import AttentionCGSupport, AttentionMetadataBuilder
from vllm.v1.attention.backends.registry import AttentionBackendEnum

from .decision import VllmOutcome, decide

__all__ = ["backend_name_of", "install", "installed", "outcome_of", "record_lock",
           "uninstall"]

logger = logging.getLogger("vllm.attnreg")

#: On a CompilationConfig: the user's explicit cudagraph_mode name, "" when unset.
_USER_ATTR = "_attnreg_user_cudagraph_mode"
#: On a CompilationConfig: vLLM's cudagraph_mode name before the bridge first changed it.
_REQUESTED_ATTR = "_attnreg_requested_cudagraph_mode"
#: On a CompilationConfig: backend name -> the bridge's VllmOutcome.
_OUTCOME_ATTR = "_attnreg_outcomes"

_ORIGINAL_POST_INIT = VllmConfig.__post_init__
_ORIGINAL_SUPPORT = AttentionMetadataBuilder.__dict__["get_cudagraph_support"]


def record_lock(compilation_config: Any) -> None:
    """Record on ``compilation_config`` whether the user set ``cudagraph_mode``
    (call before vLLM applies its defaults).

    The first record stands: vLLM builds further ``VllmConfig`` objects around
    a config whose defaults are already filled in (``dataclasses.replace``),
    and those must not turn vLLM's default into the user's choice.
    """
    if hasattr(compilation_config, _USER_ATTR):
        return
    mode = compilation_config.cudagraph_mode
    setattr(compilation_config, _USER_ATTR, mode.name if mode is not None else "")


def _locked(compilation_config: Any) -> bool:
    user = getattr(compilation_config, _USER_ATTR, None)
    if user is None:
        # The config was built before the plugin ran: whether the mode is the user's
        # is unknown, so it is honoured as theirs (soft rules yield, hard rules hold).
        logger.warning("attnreg: cannot tell whether cudagraph_mode was set explicitly "
                       "(the config predates the plugin); treating it as explicit")
        return True
    return bool(user)


def outcome_of(vllm_config: Any, backend_name: str) -> VllmOutcome | None:
    """The bridge's outcome for ``backend_name`` on this engine (None before vLLM asked)."""
    return getattr(vllm_config.compilation_config, _OUTCOME_ATTR, {}).get(backend_name)


def backend_name_of(builder_cls: type) -> str | None:
    """vLLM's backend name for a metadata builder class: its own (attnreg's adapter
    builders carry ``vllm_backend_name``), else the one backend of the registry defined
    in the builder's module (None when none or several are)."""
    own = getattr(builder_cls, "vllm_backend_name", "")
    if own:
        return str(own)
    names = []
    for member in AttentionBackendEnum:
        try:
            path = member.get_path()
        except ValueError:  # CUSTOM before registration
            continue
        if path and path.rsplit(".", 1)[0] == builder_cls.__module__:
            names.append(member.name)
    return names[0] if len(names) == 1 else None


@functools.wraps(_ORIGINAL_POST_INIT)
def _post_init(self: Any) -> None:
    record_lock(self.compilation_config)
    _ORIGINAL_POST_INIT(self)


def _support(cls: type, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
    stated = _ORIGINAL_SUPPORT.__func__(cls, vllm_config, kv_cache_spec)
    name = backend_name_of(cls)
    if name is None:
        return stated
    cc = vllm_config.compilation_config
    if cc.cudagraph_mode is None:  # vLLM resolves NONE for it; nothing to decide
        return stated
    requested = getattr(cc, _REQUESTED_ATTR, None) or cc.cudagraph_mode.name
    outcome = decide(vllm_config, name, kv_cache_spec, requested=requested,
                     locked=_locked(cc), vllm_support=stated.name)
    setattr(cc, _REQUESTED_ATTR, requested)
    outcomes = dict(getattr(cc, _OUTCOME_ATTR, {}))
    outcomes[name] = outcome
    setattr(cc, _OUTCOME_ATTR, outcomes)
    if outcome.plan is None:
        return stated
    cc.cudagraph_mode = CUDAGraphMode[outcome.mode]
    return AttentionCGSupport[outcome.support]


_support.__wrapped__ = _ORIGINAL_SUPPORT.__func__  # type: ignore[attr-defined]


def installed() -> bool:
    """Whether the bridge's wrappers are in place."""
    return AttentionMetadataBuilder.__dict__["get_cudagraph_support"].__func__ is _support


def install() -> None:
    """Wrap vLLM's two functions (idempotent: vLLM loads plugins in every process)."""
    if installed():
        return
    VllmConfig.__post_init__ = _post_init  # type: ignore[method-assign]
    AttentionMetadataBuilder.get_cudagraph_support = classmethod(_support)  # type: ignore


def uninstall() -> None:
    """Put vLLM's originals back."""
    VllmConfig.__post_init__ = _ORIGINAL_POST_INIT  # type: ignore[method-assign]
    AttentionMetadataBuilder.get_cudagraph_support = _ORIGINAL_SUPPORT  # type: ignore
