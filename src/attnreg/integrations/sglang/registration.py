"""Register attnreg's backends as sglang attention backends ``attnreg_<name>``.

:func:`register_attention_backends` is the plain function an engine (or a test)
calls; the sglang plugin (:mod:`.plugin`) calls it when ``ATTNREG_SGLANG=1``.
For each backend in attnreg's registry it adds a factory to sglang's
``ATTENTION_BACKENDS`` (``register_attention_backend``) and the name to the
``--attention-backend`` choices (``add_attention_backend_choices``).

Every registered name is registered, not only those available on this
machine: the plugin hook runs in every sglang process before CUDA is set up,
where probing the device is not wanted.  The factory checks availability
when sglang builds the backend, and an unavailable backend fails there with
attnreg's reason (``BackendUnavailableError``: "needs sm80+", "install
flashinfer" ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from attnreg.registry import BackendRegistry, get_registry

from .names import BRIDGE_PREFIX

__all__ = ["register_attention_backends", "sglang_name"]


def sglang_name(attnreg_name: str) -> str:
    """The sglang ``--attention-backend`` name of an attnreg backend (``attnreg_triton``)."""
    return BRIDGE_PREFIX + attnreg_name


def _factory(attnreg_name: str, registry: BackendRegistry | None) -> Callable[[Any], Any]:
    def create(runner: Any) -> Any:
        from .backend import AttnregAttentionBackend

        return AttnregAttentionBackend.from_model_runner(attnreg_name, runner,
                                                         registry=registry)

    create.__name__ = f"create_{sglang_name(attnreg_name)}_backend"
    create.__doc__ = f"sglang factory of attnreg's {attnreg_name!r} backend."
    return create


def register_attention_backends(names: Iterable[str] | None = None, *,
                                registry: BackendRegistry | None = None) -> list[str]:
    """Make attnreg's backends selectable with sglang's ``--attention-backend attnreg_<name>``.

    Parameters
    ----------
    names
        attnreg backend names (default: every backend of the registry).
    registry
        Default :func:`attnreg.registry.get_registry` (with entry-point plugins).

    Returns
    -------
    list of str
        The sglang names registered, e.g. ``["attnreg_reference", "attnreg_triton"]``.
    """
    from sglang.srt.arg_groups.choices import (
        ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
    )
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    reg = registry or get_registry()
    wanted = reg.names() if names is None else [str(n) for n in names]
    for name in wanted:
        reg.get(name)  # an unknown name raises with attnreg's did-you-mean message
    added = []
    for name in wanted:
        sg = sglang_name(name)
        register_attention_backend(sg)(_factory(name, registry))
        if sg not in ATTENTION_BACKEND_CHOICES:
            add_attention_backend_choices([sg])
        added.append(sg)
    return added
