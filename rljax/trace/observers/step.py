"""The step as the tracer's parts see it at its end (:class:`StepView`): built once from the
stage events, dropped with its arrays when the step's trace is done."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional


@dataclasses.dataclass
class StepView:
    """One step's stage events and the fields they carried.

    Attributes:
      step: the step.
      events: the stage events, in the order the stages ran.
      fields: the newest value of every field of the step.
      consumers: field -> the stages that read it, in order.
      producers: field -> the stage that wrote it (the newest writer).
    """

    step: int
    events: list
    fields: dict
    consumers: dict
    producers: dict

    @classmethod
    def of(cls, step: int, events: list) -> "StepView":
        fields: dict = {}
        consumers: dict = {}
        producers: dict = {}
        for ev in events:
            fields.update(ev.reads)
            fields.update(ev.writes)
            producers.update(ev.producers)
            for k in ev.reads:
                consumers.setdefault(k, []).append(ev.stage)
        return cls(step=int(step), events=events, fields=fields, consumers=consumers, producers=producers)

    @property
    def traj(self) -> Any:
        """This process's trajectories (None: no rollout this step)."""
        return self.fields.get("trajectories")

    @property
    def rows_view(self) -> Any:
        """Several processes: every process's row facts (``rollout_rows``); None on one process."""
        return self.fields.get("rollout_rows")

    @property
    def rows(self) -> Any:
        """The learner batch's rows: every process's row facts, or this process's trajectories."""
        return self.rows_view if self.rows_view is not None else self.traj

    @property
    def loss_mask(self) -> Optional[Any]:
        """The learner's ``loss_mask`` as the step left it (what the update consumed)."""
        return self.fields.get("loss_mask")
