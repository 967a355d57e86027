"""The stages of one RL step, each declared once beside its function.

A stage is a function ``fn(services, batch)`` (or ``fn(services, state, batch)``, see
:data:`rljax.trainer.runner.STATE_MODES`) with a :func:`~rljax.trainer.runner.stage`
declaration on top: its name, timing key, the batch fields it reads and writes, the
configuration keys it reads, how it relates to the run state, its trace facts and when it is
in the step. :class:`~rljax.trainer.runner.StepRunner` enforces the declaration: an
undeclared field or configuration key read, an undeclared field written, a declared state
change not made, each stops the step with one line naming the stage.

The modules, by job:

* :mod:`~rljax.trainer.stages.producing`: ``dataset_item``, ``rollout_sessions`` (single-turn,
  episodes or filtered), ``trajectory_fields``;
* :mod:`~rljax.trainer.stages.rewarding`: ``reward_model``, ``reward_judge``, ``reward``,
  ``gather_rollout`` (scoring, combining, overlong shaping, the error bound);
* :mod:`~rljax.trainer.stages.learning`: ``old_log_prob``, ``reference``, ``teacher``, ``values``,
  ``advantages``, ``kl_controller``, ``update_critic``, ``actor_minibatch``;
* :mod:`~rljax.trainer.stages.publishing`: ``weight_sync``, ``metrics``.

:data:`STEP` lists the functions in the order of a step; :func:`sync_stages` binds those
that apply to a run. ``docs/concepts/stage-flow.md`` is generated from the declarations
(:mod:`rljax.trainer.stages.page`). How to add a stage: ``docs/development.md``.
"""

from __future__ import annotations

from typing import Callable, Optional

from rljax.trainer.runner import Stage, StageSpec
from rljax.trainer.stages import learning, producing, publishing, rewarding
from rljax.trainer.stages.learning import (actor_batch, actor_minibatch, actor_minibatch_facts, advantages,
                                           advantages_facts, kl_controller, old_log_prob, reference, rollout_mismatch,
                                           teacher, update_critic, values)
from rljax.trainer.stages.producing import (check_weight_version, dataset_item, dataset_item_facts, draw_prompts,
                                            learner_layout, prompt_longest, prompt_width, rollout_facts,
                                            rollout_filtered, rollout_sessions, trajectory_fields,
                                            trajectory_fields_facts)
from rljax.trainer.stages.publishing import metrics_facts, step_metrics, weight_sync, weight_sync_facts
from rljax.trainer.stages.rewarding import (MODEL_INPUTS, combine, gather_rollout, model_inputs, overlong_penalty,
                                            overlong_shaping, response_digest, reward, reward_facts, reward_judge,
                                            reward_model, score, task_scores)

#: Every stage function in the order of a step (each module's ``STAGES``, by job); variants of one
#: stage (``when`` chooses) side by side.
STEP = (*producing.STAGES, *rewarding.STAGES, *learning.STAGES, *publishing.STAGES)


def specs(fns=STEP) -> list[StageSpec]:
    """The declarations of ``fns`` (stage functions), in order."""
    return [fn.stage for fn in fns]


def _union(what: str) -> dict:
    out: dict = {}
    for spec in specs():
        out[spec.name] = tuple(dict.fromkeys((*out.get(spec.name, ()), *getattr(spec, what))))
    return out


#: The fields each stage name may read / write, over its variants: derived from the declarations
#: (for code that builds stand-in stages of the same names, such as the trace's tests).
READS, WRITES = _union("reads"), _union("writes")


def sync_stages(s, *, on_chunk: Optional[Callable] = None, fns=STEP) -> list[Stage]:
    """The stage list of a synchronous step for this run: every declared stage of ``fns`` whose
    ``when`` holds, bound to the services ``s``. ``on_chunk``: called by the sampler between
    decode chunks (the asynchronous producer installs weight pushes there with
    ``async_training.partial_rollout``), for the stages that take it."""
    out = []
    for spec in specs(fns):
        if spec.applies(s):
            out.append(spec.bind(s, **({"on_chunk": on_chunk} if "on_chunk" in spec.options else {})))
    return out


__all__ = ["MODEL_INPUTS", "READS", "STEP", "WRITES", "actor_minibatch_facts", "advantages_facts",
           "dataset_item_facts", "metrics_facts", "reward_facts", "rollout_facts", "trajectory_fields_facts",
           "weight_sync_facts", "actor_batch", "check_weight_version", "combine", "draw_prompts",
           "kl_controller", "learner_layout", "model_inputs", "overlong_penalty", "overlong_shaping",
           "prompt_longest", "prompt_width", "response_digest", "rollout_mismatch", "score", "specs",
           "sync_stages", "task_scores",
           # the stage functions (their declarations: fn.stage)
           "dataset_item", "rollout_sessions", "rollout_filtered", "trajectory_fields", "reward_model", "reward_judge",
           "reward", "gather_rollout", "old_log_prob", "reference", "teacher", "values", "advantages", "kl_controller",
           "update_critic", "actor_minibatch", "weight_sync", "step_metrics"]
