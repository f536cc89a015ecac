"""Launch a compiled Triton kernel directly, its arguments bound once per request shape.

Why: ``kernel[grid](...)`` cost 46-53 us of host time per launch on the H200's host,
calling the compiled kernel's own launcher with the same arguments 8.5-8.8 us (issue 20,
sweep 2; a decode is two launches).  Triton 3.6's ``JITFunction.run`` binds the ~40
arguments, computes their specialisation and a cache-key string and builds launch
metadata on every call.

How: a :class:`BoundLaunch` holds one kernel's grid, integer arguments and constexprs
for one request shape (the wrappers build one per distinct set of shapes, strides and
dtypes, after validating it).  Per call it takes the tensors and floats.  The first call
goes through the JIT (``kernel[grid](...)``), which compiles or finds the binary; the
returned ``CompiledKernel`` is kept, and later calls run it directly with the tensors'
addresses as ints.  A compiled kernel is reused only under the key Triton specialises
on (see :func:`_spec_key`), so it is the binary the JIT would have picked.

Fallback to the JIT call, always correct: the Triton interpreter, a Triton version whose
launcher was not checked (:data:`CHECKED_TRITON`), a launch hook set (profilers read the
launch metadata that only the JIT path builds), a kernel that returns no compiled kernel
(a stub), and ``ATTNREG_TRITON_DIRECT_LAUNCH=0`` in the environment at import.

Kernel parameters must come in this order: pointers, floats, ints, constexprs (the
direct call passes every parameter positionally; Triton's launcher ignores the values
at constexpr positions).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import triton

from ._common import interpreting

__all__ = ["CHECKED_TRITON", "BoundLaunch", "direct_context", "direct_launch_enabled"]

#: Triton (major, minor) versions whose ``CompiledKernel.run`` signature was read:
#: ``run(grid_x, grid_y, grid_z, stream, function, packed_metadata, launch_metadata,
#: enter_hook, exit_hook, *kernel_args)``, pointers accepted as ints (3.6.0 and 3.9.0
#: sources; 3.7 and 3.8 lie between them).
CHECKED_TRITON = ((3, 6), (3, 9))

_ENV = "ATTNREG_TRITON_DIRECT_LAUNCH"

#: spec key -> (launcher, function, packed_metadata), shared by every BoundLaunch
_COMPILED: dict[tuple[Any, ...], tuple[Any, Any, Any]] = {}


def _triton_version(version: str) -> tuple[int, int]:
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def _supported(version: str, env: str | None, interpret: bool) -> bool:
    lo, hi = CHECKED_TRITON
    return (not interpret and env not in ("0", "false", "no")
            and lo <= _triton_version(version) <= hi)


_ENABLED = _supported(triton.__version__, os.environ.get(_ENV), interpreting())


def direct_launch_enabled() -> bool:
    """Whether launches may bypass Triton's JIT launch (see the module docstring)."""
    return _ENABLED


def _runtime() -> tuple[Any, Any, Any] | None:
    """(current_device, current_stream, runtime knobs), or None where Triton lacks them."""
    try:
        from triton import knobs
        drv = triton.runtime.driver.active
        return drv.get_current_device, drv.get_current_stream, knobs.runtime
    except (AttributeError, ImportError, RuntimeError):
        return None


_RT: tuple[Any, Any, Any] | None = _runtime() if _ENABLED else None


def _hook_set(hook: Any) -> bool:
    # a HookChain (Triton >= 3.5) is never None: it is set when it holds calls
    return hook is not None and bool(getattr(hook, "calls", True))


def direct_context() -> tuple[int, int] | None:
    """``(device, stream)`` to launch on directly now, or None: launch through the JIT.

    The current device and stream, as the JIT launch uses; None where direct launches
    are off or a launch hook is set.  One call serves the launches of one request.
    """
    rt = _RT
    if rt is None or _hook_set(rt[2].launch_enter_hook) or _hook_set(rt[2].launch_exit_hook):
        return None
    dev = rt[0]()
    return dev, rt[1](dev)


def _int_class(v: int) -> tuple[bool, bool, bool]:
    """What Triton specialises an int argument on: == 1, fits int32, multiple of 16."""
    return v == 1, -2**31 <= v < 2**31, v % 16 == 0


