"""What creating a backend checks: a page size none of its paged kernels declares is
refused at ``create()`` (and at direct construction), not at the first forward."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from attnreg.registry import (  # noqa: E402 - after the torch skip
    Capabilities,
    DType,
    ForwardMethod,
    KernelConstraints,
    Phase,
    Platform,
    UnsupportedError,
    Vendor,
    get_registry,
)
from attnreg.runtime import AttentionBackend, MLAConfig  # noqa: E402
from attnreg.runtime.validation import page_size_problems  # noqa: E402

BF16 = frozenset({DType.BF16})


def kernel(method: ForwardMethod, phase: Phase, page_sizes: tuple[int, ...] = ()
           ) -> KernelConstraints:
    dims = ((576, 512),) if method is ForwardMethod.MLA else ((192, 128),)
    return KernelConstraints(method, frozenset({phase}), dims, BF16, BF16,
                             page_sizes=page_sizes)


def caps(*kernels: KernelConstraints) -> Capabilities:
    return Capabilities(backend="demo", platform=Platform.parse("cpu"),
                        vendors=frozenset({Vendor.CPU}), kernels=kernels,
                        graph_modes=())


def test_create_refuses_an_undeclared_page_size_with_the_declared_ones() -> None:
    with pytest.raises(UnsupportedError, match=r"reference: unsupported page size: page size 8 "
                                               r"not in \[1, 16, 32, 64\]"):
        get_registry().create("reference", MLAConfig(num_heads=2, page_size=8))
    # a declared one is accepted
    get_registry().create("reference", MLAConfig(num_heads=2, page_size=16))


def test_direct_construction_refuses_it_too() -> None:
    declared = caps(kernel(ForwardMethod.MLA, Phase.DECODE, (16, 64)))
    with pytest.raises(UnsupportedError, match=r"page size 32 not in \[16, 64\]"):
        AttentionBackend(MLAConfig(num_heads=2, page_size=32), capabilities=declared)
    AttentionBackend(MLAConfig(num_heads=2, page_size=64), capabilities=declared)


def test_a_page_size_one_paged_kernel_declares_is_enough() -> None:
    # decode reads pages of 64, prefill pages of 16: either is a usable pool
    split = caps(kernel(ForwardMethod.MLA, Phase.DECODE, (64,)),
                 kernel(ForwardMethod.MLA, Phase.PREFILL, (16,)),
                 kernel(ForwardMethod.MHA, Phase.PREFILL))
    assert page_size_problems(16, split) == []
    assert page_size_problems(64, split) == []
    # the ragged MHA kernel reads no page: it does not make page size 32 usable
    assert page_size_problems(32, split) == [
        "page size 32 not in [16, 64] (the page sizes demo's kernels that read the paged KV "
        "pool declare on cpu)"]


def test_kernels_without_page_sizes_take_every_size() -> None:
    # an absorbed kernel declaring no page sizes reads any layout
    assert page_size_problems(8, caps(kernel(ForwardMethod.MLA, Phase.DECODE))) == []
    # a backend of ragged kernels only: nothing it runs depends on the page size
    assert page_size_problems(8, caps(kernel(ForwardMethod.MHA, Phase.PREFILL))) == []
