"""Measuring MLA attention: the layer model, timing, and cost-profile fitting.

What ``attnreg calibrate`` and ``benchmarks/`` share, so that both measure the
same thing the same way:

* the layer model: :class:`LayerShape`, :class:`MLALayer` (DeepSeek-shaped
  projections around a backend's attention), :func:`random_pool`,
  :func:`kv_slots_of`, :func:`rel_error`;
* timing: :class:`Clock` (CUDA events, the one L2-flush buffer, stalled-stream
  device times) and :func:`spread`;
* fitting: :func:`fit_term` / :func:`fit_profile_terms` (non-negative least
  squares of the cost profile's terms) and :func:`crossover_extend`;
* decode per backend and capture bucket through a GraphSession:
  :func:`measure_decode`, :func:`decode_points` (``attnreg calibrate --decode``);
* :func:`library_versions`, recorded with every measurement.

Layering (DESIGN.md): profiling sits beside ``testing``, above ``backends``
and below ``commands``; it never imports ``attnreg.commands`` or
``benchmarks``, and importing it imports no torch (torch is passed in).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: Public name -> the submodule that defines it.  Loaded on first use: ``attnreg
#: compat`` imports the crossover alone, and its start-up time is a measured figure (P5).
_WHERE = {
    "CROSSOVER_PREFIXES": "crossover", "CrossoverPoint": "crossover",
    "crossover_extend": "crossover",
    "DecodePoint": "decode", "decode_points": "decode", "measure_decode": "decode",
    "VERSIONED": "environment", "library_versions": "environment", "load_average": "environment",
    "FitResult": "fit", "batch_record": "fit", "fit_profile_terms": "fit", "fit_term": "fit",
    "shape_of_record": "fit",
    "DRY_LAYER": "layer", "LayerShape": "layer", "MLALayer": "layer",
    "kv_slots_of": "pool", "random_pool": "pool", "rel_error": "pool",
    "FLUSH_BYTES": "timing", "Clock": "timing", "spread": "timing",
}

__all__ = [
    "CROSSOVER_PREFIXES",
    "DRY_LAYER",
    "FLUSH_BYTES",
    "VERSIONED",
    "Clock",
    "CrossoverPoint",
    "DecodePoint",
    "FitResult",
    "LayerShape",
    "MLALayer",
    "batch_record",
    "crossover_extend",
    "decode_points",
    "fit_profile_terms",
    "fit_term",
    "kv_slots_of",
    "library_versions",
    "load_average",
    "measure_decode",
    "random_pool",
    "rel_error",
    "shape_of_record",
    "spread",
]

if TYPE_CHECKING:
    from .crossover import CROSSOVER_PREFIXES, CrossoverPoint, crossover_extend
    from .decode import DecodePoint, decode_points, measure_decode
    from .environment import VERSIONED, library_versions, load_average
    from .fit import FitResult, batch_record, fit_profile_terms, fit_term, shape_of_record
    from .layer import DRY_LAYER, LayerShape, MLALayer
    from .pool import kv_slots_of, random_pool, rel_error
    from .timing import FLUSH_BYTES, Clock, spread


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'attnreg.profiling' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
