"""attnreg: pick MLA attention backends and CUDA-graph modes from declared capabilities.

A plugin writes::

    import attnreg

    @attnreg.hookimpl
    def attnreg_register_backends(register):
        register(attnreg.BackendSpec(...))

Importing ``attnreg`` is cheap: no torch, no kernel library.
"""

from .registry import (
    AttnregError,
    BackendSpec,
    BackendUnavailableError,
    Capabilities,
    CaptureMemory,
    CaptureShape,
    CaptureSupport,
    Cost,
    DeclarationContext,
    DType,
    ForwardMethod,
    ForwardMode,
    ForwardModeSupport,
    GraphMode,
    GraphModeSupport,
    GraphPolicyError,
    KernelConstraints,
    Phase,
    Platform,
    PluginError,
    Requirement,
    SplitKV,
    UnknownBackendError,
    UnsupportedError,
    Vendor,
    get_registry,
    hookimpl,
    load_registry,
)

__version__ = "0.1.0"

__all__ = [
    "AttnregError",
    "BackendSpec",
    "BackendUnavailableError",
    "Capabilities",
    "CaptureMemory",
    "CaptureShape",
    "CaptureSupport",
    "Cost",
    "DType",
    "DeclarationContext",
    "ForwardMethod",
    "ForwardMode",
    "ForwardModeSupport",
    "GraphMode",
    "GraphModeSupport",
    "GraphPolicyError",
    "KernelConstraints",
    "Phase",
    "Platform",
    "PluginError",
    "Requirement",
    "SplitKV",
    "UnknownBackendError",
    "UnsupportedError",
    "Vendor",
    "__version__",
    "get_registry",
    "hookimpl",
    "load_registry",
]
