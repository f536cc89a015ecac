"""The CUDA timing logic of calibration and the benchmarks (one Clock), on a simulated device.

A fake ``torch`` with a device clock: ``torch.cuda._sleep(cycles)`` advances it
by ``cycles / rate``, events read it, and a measured call advances it by its
simulated device time.  This checks what the Clock reports (the call's device
time, not the stall or the flush), how many repetitions it takes, and that a
call which blocks the host is flagged -- without a GPU.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from attnreg.profiling import Clock, spread

CYCLES_PER_US = 1500.0


class FakeDevice:
    def __init__(self) -> None:
        self.now_ms = 0.0
        self.sleeps: list[int] = []
        self.flushes = 0

    def advance_us(self, us: float) -> None:
        self.now_ms += us / 1e3


def fake_torch(device: FakeDevice, *, with_sleep: bool = True) -> Any:
    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at: float | None = None

        def record(self) -> None:
            self.at = device.now_ms

        def elapsed_time(self, end: Event) -> float:
            assert self.at is not None and end.at is not None
            return end.at - self.at

    class Buffer:
        def zero_(self) -> None:
            device.flushes += 1
            device.advance_us(80.0)  # the L2 flush runs before the start event

    def sleep(cycles: int) -> None:
        device.sleeps.append(cycles)
        device.advance_us(cycles / CYCLES_PER_US)

    cuda = SimpleNamespace(Event=Event, synchronize=lambda: None)
    if with_sleep:
        cuda._sleep = sleep
    return SimpleNamespace(cuda=cuda, int8="int8",
                           empty=lambda *a, **k: Buffer())


def call_taking(device: FakeDevice, us: float, host_s: float = 0.0) -> Any:
    calls = []

    def fn() -> None:
        if host_s:
            time.sleep(host_s)
        device.advance_us(us)
        calls.append(us)

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


def test_device_time_is_the_calls_own_time() -> None:
    dev = FakeDevice()
    clock = Clock(fake_torch(dev), "cuda")
    assert clock.cycles_per_us == pytest.approx(CYCLES_PER_US)
    m = clock.device_us(call_taking(dev, 250.0))
    assert m["us"] == pytest.approx(250.0)
    assert m["flags"] == [] and m["kind"] == "device"
    assert "held back with torch.cuda._sleep" in clock.method["device"]


def test_repetitions_follow_the_call_length() -> None:
    dev = FakeDevice()
    clock = Clock(fake_torch(dev), "cuda", target_ms=40.0, min_reps=3, max_reps=15)
    short, long = call_taking(dev, 100.0), call_taking(dev, 30_000.0)
    assert len(clock.device_us(short)["samples_us"]) == 15   # 400 wanted, capped
    assert len(clock.device_us(long)["samples_us"]) == 3     # 1 wanted, at least 3
    assert len(long.calls) == 1 + 3                          # one probe, then the reps


def test_the_stall_covers_the_host_time_of_the_call() -> None:
    dev = FakeDevice()
    clock = Clock(fake_torch(dev), "cuda")
    clock.device_us(call_taking(dev, 10.0))
    stalls_us = [c / CYCLES_PER_US for c in dev.sleeps[2:]]  # after the rate calibration
    assert stalls_us and min(stalls_us) >= 500.0


def test_a_call_that_blocks_the_host_is_flagged() -> None:
    dev = FakeDevice()
    clock = Clock(fake_torch(dev), "cuda", min_reps=3, max_reps=3)
    # The host sleeps 2 ms inside the call: longer than the probe said, so longer than
    # the stall sized from it would hide (the fake host estimate is the first call's).
    calls = {"n": 0}

    def fn() -> None:
        calls["n"] += 1
        if calls["n"] > 1:
            time.sleep(0.01)
        dev.advance_us(50.0)

    assert "host_blocked" in clock.device_us(fn)["flags"]
    calls["n"] = 0
    assert "host_blocked" in clock.host_us(fn)["flags"]


def test_host_time_is_wall_clock_of_issuing() -> None:
    dev = FakeDevice()
    clock = Clock(fake_torch(dev), "cuda")
    m = clock.host_us(call_taking(dev, 1.0, host_s=0.002))
    assert 1500.0 < m["us"] < 200_000.0 and m["kind"] == "host"
    assert len(m["samples_us"]) == 5


def test_without_sleep_the_method_says_launch_gaps_are_included() -> None:
    dev = FakeDevice()
    clock = Clock(fake_torch(dev, with_sleep=False), "cuda")
    assert clock.cycles_per_us is None
    assert "launch gaps included" in clock.method["device"]
    assert clock.device_us(call_taking(dev, 40.0))["us"] == pytest.approx(40.0)


def test_calls_time_each_call_after_an_l2_flush() -> None:
    dev = FakeDevice()
    clock = Clock(fake_torch(dev), "cuda", warmup_ms=1.0, rep_ms=2.0)
    fn = call_taking(dev, 100.0)
    t = clock.calls(fn)
    assert t["median_us"] == pytest.approx(100.0) and t["max_us"] == pytest.approx(100.0)
    # the estimate (three calls, flushes included) is 0.18 ms a call: 2 ms / 0.18 = 11 timed
    # calls, 1 ms / 0.18 = 5 warm-up calls, after one first call
    assert t["n"] == 11 and t["method"] == "cuda events per call, L2 flushed"
    assert len(fn.calls) == 1 + 3 + 5 + 11
    assert dev.flushes == 3 + 11  # the estimate and every timed call, not the warm-up
    clock.calls(fn, flush_l2=False)
    assert dev.flushes == 3 + 11


def test_back_to_back_reports_device_and_host_time_per_call() -> None:
    dev = FakeDevice()
    clock = Clock(fake_torch(dev), "cuda")
    t = clock.back_to_back(call_taking(dev, 7.0), calls=10, rounds=3)
    assert t["median_us"] == pytest.approx(7.0) and t["n"] == 3
    assert t["calls_per_round"] == 10 and t["host_us"] >= 0.0
    assert dev.flushes == 0


def test_a_step_runs_until_its_time_is_spent_within_bounds() -> None:
    dev = FakeDevice()
    clock = Clock(fake_torch(dev), "cuda")
    fn = call_taking(dev, 30_000.0)  # 30 ms: four steps reach 100 ms
    t = clock.step(fn, rep_ms=100.0)
    assert t["us"] == pytest.approx(30_000.0) and len(t["samples_us"]) == 4
    assert dev.flushes == 4
    assert len(clock.step(call_taking(dev, 1.0), rep_ms=100.0)["samples_us"]) == 10
    assert len(clock.step(call_taking(dev, 1e6), rep_ms=100.0)["samples_us"]) == 2


def test_on_a_cpu_every_method_says_it_is_not_a_measurement() -> None:
    clock = Clock(None, "cpu")
    calls: list[int] = []

    def fn() -> None:
        calls.append(1)

    assert "dry run" in clock.calls(fn)["method"] and len(calls) == 4
    assert "dry run" in clock.back_to_back(fn, calls=2, rounds=1)["method"]
    assert "dry run" in clock.step(fn, rep_ms=1.0)["method"]
    assert clock.device_us(fn)["kind"] == "device" and "dry run" in clock.method["device"]
    assert clock.cycles_per_us is None


def test_spread_quantiles() -> None:
    s = spread([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (3.0, 1.0, 5.0, 5)
    assert s["p20"] == pytest.approx(1.8) and s["p80"] == pytest.approx(4.2)
    with pytest.raises(ValueError):
        spread([])


def test_eager_time_is_events_around_the_call_with_nothing_queued() -> None:
    dev = FakeDevice()
    clock = Clock(fake_torch(dev), "cuda", min_reps=4)
    fn = call_taking(dev, 25.0)
    m = clock.eager_us(fn)
    assert m["us"] == pytest.approx(25.0) and len(m["samples_us"]) == 4
    assert len(fn.calls) == 1 + 4 and dev.flushes == 0 and dev.sleeps == []


def test_interleaved_calls_share_a_drift_that_sequential_calls_would_split() -> None:
    # Two calls of the same device time on a device that turns 10% slower part way through
    # the run (a clock or memory mode): timed one after the other, the second lands in the
    # slow stretch and looks 10% slower; interleaved, both see the same stretches.
    def run(interleaved: bool) -> dict[str, dict[str, Any]]:
        dev = FakeDevice()
        clock = Clock(fake_torch(dev), "cuda")
        issued = {"n": 0}

        def call(name: str) -> Any:
            def fn() -> None:
                issued["n"] += 1
                dev.advance_us(250.0 * (1.1 if issued["n"] > 600 else 1.0))
            return fn

        fns = {"a": call("a"), "b": call("b")}
        if interleaved:
            return clock.interleaved(fns)
        return {name: clock.calls(fn) for name, fn in fns.items()}

    apart = run(interleaved=False)
    assert apart["b"]["median_us"] / apart["a"]["median_us"] == pytest.approx(1.1, rel=1e-3)
    together = run(interleaved=True)
    assert together["b"]["median_us"] / together["a"]["median_us"] == pytest.approx(1.0,
                                                                                  abs=1e-3)
    assert together["a"]["n"] == together["b"]["n"] >= 10
    assert "interleaved with 1 other" in together["a"]["method"]


def test_interleaved_rotates_the_order_and_flushes_before_every_timed_call() -> None:
    dev = FakeDevice()
    clock = Clock(fake_torch(dev), "cuda", warmup_ms=0.0, rep_ms=0.0)
    order: list[str] = []

    def call(name: str) -> Any:
        def fn() -> None:
            order.append(name)
            dev.advance_us(100.0)
        return fn

    flushes_before = dev.flushes
    got = clock.interleaved({n: call(n) for n in "xyz"})
    # each timed call: 10 rounds (the floor) of 3, each round starting one further along
    timed = order[-30:]
    assert [timed[i * 3] for i in range(4)] == ["x", "y", "z", "x"]
    assert all(sorted(timed[i * 3:i * 3 + 3]) == ["x", "y", "z"] for i in range(10))
    assert {m["n"] for m in got.values()} == {10}
    assert all(m["median_us"] == pytest.approx(100.0) for m in got.values())
    # 3 estimate calls each, flushed, then every timed call
    assert dev.flushes - flushes_before == 3 * 3 + 30
