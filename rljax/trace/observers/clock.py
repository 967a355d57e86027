"""Stage time and the tracer's own overhead: the seconds each stage took over the run, the
stages in the order first seen, and the time spent inside the tracer (``trace/overhead_s``,
``trace/overhead_frac`` of the step time; the ledgers, written once, are counted apart).

``trace/overhead_s`` is the time the trainer's thread spends in the tracer: what the step waits
for. The tracer's background threads (the file writer, and on a CPU host the host copies'
prefetch) do the rest of its work meanwhile; their CPU seconds are ``trace/background_s``
(``trace/background_frac`` of the step time). On a host whose cores the step already keeps
busy (a 2-core CPU machine) that work competes with the step; on an accelerator's host it
runs on otherwise idle cores."""

from __future__ import annotations

import functools
import time
from typing import Optional

import numpy as np


class Clock:
    """The run's clock as the tracer keeps it."""

    def __init__(self):
        self.offset = time.time() - time.perf_counter()  # perf_counter -> Unix seconds
        self.spent = 0.0  # this step's seconds inside the tracer
        self.spent_total = 0.0
        self.background_total = 0.0
        self.step_total = 0.0
        self.fracs: list[float] = []
        self.steps = 0
        self.stage_total: dict[str, float] = {}
        self.stages_seen: list[str] = []
        self.t0 = 0.0  # the step's start (perf_counter)

    def wall(self, t_perf: Optional[float]) -> Optional[float]:
        """A ``time.perf_counter()`` value in Unix seconds, rounded to microseconds (None stays None)."""
        return None if t_perf is None else round(t_perf + self.offset, 6)

    def stages(self, events) -> None:
        """Each stage's time of the step, added to its total; a stage first seen joins the list."""
        for ev in events:
            self.stage_total[ev.stage] = self.stage_total.get(ev.stage, 0.0) + (ev.t_end - ev.t_start)
            if ev.stage not in self.stages_seen:
                self.stages_seen.append(ev.stage)

    def step_done(self, entered: float, ledger_s: float, background_s: float = 0.0) -> dict:
        """The step's overhead metrics: the tracer's time in the step (``entered``: when its end
        began; the ledgers' ``ledger_s`` aside) over the step's time, and ``background_s``, the CPU
        seconds of the tracer's background threads since the last step's; the counters restart."""
        self.spent += time.perf_counter() - entered - ledger_s
        step_s = time.perf_counter() - self.t0
        frac = self.spent / step_s if step_s > 0 else 0.0
        out = {"trace/overhead_s": self.spent, "trace/overhead_frac": frac, "trace/background_s": background_s,
               "trace/background_frac": background_s / step_s if step_s > 0 else 0.0}
        self.spent_total += self.spent
        self.background_total += background_s
        self.step_total += step_s
        self.fracs.append(frac)
        self.spent = 0.0
        self.steps += 1
        return out

    def summary(self) -> dict:
        """``trace_summary.json``'s stage time and overhead figures."""
        frac = self.spent_total / self.step_total if self.step_total > 0 else 0.0
        return {"stage_s": self.stage_total, "overhead_s": self.spent_total, "step_s": self.step_total,
                "overhead_frac": frac, "overhead_frac_median": float(np.median(self.fracs)) if self.fracs else 0.0,
                "overhead_frac_max": float(max(self.fracs, default=0.0)), "background_s": self.background_total,
                "background_frac": self.background_total / self.step_total if self.step_total > 0 else 0.0}


def timed(fn):
    """A tracer method whose time counts as the tracer's overhead (``self.clock.spent``)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.clock.spent += time.perf_counter() - t

    return wrapper
