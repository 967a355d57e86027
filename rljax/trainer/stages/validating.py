"""Validation's stages: a held-out batch generated with ``rollout.val_kwargs`` and scored.

:class:`rljax.trainer.loop.Trainer` runs this list with a
:class:`~rljax.trainer.runner.StepRunner`, as the step's (same declarations, same checks),
over this process's share of each held-out batch, then merges every process's rows. The
rollout goes through the run's client (single-turn or episodes), the reward through
:func:`~rljax.trainer.stages.rewarding.task_scores` with the process's error bound.
"""

from __future__ import annotations

import numpy as np

from rljax.trace.samples import sample_rows
from rljax.trainer.runner import stage
from rljax.trainer.services import Services
from rljax.trainer.stages.rewarding import task_scores


@stage("val_rollout", timing="val_gen", reads=("prompts", "uids"), writes=("trajectories",),
       config=("rollout.val_kwargs.n",), only="validation",
       summary="prompts, uids -> trajectories (rollout.val_kwargs decoding)")
def val_rollout(s: Services, b) -> dict:
    return {"trajectories": s.rollout.client.generate(b["prompts"], b["uids"], n=s.cfg.rollout.val_kwargs.n,
                                                      decode=s.rollout.val_decode)}


@stage("val_reward", timing="val_reward", reads=("trajectories", "prompts"), writes=("scores", "reward_report"),
       config=("reward.max_error_fraction",), only="validation",
       summary="trajectories, prompts -> scores, reward_report (the task reward)")
def val_reward(s: Services, b) -> dict:
    bound = s.rollout.share.local_bound(s.cfg.reward.max_error_fraction)
    scores, report = task_scores(s, b["trajectories"], b["prompts"], max_error_fraction=bound)
    return {"scores": scores, "reward_report": report}


@stage("val_rows", timing="val_rows", reads=("step", "trajectories", "prompts", "scores", "reward_report",
                                             "sample_limit"),
       writes=("metrics",), only="validation", options=("by_source",),
       summary="-> metrics: the rows' scores, padding and tool use, the reward counts, the first sample records")
def val_rows(s: Services, b, *, by_source=None) -> dict:
    """What validation keeps of a batch (host copies: the batch is dropped after the list); the
    rows by data source into ``by_source`` (:class:`rljax.reward.ValidationBySource`)."""
    traj, got, report, limit = b["trajectories"], b["scores"], b["reward_report"], b["sample_limit"]
    if by_source is not None:
        s.rollout.client.by_source(by_source, traj, b["prompts"], got, report)
    rows = {"scores": np.array(got, np.float64), "is_padding": np.array(traj.is_padding, bool),
            **s.rollout.client.row_facts(traj)}  # multi-turn: held-out tool use
    samples = sample_rows(traj, b["prompts"], got, decode=s.rollout.tokenizer.decode, step=b["step"], split="val",
                          limit=limit) if limit > 0 else []
    return {"metrics": {"rows": rows, "counts": (report.errors, report.num_scored), "samples": samples}}


#: Validation's stages, in order.
STAGES = (val_rollout, val_reward, val_rows)


def stages(s: Services, *, by_source=None) -> list:
    """Validation's stage list bound to the services ``s`` (``by_source``: the data-source collector)."""
    return [val_rollout.stage.bind(s), val_reward.stage.bind(s), val_rows.stage.bind(s, by_source=by_source)]
