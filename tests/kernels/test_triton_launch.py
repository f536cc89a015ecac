"""CPU tests of the decode host path: checks once per request, direct launches after a JIT one.

The kernels are replaced by fakes that record their launches, and the Triton runtime the
direct path reads (current device and stream, launch hooks) by a fake, so the caching and
fallback logic runs on any machine; tests/kernels/test_triton_kernels_gpu.py checks on a
GPU that the direct path gives the JIT path's output.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from attnreg.backends._triton_kernels import _launch, mla_decode, mla_decode_workspace
from attnreg.backends._triton_kernels import decode as dec
from attnreg.backends._triton_kernels._common import LOG2E


class FakeCompiled:
    """What a JIT launch returns: a launcher and the handles it takes."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log
        self.function = f"fn:{name}"
        self.packed_metadata = (4, 1, 0)

    def run(self, *args):  # the compiled kernel's launcher
        self.log.append(("direct", self.name, args))


class FakeKernel:
    """Stands in for a @triton.jit function: ``kernel[grid](*args)`` records a JIT launch."""

    def __init__(self, name: str, log: list, returns: bool = True) -> None:
        self.name, self.log, self.returns = name, log, returns

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.log.append(("jit", self.name, (grid, args, options)))
            return FakeCompiled(self.name, self.log) if self.returns else None
        return launch


class Hooks:
    def __init__(self) -> None:
        self.calls: list = []


class FakeKnobs:
    def __init__(self) -> None:
        self.launch_enter_hook, self.launch_exit_hook = Hooks(), Hooks()


class Log:
    """The launches so far (kind, kernel, arguments), the fake knobs and current device."""

    def __init__(self) -> None:
        self.calls: list = []
        self.records: list = []
        self.knobs = FakeKnobs()
        self.device = 0

    def take(self) -> list:
        """(kind, kernel) of the launches since the last take; their records kept."""
        self.records, self.calls[:] = list(self.calls), []
        return [(kind, name) for kind, name, _ in self.records]


@pytest.fixture
def log(monkeypatch):
    """Fake kernels and a fake Triton runtime (stream 7 + device); empty caches."""
    rec = Log()
    monkeypatch.setattr(dec, "_mla_decode_kernel", FakeKernel("decode", rec.calls))
    monkeypatch.setattr(dec, "_mla_merge_kernel", FakeKernel("merge", rec.calls))
    monkeypatch.setattr(dec, "_PLANS", {})
    monkeypatch.setattr(_launch, "_COMPILED", {})
    monkeypatch.setattr(_launch, "_RT", (lambda: rec.device, lambda dev: 7 + dev, rec.knobs))
    return rec


def inputs(B=2, H=16, width=64, misaligned=False, splits=4):
    """Decode inputs on the cpu (nothing is computed: the kernels are fakes)."""
    if misaligned:  # same shape and strides, address 2 bytes past a 16-byte boundary
        q = torch.zeros(B * H * 576 + 1, dtype=torch.bfloat16)[1:].view(B, H, 576)
    else:
        q = torch.zeros(B, H, 576, dtype=torch.bfloat16)
    cache = torch.zeros(B * width, 1, 576, dtype=torch.bfloat16)
    table = torch.zeros(B, width, dtype=torch.int32)
    seq = torch.full((B,), width, dtype=torch.int32)
    out = torch.zeros(B, H, 512, dtype=torch.bfloat16)
    ws = mla_decode_workspace(B, H, splits, "cpu")
    return q, cache, table, seq, out, ws


def call(args, splits=4, **kw):
    q, cache, table, seq, out, ws = args
    return mla_decode(q, cache, table, seq, out, sm_scale=0.25, max_splits=splits,
                      workspace=ws, **kw)


def test_first_launch_jit_then_direct_with_the_same_arguments(log):
    args = inputs()
    call(args)
    assert log.take() == [("jit", "decode"), ("jit", "merge")]
    jit = {name: rec for _, name, rec in log.records}
    call(args)
    assert log.take() == [("direct", "decode"), ("direct", "merge")]
    for _, name, direct in log.records:
        grid, jit_args, options = jit[name]
        assert options == ({"num_warps": 4, "num_stages": 3} if name == "decode"
                           else {"num_warps": 4, "num_stages": 2})
        assert direct[:9] == (*grid, 7, f"fn:{name}", (4, 1, 0), None, None, None)
        n_ptr = 9 if name == "decode" else 5  # ... KVS, LSE / ... OUT, LSE
        # the same arguments as the JIT launch, tensors as their addresses
        assert direct[9:9 + n_ptr] == tuple(t.data_ptr() for t in jit_args[:n_ptr])
        assert direct[9 + n_ptr:] == jit_args[n_ptr:]
    q, cache, table, seq, out, (po, pl) = args
    decode_args = jit["decode"][1]
    # q stands in for a float kv scale, out for the LSE output nobody asked for
    assert decode_args[:9] == (q, cache, table, seq, out, po, pl, q, out)
    assert decode_args[9] == pytest.approx(0.25 * LOG2E)


def test_new_tensors_of_the_same_request_launch_directly(log):
    call(inputs())
    log.take()
    call(inputs())  # other tensors, same dtypes / shapes / strides / alignment
    assert log.take() == [("direct", "decode"), ("direct", "merge")]


