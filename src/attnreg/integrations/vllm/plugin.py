"""vLLM's entry point into attnreg (group ``vllm.general_plugins``).

vLLM's ``load_general_plugins()`` calls :func:`register` in every process
(the engine's front end before it builds the ``VllmConfig``, and each
worker), subject to vLLM's ``VLLM_PLUGINS`` allowlist.  It does nothing
unless ``ATTNREG_VLLM=1``: installing ``attnreg[vllm]`` alone changes no vLLM
behaviour.  On a vLLM release the bridge was not tested with
(:data:`~attnreg.integrations.vllm.TESTED_RELEASES`) it warns and stands
aside, since it wraps vLLM internals (:mod:`.hooks`).

This module imports no vLLM (and no torch) at import time.
"""

from __future__ import annotations

import logging
import os

from . import ENV_SWITCH, TESTED_RELEASES

__all__ = ["enabled", "register", "is_tested_release"]

logger = logging.getLogger("vllm.attnreg")

_ON = ("1", "true", "yes", "on")


def enabled() -> bool:
    """Whether ``ATTNREG_VLLM`` switches the bridge on (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() in _ON


def is_tested_release(version: str) -> bool:
    """Whether vLLM ``version`` (``0.33.0``, ``0.33.1.dev3``) is a release the bridge was
    tested with.

    >>> is_tested_release("0.33.0"), is_tested_release("0.34.0")
    (True, False)
    """
    return ".".join(version.split(".")[:2]) in TESTED_RELEASES


def register() -> None:
    """vLLM plugin entry point: when switched on and on a tested release, attnreg's
    declarations decide the CUDA-graph support of the vLLM backends it declares, and
    attnreg's backends are registered with vLLM as ``ATTNREG_<NAME>``
    (:mod:`.registration`)."""
    if not enabled():
        logger.debug("attnreg vLLM plugin loaded but off (set %s=1 to switch it on)",
                     ENV_SWITCH)
        return
    import vllm

    if not is_tested_release(vllm.__version__):
        logger.warning("attnreg vLLM bridge NOT installed: vLLM %s is not a release it was "
                       "tested with (%s); vLLM's own CUDA-graph rules apply",
                       vllm.__version__, ", ".join(TESTED_RELEASES))
        return
    from . import hooks
    from .registration import register_backends

    hooks.install()
    names = register_backends()
    logger.info("attnreg decides the CUDA-graph support of vLLM's MLA backends it declares, "
                "and registered its own as %s (%s=1)", ", ".join(names), ENV_SWITCH)
