"""The shape and memory ledgers (:mod:`rljax.trace.ledger`), written once after the first step
that generated a batch; their time is counted apart from the tracer's per-step overhead."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping, Optional

from rljax.trace.ledger import LedgerInput, write_ledgers

log = logging.getLogger("rljax.trace")


class Ledgers:
    """Writes the ledgers once (``trace.ledgers``); keeps the compiled peak the memory alert compares with."""

    def __init__(self, run_dir: str, mesh, *, wanted: bool, enabled: bool,
                 sources: Optional[Callable[[], Mapping[str, Any]]] = None):
        self.run_dir, self.mesh, self.enabled, self.sources = run_dir, mesh, enabled, sources
        self.done = not wanted
        self.compiled_peak: Optional[int] = None
        self.last_s = 0.0  # this step's seconds writing them
        self.total_s = 0.0

    def step(self, view) -> None:
        """The first time: both ledgers from the step's fields as the stages produced them."""
        self.last_s = 0.0
        if self.done:
            return
        t = time.perf_counter()
        self.done = True
        try:
            if self.enabled:
                self.compiled_peak = write_ledgers(LedgerInput(
                    run_dir=self.run_dir, step=view.step, mesh=self.mesh, traj=view.traj, fields=view.fields,
                    producers=view.producers, consumers=view.consumers,
                    sources=self.sources() if self.sources else None))
        except Exception as e:  # a ledger must never stop training
            log.warning("rljax.trace: ledgers not written: %s: %s", type(e).__name__, e)
        self.last_s = time.perf_counter() - t
        self.total_s += self.last_s
