"""Shared builders for the graph-policy tests: simulated resolves and
hand-built declarations (no registry, no kernels)."""

from __future__ import annotations

from typing import Any

from attnreg.graph_policy import (
    EngineFacts,
    GraphConfig,
    GraphPlan,
    ModelFacts,
    ServerFeatures,
    resolve,
)
from attnreg.registry import (
    Capabilities,
    CaptureSupport,
    DType,
    ForwardMethod,
    ForwardModeSupport,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    Platform,
    Vendor,
)

MLA_DIMS = ((576, 512),)
MHA_DIMS = ((192, 128),)
ALL_KV = frozenset({DType.BF16, DType.FP16, DType.FP8_E4M3})
HALF = frozenset({DType.BF16, DType.FP16})


#: Library versions the simulated plans are evaluated with, so that a newer
#: flashinfer on the test machine does not change what the built-ins declare.
VERSIONS: dict[str, str | None] = {"flashinfer-python": "0.6.13", "flash-attn-4": "4.0.0b36",
                                   "torch": "2.13.0", "triton": "3.9.0"}


def sim(platform: str, model: ModelFacts | str, backends: Any = None,
        config: GraphConfig | None = None, features: ServerFeatures | None = None,
        engine: EngineFacts | None = None, **kwargs: Any) -> GraphPlan:
    """Resolve on a simulated platform, as `attnreg compat --platform` does."""
    return resolve(platform, model, backends, config, features, engine, assume_installed=True,
                   versions=VERSIONS, **kwargs)


def declaration(
    name: str = "gen",
    platform: str | Platform = "cuda:sm90",
    *,
    modes: dict[tuple[Phase, GraphMode], CaptureSupport] | None = None,
    pinned: dict[tuple[Phase, GraphMode], ForwardMethod | None] | None = None,
    kv_dtypes: frozenset[DType] = ALL_KV,
    priority: int = 0,
    page_sizes: tuple[int, ...] = (1, 64),
    forward_modes: dict[tuple[Phase, GraphMode], tuple[ForwardModeSupport, ...]] | None = None,
    eager_forward_modes: tuple[ForwardModeSupport, ...] = (),
    max_seq_len: int | None = None,
) -> Capabilities:
    """A declaration serving MLA decode + MLA/MHA prefill, every mode NATIVE
    unless ``modes`` says otherwise, pinning nothing unless ``pinned`` says so;
    ``forward_modes`` per (phase, mode) and ``eager_forward_modes`` as declared
    (default: the plain decode / extend)."""
    plat = Platform.parse(platform)
    kernels = (
        KernelConstraints(ForwardMethod.MLA, frozenset({Phase.DECODE, Phase.PREFILL}),
                          MLA_DIMS, HALF, kv_dtypes, page_sizes=page_sizes, max_heads=128,
                          max_seq_len=max_seq_len),
        KernelConstraints(ForwardMethod.MHA, frozenset({Phase.PREFILL}), MHA_DIMS, HALF, HALF,
                          max_heads=128),
    )
    modes = modes or {}
    pinned = pinned or {}
    served = forward_modes or {}
    entries = []
    for key in ((Phase.DECODE, GraphMode.FULL), (Phase.PREFILL, GraphMode.BREAKABLE),
                (Phase.PREFILL, GraphMode.TC_PIECEWISE)):
        entries.append(GraphModeSupport(key[0], key[1], modes.get(key, CaptureSupport.native()),
                                        pinned_method=pinned.get(key),
                                        forward_modes=served.get(key, ())))
    return Capabilities(backend=name, platform=plat, vendors=frozenset(Vendor),
                        kernels=kernels, graph_modes=tuple(entries), priority=priority,
                        eager_forward_modes=eager_forward_modes)
