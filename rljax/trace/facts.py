"""What a stage's trace facts see of one traced prompt group, and the helpers they share.

A stage (:class:`rljax.trainer.runner.Stage`) may carry ``facts(event, view) -> dict``: the
stage's own account of what it did for one traced group (versions, sizes, statuses), written
into that group's record of the stage. The function lives beside the stage and travels in
the stage event; the tracer calls it with a :class:`GroupView` at the end of the step and
keeps no table of stage names. Facts only read (host copies of the traced rows at most).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import numpy as np

from rljax.trace.fields import host_rows


@dataclasses.dataclass(frozen=True)
class GroupView:
    """One traced prompt group at the end of a step.

    Attributes:
      step: the step.
      group: the group's index in the batch.
      rows: the group's non-padding rows in ``traj`` (this process's trajectories).
      key_of: row -> trajectory key ``{uid}_{session}_{index}``.
      traj: this process's trajectories (the rollout's host arrays).
      fields: the newest value of every field of the step.
      is_padding: ``[B]`` padding rows of the learner batch (every process's rows).
      response_length: ``[B]`` response lengths of the learner batch's rows.
      row_tokens: ``[B]`` loss tokens per row of the ``loss_mask`` the update consumed, or None.
      wall: ``time.perf_counter()`` value -> Unix seconds (rounded), as the records' timestamps.
    """

    step: int
    group: int
    rows: np.ndarray
    key_of: Mapping[int, str]
    traj: Any
    fields: Mapping[str, Any]
    is_padding: np.ndarray
    response_length: np.ndarray
    row_tokens: Optional[np.ndarray]
    wall: Callable[[Optional[float]], Optional[float]]


def message_count(prompt, system_prompt: Optional[str] = None) -> int:
    """Messages of a chat prompt: the message list's length, plus the ``data.system_prompt``
    the formatter puts first when the chat has no system message; 1 for a text prompt."""
    if isinstance(prompt, str):
        return 1
    msgs = list(prompt)
    return len(msgs) + (system_prompt is not None and not any(m.get("role") == "system" for m in msgs))


def padding_abs_sum(x, pad: np.ndarray) -> Optional[float]:
    """Sum of |x| over the padding rows (0.0 without padding rows; reads only their shards)."""
    if x is None or not pad.any():
        return 0.0
    v = host_rows(x, np.nonzero(pad)[0])
    return None if v is None else float(np.abs(v).sum())


def number(v) -> Optional[float]:
    """``float(v)`` when finite, else None (JSON has no NaN)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if np.isfinite(f) else None