def _spec_key(name: str, ints: Sequence[int], constexprs: tuple[Any, ...],
              options: dict[str, Any], dtypes: tuple[Any, ...]) -> tuple[Any, ...]:
    """The binary a launch needs, less the device and the pointers' 16-byte alignment.

    Triton specialises an int on being 1 (then a constant), on its 32/64-bit type and on
    divisibility by 16 (parameters marked do_not_specialize only on the type: classing
    them like the others is finer, never coarser); a pointer on its dtype and on
    divisibility by 16; floats not at all; constexprs and options by value.
    """
    return (name, tuple(_int_class(v) for v in ints), constexprs,
            tuple(sorted(options.items())), dtypes)


class BoundLaunch:
    """One kernel's launches for one request shape: grid, ints, constexprs, options bound.

    Parameters
    ----------
    module, name
        Where the ``@triton.jit`` function lives, looked up at each JIT launch (so a
        test or benchmark may swap it; compiled kernels already kept stay in use).
    grid
        Three grid dimensions.
    ints
        The kernel's int arguments after its pointers and floats, in order.
    constexprs
        Every constexpr argument, in order (defaults included).
    options
        Launch options (``num_warps``, ``num_stages``).
    dtypes
        Dtypes of the pointer arguments, in order (part of the binary's key).
    """

    __slots__ = ("_by_launch", "_g0", "_g1", "_g2", "_module", "_name", "_options", "_spec",
                 "_tail")

    def __init__(self, module: Any, name: str, grid: tuple[int, int, int],
                 ints: Sequence[int], constexprs: Sequence[Any], options: dict[str, Any],
                 dtypes: Sequence[Any]) -> None:
        self._module = module
        self._name = name
        self._g0, self._g1, self._g2 = (int(g) for g in grid)
        self._tail = (*ints, *constexprs)
        self._options = dict(options)
        self._spec = _spec_key(name, ints, tuple(constexprs), self._options, tuple(dtypes))
        #: (device, alignment) -> (launcher, function, packed_metadata)
        self._by_launch: dict[Any, tuple[Any, Any, Any]] = {}

    def __call__(self, tensors: Sequence[Any], floats: Sequence[float] = (),
                 ctx: tuple[int, int] | None = None,
                 ptrs: Sequence[int] | None = None) -> Any:
        """Launch with the leading pointer arguments ``tensors`` and then ``floats``.

        ``ctx`` from :func:`direct_context` (None: the JIT launch); ``ptrs``: the tensors'
        addresses when the caller has them already.  Returns the compiled kernel of a
        JIT launch, None after a direct one.
        """
        if ctx is None:
            return self._jit(tensors, floats)
        if ptrs is None:
            ptrs = [t.data_ptr() for t in tensors]
        any_bits = 0
        for p in ptrs:
            any_bits |= p
        dev, stream = ctx
        # Triton's pointer specialisation: is each address a multiple of 16
        key = dev if not any_bits & 15 else (dev, tuple(p & 15 == 0 for p in ptrs))
        entry = self._by_launch.get(key)
        if entry is None:
            entry = _COMPILED.get((self._spec, key))
            if entry is None:
                compiled = self._jit(tensors, floats)
                entry = _entry(compiled)
                if entry is not None:
                    self._by_launch[key] = _COMPILED[(self._spec, key)] = entry
                return compiled
            self._by_launch[key] = entry
        run, function, packed = entry
        run(self._g0, self._g1, self._g2, stream, function, packed, None, None, None, *ptrs,
            *floats, *self._tail)
        return None

    def _jit(self, tensors: Sequence[Any], floats: Sequence[float]) -> Any:
        fn = getattr(self._module, self._name)
        return fn[(self._g0, self._g1, self._g2)](*tensors, *floats, *self._tail,
                                                  **self._options)


def _entry(compiled: Any) -> tuple[Any, Any, Any] | None:
    """(launcher, function, packed_metadata) of a JIT launch's result, None if it has none."""
    try:
        entry = (compiled.run, compiled.function, compiled.packed_metadata)
    except AttributeError:
        return None
    return entry if entry[1] is not None and callable(entry[0]) else None
