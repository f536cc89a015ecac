"""One plugin, one backend per declaration mistake a plugin author can make.

Each backend reuses the built-in reference declaration and changes one thing,
so every error the registry reports here has exactly one cause.
"""

import dataclasses

import attnreg
from attnreg import (
    CaptureSupport,
    Cost,
    ForwardMethod,
    GraphMode,
    GraphModeSupport,
    Phase,
    Requirement,
    Vendor,
)
from attnreg.backends.declarations import reference

RUNTIME = "attnreg.backends.reference:ReferenceBackend"


def _like_reference(ctx, name, **changes):
    return dataclasses.replace(reference.capabilities(ctx), backend=name, **changes)


def rocm_arch_bug(ctx):
    # A real-looking bug: parsing the arch as "smNN" breaks on gfx942 only.
    sm = int(ctx.platform.arch.removeprefix("sm") or 0)
    return _like_reference(ctx, "rocm_arch_bug", priority=min(sm, 0))


def npu_page_bug(ctx):
    caps = _like_reference(ctx, "npu_page_bug")
    if ctx.platform.vendor is not Vendor.NPU:
        return caps
    odd = dataclasses.replace(caps.kernels[0], page_sizes=(3,))
    return dataclasses.replace(caps, kernels=(odd,) + caps.kernels[1:])


def _with_prefill_breakable(caps, support, pinned=None):
    modes = tuple(g for g in caps.graph_modes
                  if (g.phase, g.mode) != (Phase.PREFILL, GraphMode.BREAKABLE))
    return dataclasses.replace(caps, graph_modes=modes + (
        GraphModeSupport(Phase.PREFILL, GraphMode.BREAKABLE, support, pinned_method=pinned),))


def fallback_ghost(ctx):
    return _with_prefill_breakable(
        _like_reference(ctx, "fallback_ghost"),
        CaptureSupport.fallback("flashinfer_mlaa", Cost.LOW, "its ragged kernel cannot capture"))


def fallback_chain(ctx):
    # trtllm_mla itself falls back under breakable on Blackwell: a chain.
    return _with_prefill_breakable(
        _like_reference(ctx, "fallback_chain"),
        CaptureSupport.fallback("trtllm_mla", Cost.LOW, "its ragged kernel cannot capture"))


def fallback_pins_mha(ctx):
    caps = _like_reference(ctx, "fallback_pins_mha")
    mla_only = tuple(k for k in caps.kernels if k.method is ForwardMethod.MLA)
    return _with_prefill_breakable(
        dataclasses.replace(caps, kernels=mla_only),
        CaptureSupport.fallback("flashinfer_mla", Cost.LOW, "capture runs flashinfer"),
        pinned=ForwardMethod.MHA)


def legacy_requires(ctx):
    return _like_reference(ctx, "legacy_requires",
                           requires=(Requirement("torch", "torch", "2.4"),))


@attnreg.hookimpl
def attnreg_register_backends(register):
    for fn in (rocm_arch_bug, npu_page_bug, fallback_ghost, fallback_chain, fallback_pins_mha,
               legacy_requires):
        register(attnreg.BackendSpec(name=fn.__name__, summary=fn.__name__.replace("_", " "),
                                     capabilities=fn, runtime=RUNTIME))
