"""The registry: capability model, hookspecs and plugin manager.

Pure data and pluggy only; importing this package never imports torch or a
kernel library.
"""

from .capabilities import (
    CAPTURE_GRAPH_MODES,
    METHOD_HEAD_DIMS,
    SPECULATIVE_MODES,
    VALID_GRAPH_MODES,
    Capabilities,
    CaptureMemory,
    CaptureShape,
    CaptureSupport,
    Cost,
    DType,
    ForwardMethod,
    ForwardMode,
    ForwardModeSupport,
    GraphMode,
    GraphModeSupport,
    KernelConstraints,
    Phase,
    Requirement,
    SparseKernel,
    SparseKVFormat,
    SplitKV,
    SupportKind,
)
from .errors import (
    AttnregError,
    BackendUnavailableError,
    DuplicateBackendError,
    GraphPolicyError,
    PluginError,
    UnknownBackendError,
    UnsupportedError,
)
from .hookspecs import hookimpl, hookspec
from .loading import StartupLimits
from .manager import (
    ENTRY_POINT_GROUP,
    VALIDATION_PLATFORMS,
    Availability,
    BackendRegistry,
    PluginInfo,
    StartupWarning,
    get_registry,
    load_registry,
)
from .platform import KNOWN_DEVICES, PLATFORM_TRAITS, Platform, Vendor
from .resolution import RuntimeCheck, RuntimeState
from .spec import BackendSpec, DeclarationContext
from .validation import validate_capabilities, validate_fallback_targets, validate_spec

# The stable surface (docs/api.md): changed only through a deprecation.  The other
# names imported above stay importable from here for compatibility, but are not
# promised: import them from their module if you must.
__all__ = [
    "ENTRY_POINT_GROUP",
    "SPECULATIVE_MODES",
    "AttnregError",
    "Availability",
    "BackendRegistry",
    "BackendSpec",
    "BackendUnavailableError",
    "Capabilities",
    "CaptureMemory",
    "CaptureShape",
    "CaptureSupport",
    "Cost",
    "DType",
    "DeclarationContext",
    "DuplicateBackendError",
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
    "PluginInfo",
    "Requirement",
    "SparseKVFormat",
    "SparseKernel",
    "SplitKV",
    "UnknownBackendError",
    "UnsupportedError",
    "Vendor",
    "get_registry",
    "hookimpl",
    "hookspec",
    "load_registry",
    "validate_capabilities",
]
