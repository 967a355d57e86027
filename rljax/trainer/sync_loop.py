"""Synchronous (colocated) training: the stage list run once per step, in order.

:class:`SyncSchedule` is the scheduler of ``trainer.mode=sync``: each step runs
:func:`rljax.trainer.stages.sync_stages` over one batch with a
:class:`~rljax.trainer.runner.StepRunner`, threading the
:class:`~rljax.trainer.state.RunState` through the stages, and records the data position
the step ended at. Its interface is :class:`~rljax.trainer.async_loop.AsyncSchedule`'s
(``step``, ``paused``, ``checkpoint_meta``, ``close``); neither holds the other or the
trainer.
"""

from __future__ import annotations

import contextlib
from typing import Optional

from rljax.trainer.runner import StepRunner


class SyncSchedule:
    """Runs ``stages`` step after step (see the module docstring)."""

    def __init__(self, services, stages, observers=()):
        self.services = services
        self.runner = StepRunner(stages, observers=observers)

    def step(self, state, step: int):
        """``(state, metrics, timings)`` after step ``step``."""
        state, metrics, timings = self.runner.run_state(state.replace(step=step), step, {"step": step})
        return state.replace(data=self.services.rollout.prompts.state()), metrics, timings

    def paused(self):
        """Validation between steps: nothing runs beside it."""
        return contextlib.nullcontext()

    def checkpoint_meta(self, state) -> dict:
        return {}

    def close(self) -> Optional[dict]:
        return None
