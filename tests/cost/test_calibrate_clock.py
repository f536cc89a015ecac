"""The CUDA timing logic of `attnreg calibrate`, on a simulated device.

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

from attnreg.commands.calibrate import Clock

CYCLES_PER_US = 1500.0


class FakeDevice:
    def __init__(self) -> None:
        self.now_ms = 0.0
        self.sleeps: list[int] = []

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
