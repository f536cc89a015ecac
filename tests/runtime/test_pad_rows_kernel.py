"""The one-launch padding-row fill (issue 31, peers.wrapper): ``fill_flagged_rows`` on CUDA
is a Triton kernel that writes only the flagged rows, and ``masked_fill_`` (which reads and
writes every element) stays its specification.  On the CPU the kernel runs under the
Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA), called
directly: ``fill_flagged_rows`` sends it only CUDA tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from attnreg.runtime.graph_buffers import fill_flagged_rows  # noqa: E402


def _kernel():  # type: ignore[no-untyped-def]
    pytest.importorskip("triton")
    from attnreg.runtime import _pad_rows_kernel

    return _pad_rows_kernel


def _torch_form(t: torch.Tensor, flags: torch.Tensor, value: float) -> torch.Tensor:
    want = t.clone()
    rows = t.shape[0]
    want.masked_fill_(flags[:rows].ne(0).view((rows,) + (1,) * (t.dim() - 1)), value)
    return want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(5, 3, 8), (4, 2100), (3, 1), (6, 2, 1024)])
@pytest.mark.parametrize("value", [0.0, float("-inf"), 2.5])
def test_the_kernel_sets_the_flagged_rows_and_only_them(dtype, shape, value):
    kernel = _kernel()
    gen = torch.Generator().manual_seed(sum(shape))
    t = torch.randn(shape, generator=gen).to(dtype)
    flags = torch.zeros(shape[0] + 2, dtype=torch.int32)  # longer than t: the layout's are
    flags[1::2] = 1
    flags[-1] = 7  # nonzero is "set", whatever its value
    want = _torch_form(t, flags, value)
    assert kernel.supports(t, flags)
    kernel.fill_flagged_rows_fused(t, flags, value)
    assert torch.equal(t, want)


def test_no_flags_touch_nothing_and_strided_rows_are_written_in_place():
    kernel = _kernel()
    big = torch.randn(6, 3, 40)
    t = big[:, :, 4:36]  # each row's elements not contiguous: the torch form takes it
    flags = torch.tensor([0, 1, 0, 0, 1, 0], dtype=torch.int32)
    assert not kernel.supports(t, flags)
    rows = big[::2]  # a row stride of two rows, each row contiguous: the kernel takes it
    before = big.clone()
    assert kernel.supports(rows, flags[:3])
    kernel.fill_flagged_rows_fused(rows, torch.zeros(3, dtype=torch.int32), 0.0)
    assert torch.equal(big, before)
    kernel.fill_flagged_rows_fused(rows, flags[:3], 0.0)
    assert big[2].eq(0).all() and torch.equal(big[[0, 1, 3, 4, 5]], before[[0, 1, 3, 4, 5]])


def test_supports_leaves_the_rest_to_the_torch_form():
    kernel = _kernel()
    t = torch.zeros(4, 8)
    assert not kernel.supports(t, torch.zeros(4, dtype=torch.int64))  # not int32
    assert not kernel.supports(t, torch.zeros(3, dtype=torch.int32))  # fewer flags than rows
    assert not kernel.supports(t.to(torch.int32), torch.zeros(4, dtype=torch.int32))
    assert not kernel.supports(t, torch.zeros(8, dtype=torch.int32)[::2])


def test_on_the_cpu_fill_flagged_rows_is_the_torch_form():
    t = torch.ones(4, 2, 3)
    mask = torch.tensor([False, True, False, True])
    fill_flagged_rows(t, mask, 0.0, flags=mask.to(torch.int32))
    assert t[[1, 3]].eq(0).all() and t[[0, 2]].eq(1).all()


@pytest.mark.gpu
def test_on_cuda_one_kernel_in_a_graph_that_follows_the_flags():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _kernel()
    dev = torch.device("cuda")
    t = torch.randn(64, 128, 512, dtype=torch.bfloat16, device=dev)
    flags = torch.zeros(64, dtype=torch.int32, device=dev)
    mask = flags.ne(0)
    from attnreg.runtime import GraphRunner

    runner = GraphRunner(dev)  # warms up (compiles) on a side stream, then captures
    graph = runner.capture(lambda: fill_flagged_rows(t, mask, 0.0, flags=flags))
    for live in (64, 5, 1, 64, 33):
        src = torch.randn(64, 128, 512, dtype=torch.bfloat16, device=dev)
        t.copy_(src)
        flags.copy_((torch.arange(64, device=dev) >= live).to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(t[:live], src[:live]), live
        assert t[live:].eq(0).all(), live
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fill_flagged_rows(t, mask, 0.0, flags=flags)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "_fill_flagged_rows" in kernels[0], kernels


@pytest.mark.gpu
def test_as_a_dependent_launch_it_waits_for_the_kernel_it_follows_in_a_graph():
    # dependent_launch (probe-only until measured): the fill launched as a programmatic
    # dependent of the kernel writing the rows it reads and overwrites; every program
    # waits for that kernel, so the padding rows are zero and the live rows are the
    # kernel's, replay after replay (a fill that ran early would leave the kernel's
    # values in the padding rows)
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kernel = _kernel()
    dev = torch.device("cuda")
    if not kernel.can_launch_dependent(dev):
        pytest.skip("programmatic dependent launch needs sm90+ and triton's gdc_wait")
    src = torch.randn(64, 128, 512, dtype=torch.bfloat16, device=dev)
    t = torch.empty_like(src)
    flags = torch.zeros(64, dtype=torch.int32, device=dev)
    from attnreg.runtime import GraphRunner

    def step() -> None:
        torch.mul(src, 2.0, out=t)  # the kernel the fill depends on
        kernel.fill_flagged_rows_fused(t, flags, 0.0, dependent_launch=True)

    graph = GraphRunner(dev).capture(step)
    for live in (64, 5, 1, 64, 33):
        src.copy_(torch.randn_like(src))
        flags.copy_((torch.arange(64, device=dev) >= live).to(torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(t[:live], src[:live] * 2.0), live
        assert t[live:].eq(0).all(), live


def test_a_dependent_launch_off_cuda_is_the_plain_kernel():
    kernel = _kernel()
    t = torch.randn(4, 8, 64)
    flags = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    want = _torch_form(t, flags, 0.0)
    kernel.fill_flagged_rows_fused(t, flags, 0.0, dependent_launch=True)
    assert torch.equal(t, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("row", [(3, 700), (9, 1000)])  # 3 blocks; 9 (more than 8 spans)
def test_with_a_source_the_live_rows_are_copied_in_the_same_launch(dtype, row):
    kernel = _kernel()
    gen = torch.Generator().manual_seed(7)
    t = torch.randn(6, *row, generator=gen).to(dtype)
    src = torch.randn(6, *row, generator=gen).to(dtype)
    flags = torch.tensor([0, 0, 1, 0, 1, 1], dtype=torch.int32)
    want = src.clone()
    want[flags.ne(0)] = 0
    assert kernel.supports(t, flags, src)
    assert not kernel.supports(t, flags, src[:5]) and not kernel.supports(t, flags, src.half())
    kernel.fill_flagged_rows_fused(t, flags, 0.0, src)
    assert torch.equal(t, want)
    # the torch form gives the same
    t2 = torch.zeros_like(t)
    fill_flagged_rows(t2, flags.ne(0), 0.0, src=src)
    assert torch.equal(t2, want)
