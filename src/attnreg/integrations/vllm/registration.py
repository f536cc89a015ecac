"""attnreg's backends in vLLM's attention-backend registry, as ``ATTNREG_<NAME>``.

:func:`register_backends` calls vLLM's own ``register_backend(name, class_path)``
(``vllm.v1.attention.backends.registry``) for each attnreg backend, with
the class path of its vLLM backend class in :mod:`.backend` (built on first
import by vLLM's ``resolve_obj_by_qualname``, in whichever process asks).
Only the bridge's switch (``ATTNREG_VLLM=1``, :mod:`.plugin`) calls it: with
the switch off vLLM's registry has no ``ATTNREG_*`` name.  Then
``--attention-backend ATTNREG_TRITON`` (or ``attention_config.backend``) runs
attnreg's Triton kernels inside vLLM.

This module imports vLLM only inside its functions.
"""

from __future__ import annotations

from collections.abc import Iterable

from .names import BRIDGE_PREFIX

__all__ = ["backend_class_name", "class_path", "register_backends", "registered",
           "unregister_backends", "vllm_name"]

_MODULE = "attnreg.integrations.vllm.backend"


def vllm_name(attnreg_name: str) -> str:
    """vLLM's name for attnreg backend ``attnreg_name``.

    >>> vllm_name("flashinfer_mla")
    'ATTNREG_FLASHINFER_MLA'
    """
    return BRIDGE_PREFIX + attnreg_name.upper()


def backend_class_name(attnreg_name: str) -> str:
    """The name of the vLLM backend class of ``attnreg_name`` in :mod:`.backend`.

    >>> backend_class_name("flashinfer_mla")
    'Attnreg_flashinfer_mla_Backend'
    """
    return f"Attnreg_{attnreg_name}_Backend"


def class_path(attnreg_name: str) -> str:
    """The dotted path vLLM resolves for ``ATTNREG_<NAME>``."""
    return f"{_MODULE}.{backend_class_name(attnreg_name)}"


def _names(names: Iterable[str] | None) -> list[str]:
    if names is not None:
        return list(names)
    from attnreg.registry import get_registry

    return get_registry().names()


def register_backends(names: Iterable[str] | None = None) -> list[str]:
    """Register ``ATTNREG_<NAME>`` with vLLM for each attnreg backend (default: every one
    attnreg's registry has); returns vLLM's names.  Idempotent: a name vLLM already
    has is pointed at attnreg's class again."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    done = []
    for name in _names(names):
        vname = vllm_name(name)
        member = AttentionBackendEnum.__members__.get(vname)
        register_backend(member if member is not None else vname, class_path(name))
        done.append(vname)
    return done


def registered() -> list[str]:
    """vLLM's ``ATTNREG_*`` backend names (empty when the bridge never registered any)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return sorted(n for n in AttentionBackendEnum.__members__ if n.startswith(BRIDGE_PREFIX))


def unregister_backends() -> None:
    """Remove every ``ATTNREG_*`` name from vLLM's registry (tests; a process that
    switches the bridge off again).  vLLM has no public removal, so this undoes
    what its ``AttentionBackendEnum.register`` and ``register_backend`` did."""
    from vllm.v1.attention.backends import registry as vllm_registry

    enum = vllm_registry.AttentionBackendEnum
    for name in registered():
        member = enum.__members__[name]
        vllm_registry._ATTN_OVERRIDES.pop(member, None)
        enum._member_map_.pop(name, None)
        enum._value2member_map_.pop(member.value, None)
        if name in enum._member_names_:
            enum._member_names_.remove(name)
        if name in enum.__dict__:
            delattr(enum, name)
