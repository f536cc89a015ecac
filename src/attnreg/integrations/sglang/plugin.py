"""sglang's entry point into attnreg (group ``sglang.srt.plugins``).

sglang's ``load_plugins()`` imports this module and calls :func:`register`
in every process (subject to sglang's ``SGLANG_PLUGINS`` allowlist).  It
does nothing unless ``ATTNREG_SGLANG=1``: installing ``attnreg[sglang]``
alone changes no sglang behaviour.  Switched on, it registers two REPLACE
hooks with sglang's ``HookRegistry`` (applied by ``load_plugins()`` right
after every plugin ran):

* ``apply_cuda_graph_compatibility`` -> :func:`.steps.early_step`;
* ``disable_prefill_cuda_graph_for_deepseek_trtllm_mla`` -> :func:`.steps.policy_step`;

and the runtime half (:mod:`.runtime_gate`): an AROUND hook on
``PrefillCudaGraphRunner.can_replay_locally`` and on the data-parallel vote,
and AFTER hooks that carry attnreg's sync row in ``MLPSyncBatchInfo``.
Outside the tested sglang range (:data:`TESTED_SGLANG`) it warns and stands
aside entirely.

It also registers every attnreg backend as an sglang attention backend
``attnreg_<name>`` (:func:`.registration.register_attention_backends`), so
``--attention-backend attnreg_triton`` runs attnreg's kernels.  The two halves
are independent: a release without the hook points still gets the backends.

This module imports no sglang (and no torch) at import time.
"""

from __future__ import annotations

import logging
import os

from . import ENV_SWITCH

__all__ = ["HOOK_TARGETS", "TESTED_SGLANG", "enabled", "register", "sglang_version_problem"]

logger = logging.getLogger("attnreg.integrations.sglang")

_MODULE = "sglang.srt.arg_groups.cuda_graph_hook"

#: sglang function (dotted path) -> the bridge step that replaces it.
HOOK_TARGETS: dict[str, str] = {
    f"{_MODULE}.apply_cuda_graph_compatibility": "early_step",
    f"{_MODULE}.disable_prefill_cuda_graph_for_deepseek_trtllm_mla": "policy_step",
}

_ON = ("1", "true", "yes", "on")

#: The sglang releases the bridge is tested with (pyproject's ``sglang`` extra says the
#: same): it hooks private functions and methods of exactly these.
TESTED_SGLANG = ((0, 5, 23), (0, 5, 24))


def sglang_version_problem(version: str | None = None) -> str | None:
    """Why this sglang is outside the tested range (None when it is inside).

    ``version`` defaults to the installed distribution's.
    """
    if version is None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        try:
            version = dist_version("sglang")
        except PackageNotFoundError:
            return "sglang is not installed as a distribution (no version to check)"
    from packaging.version import InvalidVersion, Version  # a dependency of sglang

    low, high = TESTED_SGLANG
    try:
        parsed = Version(version)
    except InvalidVersion:
        return f"sglang's version {version!r} cannot be parsed, so it cannot be checked"
    if Version(".".join(map(str, low))) <= parsed < Version(".".join(map(str, high))):
        return None
    return (f"sglang {version} is outside the range the bridge is tested with "
            f"(>={'.'.join(map(str, low))},<{'.'.join(map(str, high))}); it hooks private "
            "functions of that release, so it stands aside")


def enabled() -> bool:
    """Whether ``ATTNREG_SGLANG`` switches the bridge on (``1``, ``true``, ``yes``, ``on``)."""
    return os.environ.get(ENV_SWITCH, "").strip().lower() in _ON


def register() -> None:
    """sglang plugin entry point: when switched on, install attnreg's graph policy and
    register attnreg's backends as sglang attention backends."""
    if not enabled():
        logger.debug("attnreg sglang plugin loaded but off (set %s=1 to switch it on)",
                     ENV_SWITCH)
        return
    problem = sglang_version_problem()
    if problem is not None:
        # Standing aside is not a wrong answer: sglang's own rules decide, whole.
        logger.warning("attnreg sglang bridge NOT installed: %s; sglang's own graph rules "
                       "apply and no attnreg_<name> backend is registered", problem)
        return
    _install_policy()
    _register_backends()


def _register_backends() -> None:
    try:
        from .registration import register_attention_backends

        names = register_attention_backends()
    except ImportError as exc:
        # A release that moved the attention registry: the policy half still works.
        logger.warning("attnreg attention backends NOT registered with sglang (%s); "
                       "the bridge is tested with sglang 0.5.23", exc)
        return
    logger.info("attnreg backends selectable with --attention-backend: %s", ", ".join(names))


def _install_policy() -> None:
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    missing = []
    for target in HOOK_TARGETS:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError):
            missing.append(target)
    if missing:
        # A release that moved these steps: replacing one without the other would
        # leave half of sglang's rules in force, so replace neither and say so.
        logger.warning("attnreg sglang bridge NOT installed: this sglang has no %s "
                       "(the bridge is tested with sglang 0.5.23); sglang's own graph rules "
                       "apply", ", ".join(missing))
        return

    from . import runtime_gate, steps

    runtime_missing = []
    for target in runtime_gate.HOOKS:
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError):
            runtime_missing.append(target)
    if runtime_missing:
        # The startup half without the runtime half would let sglang's per-batch
        # rules contradict attnreg's plan; replace neither.
        logger.warning("attnreg sglang bridge NOT installed: this sglang has no %s "
                       "(the bridge is tested with sglang 0.5.23); sglang's own graph rules "
                       "apply", ", ".join(runtime_missing))
        return
    for target, step in HOOK_TARGETS.items():
        HookRegistry.register(target, getattr(steps, step), HookType.REPLACE)
    for target, (kind, hook) in runtime_gate.HOOKS.items():
        HookRegistry.register(target, hook, HookType[kind])
    logger.info("attnreg decides sglang's CUDA-graph modes (%s=1): %s; and its prefill "
                "replay: %s", ENV_SWITCH, ", ".join(t.rsplit(".", 1)[1] for t in HOOK_TARGETS),
                ", ".join(t.split(".", 6)[-1] for t in runtime_gate.HOOKS))