def test_inputs_are_checked_once_per_distinct_request(log, monkeypatch):
    checked = []
    validate = dec._validate

    def counting(*a):
        checked.append(a[0].shape)
        return validate(*a)

    monkeypatch.setattr(dec, "_validate", counting)
    call(inputs())
    call(inputs())
    assert len(checked) == 1
    call(inputs(B=3))  # another batch: another request
    assert len(checked) == 2
    call(inputs(), splits=4, force_num_splits=2)  # another split argument
    assert len(checked) == 3


def test_a_bad_request_is_refused_every_time(log):
    q, cache, table, seq, out, ws = inputs()
    for _ in range(2):
        with pytest.raises(ValueError, match="seq_lens.*int32"):
            call((q, cache, table, seq.long(), out, ws))
    with pytest.raises(ValueError, match="max_splits"):
        call(inputs(), splits=4.0)  # equal to 4, but not an int
    call(inputs())
    with pytest.raises(ValueError, match="max_splits"):
        call(inputs(), splits=4.0)  # still refused after the int request was accepted
    with pytest.raises(ValueError, match="workspace"):
        call((q, cache, table, seq, out, object()))
    with pytest.raises(ValueError, match="q:"):
        call(([[0.0]], cache, table, seq, out, ws))


def test_misaligned_pointer_gets_its_own_binary(log):
    call(inputs())
    log.take()
    call(inputs(misaligned=True))  # Triton specialises on 16-byte alignment: a new binary
    assert log.take() == [("jit", "decode"), ("direct", "merge")]
    call(inputs(misaligned=True))
    assert log.take() == [("direct", "decode"), ("direct", "merge")]


def test_other_strides_of_the_same_class_reuse_the_binary(log):
    call(inputs(width=64))
    log.take()
    call(inputs(width=128))  # page-table stride 128 vs 64: both multiples of 16
    assert log.take() == [("direct", "decode"), ("direct", "merge")]
    call(inputs(width=100))  # not a multiple of 16: Triton compiles another binary
    assert log.take() == [("jit", "decode"), ("direct", "merge")]


def test_another_device_gets_its_own_entry(log):
    call(inputs())
    log.take()
    log.device = 1
    call(inputs())
    assert log.take() == [("jit", "decode"), ("jit", "merge")]


def test_launch_hooks_send_launches_through_the_jit(log):
    call(inputs())
    log.knobs.launch_enter_hook.calls.append(print)
    call(inputs())
    log.take()
    call(inputs())
    assert log.take() == [("jit", "decode"), ("jit", "merge")]
    log.knobs.launch_enter_hook.calls.clear()
    call(inputs())
    assert log.take() == [("direct", "decode"), ("direct", "merge")]


def test_no_runtime_means_jit_every_time(log, monkeypatch):
    monkeypatch.setattr(_launch, "_RT", None)  # interpreter, unchecked Triton, or turned off
    for _ in range(3):
        call(inputs())
    assert log.take() == [("jit", "decode"), ("jit", "merge")] * 3


def test_a_kernel_without_a_compiled_result_is_never_cached(log, monkeypatch):
    monkeypatch.setattr(dec, "_mla_decode_kernel", FakeKernel("decode", log.calls, False))
    for _ in range(2):
        call(inputs())
    assert log.take() == [("jit", "decode"), ("jit", "merge"), ("jit", "decode"),
                          ("direct", "merge")]


def test_one_split_launches_no_merge(log):
    q, cache, table, seq, out, _ = inputs()
    for _ in range(2):
        mla_decode(q, cache, table, seq, out, sm_scale=0.25, max_splits=1)
    assert log.take() == [("jit", "decode"), ("direct", "decode")]


def test_plan_cache_is_bounded(log, monkeypatch):
    monkeypatch.setattr(dec, "_MAX_PLANS", 2)
    for width in (16, 32, 48):
        call(inputs(width=width))
    assert len(dec._PLANS) <= 2


@pytest.mark.parametrize("version,env,interpret,ok", [
    ("3.6.0", None, False, True),
    ("3.9.1+git1234", None, False, True),
    ("3.5.1", None, False, False),
    ("3.10.0", None, False, False),
    ("4.0.0", None, False, False),
    ("nightly", None, False, False),
    ("3.6.0", "0", False, False),
    ("3.6.0", "1", False, True),
    ("3.6.0", None, True, False),
])
def test_direct_launch_only_on_checked_triton(version, env, interpret, ok):
    assert _launch._supported(version, env, interpret) is ok


def test_interpreter_runs_every_launch_through_the_jit():
    # the CPU test-suite runs under TRITON_INTERPRET=1: no direct launches at all
    if _launch.direct_launch_enabled():
        pytest.skip("not running under the Triton interpreter")
    assert _launch._RT is None and _launch.direct_context() is None


def test_int_classes_follow_triton_specialisation():
    cls = _launch._int_class
    assert cls(1) != cls(2) != cls(16)
    assert cls(32) == cls(4096) and cls(3) == cls(1000 + 1)
    assert cls(2**31) != cls(2**31 - 16) and cls(-16) == cls(16)
