"""attnreg: pick MLA attention backends and CUDA-graph modes from declared capabilities.

A plugin writes::

    import attnreg

    @attnreg.hookimpl
    def attnreg_register_backends(register):
        register(attnreg.BackendSpec(...))

Importing ``attnreg`` is cheap: no torch, no kernel library.

This module is the plugin author's one import: every declaration type, the
hook marker, the registry entry points and the errors.  ``__all__`` is the
stable surface (docs/api.md); engines find theirs in :mod:`attnreg.runtime`
and :mod:`attnreg.graph_policy`.  A plugin can check what it runs against:

* :data:`__version__`: attnreg's version (semantic versioning from 0.2.0);
* :data:`PLUGIN_API_VERSION`: ``(major, minor)`` of the plugin API (hook
  specs and declaration types).  The minor grows when something is added or
  deprecated; the major only when a deprecated form is removed.  attnreg
  0.1.0 had no such constant: ``getattr(attnreg, "PLUGIN_API_VERSION", (1, 0))``.
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
    SparseKernel,
    SparseKVFormat,
    SplitKV,
    UnknownBackendError,
    UnsupportedError,
    Vendor,
    get_registry,
    hookimpl,
    load_registry,
)

#: attnreg's version; pyproject.toml reads it from here (the one place it is written).
__version__ = "0.2.0"

#: (major, minor) of the plugin API: 1.0 was attnreg 0.1.0; 1.1 (0.2.0) keeps every
#: 1.0 form loading, with a DeprecationWarning where one was replaced (docs/api.md).
PLUGIN_API_VERSION: tuple[int, int] = (1, 1)

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
    "PLUGIN_API_VERSION",
    "Phase",
    "Platform",
    "PluginError",
    "Requirement",
    "SparseKVFormat",
    "SparseKernel",
    "SplitKV",
    "UnknownBackendError",
    "UnsupportedError",
    "Vendor",
    "__version__",
    "get_registry",
    "hookimpl",
    "load_registry",
]
