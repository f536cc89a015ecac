"""How attnreg times a call: one :class:`Clock` with one L2-flush buffer, and :func:`spread`.

Every timed figure of ``attnreg calibrate`` and of ``benchmarks/`` comes from
one of the :class:`Clock` methods below; they differ in what they let the
host do between calls, which is the point of each:

* :meth:`Clock.calls` -- CUDA events around each call, the L2 flushed before
  each, ``warmup_ms`` of warm-up then about ``rep_ms`` of calls queued back to
  back (the benchmarks' kernel and replay times);
* :meth:`Clock.interleaved` -- :meth:`Clock.calls` for several calls whose timed
  calls alternate, so their ratios compare calls timed under the same conditions;
* :meth:`Clock.back_to_back` -- events around a loop of calls with no flush
  and no sync: host cost shows where the host is slower than the device;
* :meth:`Clock.step` -- events around one whole step with the device idle
  before it (host work inside the step counts);
* :meth:`Clock.device_us` / :meth:`Clock.host_us` -- a call's device time with
  the stream held back by ``torch.cuda._sleep`` so the host has queued all of
  it first (as a graph replay runs), and the host time to issue it;
* :meth:`Clock.eager_us` -- events around an eager call with nothing queued
  before it (host cost included).

On a CPU (dry runs) every method falls back to the wall clock and says so:
those times are not measurements.  torch is passed in, so importing this
module never imports it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["FLUSH_BYTES", "Clock", "spread"]

#: L2 flush buffer: five times the H200's 50 MB L2, so nothing of the previous call survives.
FLUSH_BYTES = 256 * 2 ** 20
_DRY = "wall clock on cpu (dry run, not a measurement)"


def spread(samples: Sequence[float]) -> dict[str, float]:
    """Median, 20th / 80th percentiles, min and max of timing samples.

    >>> s = spread([5.0, 1.0, 3.0, 2.0, 4.0])
    >>> s["median"], s["min"], s["max"], s["n"]
    (3.0, 1.0, 5.0, 5)
    """
    xs = sorted(float(s) for s in samples)
    if not xs:
        raise ValueError("no samples")

    def quantile(q: float) -> float:
        # linear interpolation between closest ranks (numpy's default)
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"median": statistics.median(xs), "p20": quantile(0.2), "p80": quantile(0.8),
            "min": xs[0], "max": xs[-1], "n": len(xs)}


def _timing(samples_us: list[float], method: str) -> dict[str, Any]:
    s = spread(samples_us)
    return {"median_us": s["median"], "p20_us": s["p20"], "p80_us": s["p80"],
            "min_us": s["min"], "max_us": s["max"], "n": s["n"], "method": method}


def _calls_method(flush_l2: bool) -> str:
    return "cuda events per call, L2 flushed" if flush_l2 else "cuda events per call"


def _sample(samples: list[float], flags: list[str], kind: str) -> dict[str, Any]:
    return {"us": statistics.median(samples), "samples_us": [round(s, 3) for s in samples],
            "kind": kind, "flags": flags}


class Clock:
    """Times calls on ``device``; owns the one L2-flush buffer (allocated on first use).

    Parameters
    ----------
    torch : module
    device : str
        ``cuda...`` times with CUDA events; anything else with the wall clock.
    warmup_ms, rep_ms : float
        Warm-up and timed span of :meth:`calls`.
    target_ms, min_reps, max_reps
        Repetitions of :meth:`device_us`: about ``target_ms`` of calls, clamped.
    """

    def __init__(self, torch: Any, device: str, *, warmup_ms: float = 25.0,
                 rep_ms: float = 100.0, target_ms: float = 40.0, min_reps: int = 3,
                 max_reps: int = 15) -> None:
        self.torch = torch
        self.cuda = str(device).startswith("cuda")
        self.device = device
        self.warmup_ms = warmup_ms
        self.rep_ms = rep_ms
        self.target_ms = target_ms
        self.min_reps = min_reps
        self.max_reps = max_reps
        self._flush_buf: Any = None
        self._rate: float | None = None
        self._rate_known = False

    # -- the device ------------------------------------------------------------------
    def flush_l2(self) -> None:
        """Overwrite the L2 with a write far larger than it."""
        if self._flush_buf is None:
            self._flush_buf = self.torch.empty(FLUSH_BYTES, dtype=self.torch.int8,
                                               device=self.device)
        self._flush_buf.zero_()

    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _events(self) -> tuple[Any, Any]:
        ev = self.torch.cuda.Event
        return ev(enable_timing=True), ev(enable_timing=True)

    @property
    def cycles_per_us(self) -> float | None:
        """Clock rate of ``torch.cuda._sleep`` (measured once); None where it is missing."""
        if self.cuda and not self._rate_known:
            self._rate = self._sleep_rate()
            self._rate_known = True
        return self._rate

    def _sleep_rate(self) -> float | None:
        torch = self.torch
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is None:
            return None
        sleep(1000)
        torch.cuda.synchronize()
        start, end = self._events()
        cycles = 2_000_000
        start.record()
        sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        us = start.elapsed_time(end) * 1e3
        return cycles / us if us > 0 else None

    def _stall(self, us: float) -> None:
        if self.cycles_per_us:
            self.torch.cuda._sleep(int(us * self.cycles_per_us))

    def _wall(self, fn: Callable[[], Any], reps: int) -> list[float]:
        samples = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return samples

    # -- benchmarks ------------------------------------------------------------------
    def calls(self, fn: Callable[[], Any], *, flush_l2: bool = True) -> dict[str, Any]:
        """Median time of one call of ``fn`` in microseconds, with its spread.

        CUDA: events around each call, L2 flushed before each (unless
        ``flush_l2=False``), ``warmup_ms`` of warm-up and about ``rep_ms`` of
        timed calls (at least 3).  CPU (dry run): wall clock of 3 calls.

        Returns
        -------
        dict
            ``median_us``, ``p20_us``, ``p80_us``, ``min_us``, ``max_us``, ``n``, ``method``.
        """
        if not self.cuda:
            fn()
            return _timing(self._wall(fn, 3), _DRY)
        torch = self.torch
        flush = self.flush_l2 if flush_l2 else None
        est_ms = self._estimate_ms(fn, flush)
        n_warm = self._warmups(est_ms)
        n_rep = self._reps(est_ms)
        for _ in range(n_warm):
            fn()
        events = [self._events() for _ in range(n_rep)]
        for s, e in events:
            if flush:
                flush()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) * 1e3 for s, e in events]
        return _timing(samples, _calls_method(flush_l2))

    def _estimate_ms(self, fn: Callable[[], Any], flush: Callable[[], None] | None) -> float:
        """One call's time in ms from 3 (after one untimed call): what :meth:`calls` and
        :meth:`interleaved` size their repetitions by."""
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        start, end = self._events()
        start.record()
        for _ in range(3):
            if flush:
                flush()
            fn()
        end.record()
        torch.cuda.synchronize()
        return max(start.elapsed_time(end) / 3, 1e-3)

    def _warmups(self, ms: float) -> int:
        """Untimed calls (or rounds) of ``ms`` each filling about ``warmup_ms``."""
        return int(min(max(self.warmup_ms / ms, 1), 500))

    def _reps(self, ms: float) -> int:
        """Timed calls of ``ms`` each filling about ``rep_ms`` (at least 10; 3 for calls
        over 20 ms)."""
        return int(min(max(self.rep_ms / ms, 3 if ms > 20 else 10), 2000))

    def interleaved(self, fns: Mapping[str, Callable[[], Any]], *, flush_l2: bool = True
                    ) -> dict[str, dict[str, Any]]:
        """:meth:`calls` for several calls at once, their timed calls interleaved.

        Each round calls every ``fn`` once (L2 flushed and CUDA events around each, as
        :meth:`calls`), starting one further along each round, so a drift of the
        device's speed during the run (a clock or memory mode the replays fall into
        for a while) reaches every call alike instead of whichever was timed then: a
        ratio of two of these times compares like with like.  The rounds are as many
        as :meth:`calls` would give the slowest ``fn`` (at least 10).  CPU (dry run):
        :meth:`calls` of each.

        Returns
        -------
        dict
            Per name, what :meth:`calls` returns (``method`` says "interleaved").
        """
        names = list(fns)
        if not self.cuda or len(names) < 2:
            return {name: self.calls(fns[name], flush_l2=flush_l2) for name in names}
        torch = self.torch
        flush = self.flush_l2 if flush_l2 else None
        est_ms = {name: self._estimate_ms(fns[name], flush) for name in names}
        n_warm = self._warmups(sum(est_ms.values()))
        rounds = self._reps(max(est_ms.values()))
        for _ in range(n_warm):
            for name in names:
                fns[name]()
        # created before the timed rounds, as calls() does: the host only queues there
        events = {name: [self._events() for _ in range(rounds)] for name in names}
        for r in range(rounds):
            for i in range(len(names)):
                name = names[(r + i) % len(names)]
                s, e = events[name][r]
                if flush:
                    flush()
                s.record()
                fns[name]()
                e.record()
        torch.cuda.synchronize()
        method = f"{_calls_method(flush_l2)}, interleaved with {len(names) - 1} other calls"
        return {name: _timing([s.elapsed_time(e) * 1e3 for s, e in events[name]], method)
                for name in names}

    def back_to_back(self, fn: Callable[[], Any], *, calls: int = 200,
                     rounds: int = 5) -> dict[str, Any]:
        """Per-call time of ``calls`` calls issued back to back (no flush, no sync between).

        This is what an engine's eager loop sees: when the host issues calls
        slower than the device runs them, the host cost shows up here.  Also
        records the host time per call (``host_us``): the time to *issue* them.
        """
        calls, rounds = max(1, calls), max(1, rounds)
        dev, host = [], []
        fn()
        self.sync()
        for _ in range(rounds):
            if self.cuda:
                s, e = self._events()
                s.record()
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                host.append((time.perf_counter() - t0) * 1e6 / calls)
                e.record()
                self.torch.cuda.synchronize()
                dev.append(s.elapsed_time(e) * 1e3 / calls)
            else:
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                host.append((time.perf_counter() - t0) * 1e6 / calls)
                dev.append(host[-1])
        out = _timing(dev, "cuda events around back-to-back calls" if self.cuda else _DRY)
        out["host_us"] = spread(host)["median"]
        out["calls_per_round"] = calls
        return out

    def step(self, fn: Callable[[], Any], *, rep_ms: float, max_reps: int = 10
             ) -> dict[str, Any]:
        """Median time of a whole step, host work included: the device idles before each.

        CUDA: synchronise, flush the L2, events around the step; at least 2
        steps, then more until ``rep_ms`` is spent (at most ``max_reps``).
        CPU (dry run): wall clock of 2 steps.
        """
        if not self.cuda:
            wall = self._wall(fn, 2)
            return {"us": statistics.median(wall), "samples_us": wall,
                    "method": "wall clock on cpu (dry run: not a measurement)"}
        torch = self.torch
        samples: list[float] = []
        spent_ms = 0.0
        while len(samples) < 2 or (spent_ms < rep_ms and len(samples) < max_reps):
            torch.cuda.synchronize()
            self.flush_l2()
            start, end = self._events()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
            spent_ms += samples[-1] / 1e3
        return {"us": statistics.median(samples), "samples_us": [round(s, 2) for s in samples],
                "method": "cuda events around the step, L2 flushed, median"}

    # -- calibration -----------------------------------------------------------------
    @property
    def method(self) -> dict[str, str]:
        """How :meth:`device_us` and :meth:`host_us` measure, for the profile JSON."""
        if not self.cuda:
            return {"device": "wall clock on cpu (dry run: not a measurement)",
                    "host": "wall clock on cpu (dry run: not a measurement)"}
        stall = ("stream held back with torch.cuda._sleep" if self.cycles_per_us
                 else "torch.cuda._sleep unavailable: launch gaps included")
        return {"device": f"CUDA events per call, {stall}, L2 flushed, median",
                "host": f"perf_counter around issuing the call, {stall}, median"}

    def reps_for(self, estimate_us: float) -> int:
        """Timed calls for a call of about ``estimate_us``: ``target_ms`` worth, clamped."""
        n = int(self.target_ms * 1e3 / max(estimate_us, 1.0))
        return max(self.min_reps, min(self.max_reps, n))

    def _probe(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """One call: (host time to issue it, device time with events around it), us."""
        torch = self.torch
        start, end = self._events()
        torch.cuda.synchronize()
        start.record()
        t0 = time.perf_counter()
        fn()
        host = (time.perf_counter() - t0) * 1e6
        end.record()
        torch.cuda.synchronize()
        return host, start.elapsed_time(end) * 1e3

    def device_us(self, fn: Callable[[], Any]) -> dict[str, Any]:
        """Median device time of ``fn`` (call it once before, to compile and plan).

        The stream is held back long enough for the host to queue the whole
        call, so no launch gap is timed; a sample whose issuing took the host
        most of the stall is flagged ``host_blocked`` (its time may hold gaps).
        """
        if not self.cuda:
            return _sample(self._wall(fn, self.min_reps), [], "device")
        torch = self.torch
        rate = self.cycles_per_us
        host, estimate = self._probe(fn)
        stall_us = min(max(3.0 * host + 200.0, 500.0), 500_000.0)
        samples, flags = [], []
        for _ in range(self.reps_for(estimate)):
            torch.cuda.synchronize()
            start, end = self._events()
            t0 = time.perf_counter()
            self._stall(stall_us)
            self.flush_l2()
            start.record()
            fn()
            end.record()
            issued_us = (time.perf_counter() - t0) * 1e6
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
            if rate and issued_us >= 0.9 * stall_us:
                flags.append("host_blocked")
        return _sample(samples, sorted(set(flags)), "device")

    def host_us(self, fn: Callable[[], Any]) -> dict[str, Any]:
        """Median host time to issue ``fn`` while the device is held back (call it once before)."""
        if not self.cuda:
            return _sample(self._wall(fn, self.min_reps), [], "host")
        torch = self.torch
        rate = self.cycles_per_us
        host, _ = self._probe(fn)
        stall_us = min(max(3.0 * host + 500.0, 1000.0), 500_000.0)
        samples, flags = [], []
        for _ in range(max(self.min_reps, 5)):
            torch.cuda.synchronize()
            self._stall(stall_us)
            t0 = time.perf_counter()
            fn()
            issued_us = (time.perf_counter() - t0) * 1e6
            samples.append(issued_us)
            if rate and issued_us >= 0.9 * stall_us:
                flags.append("host_blocked")
        torch.cuda.synchronize()
        return _sample(samples, sorted(set(flags)), "host")

    def eager_us(self, fn: Callable[[], Any]) -> dict[str, Any]:
        """Events around an eager call with nothing queued before it (host cost included)."""
        if not self.cuda:
            return _sample(self._wall(fn, self.min_reps), [], "device")
        torch = self.torch
        fn()
        samples = []
        for _ in range(self.min_reps):
            torch.cuda.synchronize()
            start, end = self._events()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        return _sample(samples, [], "device")
