"""On-policy distillation's teacher (``distillation.*``, verl's names): loaded beside the policy
on the learner mesh, it scores the sampled responses of every learner batch (the ``teacher``
stage, :mod:`rljax.trainer.stages.learning`), and the update pulls the policy toward it per token
(:func:`rljax.loss.with_distillation`, :class:`~rljax.loss.DistillationSpec` in the update's
:class:`~rljax.trainer.step.StepConfig`).

The teacher is ``distillation.teacher_model.model_path``: ``ref`` (the policy's initial weights:
the reference copy when the run keeps one, a LoRA actor's own base, else rebuilt as the trainer
built them) or a local Hugging Face causal-LM directory, loaded in ``model.dtype`` and sharded
like the policy. Its vocabulary must be the policy's: it reads the policy's token ids (the
preflight refuses another, :mod:`rljax.trainer._check`). Its log-probs are taken at the
update's temperature (``rollout.temperature``), so a teacher equal to the policy scores a
distillation loss of zero.

The pass writes ``teacher_logp [B, T]``: the teacher's log-prob of each sampled response token
(hidden state ``S - 1 + t`` predicts token ``t``, the policy's own alignment), through the same
fused log-prob as the policy's passes (no ``[B, T, V]`` logits).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax

from rljax import loss as rl
from rljax.config import Config
from rljax.models import functional as F
from rljax.models.hf import load_hf_checkpoint
from rljax.models.lora import disable
from rljax.trainer.judge import initial_policy_params
from rljax.trainer.services import Lazy
from rljax.trainer.step import make_logprob_fn

REF = "ref"


def distillation_spec(cfg: Config) -> Optional[rl.DistillationSpec]:
    """The update's :class:`~rljax.loss.DistillationSpec` of ``distillation.distillation_loss`` (None:
    ``distillation.enabled`` is false)."""
    if not cfg.distillation.enabled:
        return None
    d = cfg.distillation.distillation_loss
    return rl.DistillationSpec(loss_mode=d.loss_mode, topk=d.topk, use_task_rewards=d.use_task_rewards,
                               distillation_loss_coef=d.distillation_loss_coef, loss_max_clamp=d.loss_max_clamp,
                               log_prob_min_clamp=d.log_prob_min_clamp, use_policy_gradient=d.use_policy_gradient,
                               clip_ratio_low=d.clip_ratio_low, clip_ratio_high=d.clip_ratio_high)


class Teacher:
    """``teacher(state, inputs) -> {"teacher_logp": [B, T]}``: the teacher's pass over a learner
    batch's ``input_ids, attention_mask, positions`` (on the learner mesh, rows on ``dp``)."""

    def __init__(self, forward: Callable, params: Callable):
        self._forward, self._params = forward, params  # params(state): the teacher's weights now

    def __call__(self, state, inputs: dict) -> dict:
        return {"teacher_logp": self._forward(self._params(state), inputs)[0]}


def load_teacher(s) -> Teacher:
    """The :class:`Teacher` of ``distillation.teacher_model.model_path`` for the services ``s``."""
    cfg, mesh = s.cfg, s.mesh
    path = cfg.distillation.teacher_model.model_path
    if path == REF:
        graphdef = s.model.graphdef
        if s.learner.ref_params is not None:
            fixed = s.learner.ref_params
        elif s.learner.ref_is_base:  # LoRA: the actor's own base, adapters off (its arrays are the update's)
            fixed = None
        else:
            fixed = initial_policy_params(cfg, s.model.config, mesh)
        params = (lambda state: disable(state.actor.params)) if fixed is None else (lambda state: fixed)
    else:
        config, weights = load_hf_checkpoint(path, dtype=cfg.model.dtype, mesh=mesh)
        policy_vocab = s.model.config.vocab_size
        if config.vocab_size != policy_vocab:  # the preflight's check, for a program that skips it
            raise ValueError(f"distillation.teacher_model.model_path={path} has a vocabulary of {config.vocab_size} "
                             f"tokens, the policy's {policy_vocab}: the teacher reads the policy's token ids")
        graphdef = F.abstract_params(config.replace(scan_layers=cfg.model.scan_layers))[0]
        params = lambda state: weights  # noqa: E731
    sizes = s.model.sizes
    forward = make_logprob_fn(graphdef, response_len=sizes.learner_response_length, temperature=cfg.rollout.temperature,
                              impl=cfg.actor.logprob_impl, mesh=mesh, micro_batch_size=sizes.micro_batch_trajectories,
                              matmul_precision=cfg.model.matmul_precision)
    return Teacher(forward, params)


def teacher_service(s) -> Optional[Lazy]:
    """``Lazy(state -> ...)`` loading the run's :class:`Teacher` on first use (None without distillation)."""
    return Lazy(lambda: load_teacher(s)) if s.cfg.distillation.enabled else None


__all__ = ["REF", "Teacher", "distillation_spec", "load_teacher", "teacher_service"]
