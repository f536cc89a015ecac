"""Progress lines of long runs (``attnreg calibrate``, ``python -m benchmarks``).

One line per step on stderr, ``[  12.3s] 3 of 14: what (about 40 s left)``:
plain lines rather than a redrawn bar, so a log file of a batch run reads
the same as the terminal.  Shown when stderr is a terminal; ``force`` shows
them anyway (a batch run that wants them in its log), ``quiet`` never.
stdout is left alone, so ``--json`` output stays one document.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "format_seconds"]


def format_seconds(seconds: float) -> str:
    """``"42 s"``, ``"3 min 5 s"``: how long, for a person."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes} min {rest} s" if rest else f"{minutes} min"


class Progress:
    """Numbered step lines with the elapsed time and an estimate of the time left.

    Parameters
    ----------
    total
        How many steps the run has (N of "i of N").
    enabled
        Whether lines are printed; see :meth:`for_terminal` for the usual rule.
    stream
        Where lines go (default: ``sys.stderr`` at the time of each line).
    budget_s
        A time budget the run stops starting steps after: the estimate never
        says more than what is left of it.
    clock
        Seconds since an arbitrary point (``time.perf_counter``; tests pass their own).
    """

    def __init__(self, total: int, *, enabled: bool = True, stream: TextIO | None = None,
                 budget_s: float | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 started: float | None = None) -> None:
        self.total = total
        self.enabled = enabled
        self._stream = stream
        self.budget_s = budget_s
        self._clock = clock
        self.started = clock() if started is None else started
        self.index = 0

    @classmethod
    def for_terminal(cls, total: int, *, quiet: bool = False, force: bool = False,
                     stream: TextIO | None = None, **kwargs: object) -> Progress:
        """Lines on when ``stream`` (default stderr) is a terminal or ``force``; off if ``quiet``."""
        target = stream if stream is not None else sys.stderr
        isatty = getattr(target, "isatty", None)
        on = (force or bool(isatty and isatty())) and not quiet
        return cls(total, enabled=on, stream=stream, **kwargs)  # type: ignore[arg-type]

    def elapsed_s(self) -> float:
        return self._clock() - self.started

    def left_s(self) -> float | None:
        """Estimated seconds until the last step ends; None before any step has ended.

        The mean time of the steps so far times the steps not yet ended
        (counting the one that starts now), capped by what is left of the budget.
        """
        done = self.index - 1
        if done < 1:
            return None
        return self._capped(self.elapsed_s() / done * (self.total - done))

    def _capped(self, left: float) -> float:
        if self.budget_s is not None:
            left = min(left, max(0.0, self.budget_s - self.elapsed_s()))
        return left

    def step(self, what: str, *, left_s: float | None = None) -> str:
        """Start the next step: its line (printed when enabled).

        ``left_s``: the caller's own estimate of the time left (it knows what
        the remaining steps are, :class:`attnreg.testing.progress.ClaimProgress`),
        used instead of :meth:`left_s`'s mean; capped by the budget all the same.
        """
        self.index += 1
        left = self.left_s() if left_s is None else self._capped(left_s)
        tail = "" if left is None else f" (about {format_seconds(left)} left)"
        line = f"[{self.elapsed_s():6.1f}s] {self.index} of {self.total}: {what}{tail}"
        self.note(line)
        return line

    def note(self, line: str) -> None:
        """Print ``line`` as is (when enabled): a result of the current step, say."""
        if self.enabled:
            stream = self._stream if self._stream is not None else sys.stderr
            print(line, file=stream, flush=True)
