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
fused log-prob as the policy's passes (no ``[B, T, V]`` logits). With
``loss_mode=forward_kl_topk`` it writes ``teacher_topk_ids [B, T, K]`` (int32) and
``teacher_topk_logp [B, T, K]`` (the teacher's dtype) instead: its ``K = topk`` most likely
tokens at each response position and their log-probs, from the fused top-k pass
(:func:`rljax.pallas._topk.fused_topk_logprob`, again no ``[B, T, V]`` logits); the update
takes the student's log-probs at those ids from its own hidden states
(:func:`rljax.trainer.heads.logprob_at`).
"""

from __future__ import annotations

from typing import Callable, Optional

import jax

from rljax import loss as rl
from rljax.config import Config
from rljax.models import functional as F
from rljax.models.hf import load_hf_checkpoint
from rljax.models.lora import disable
from rljax.models.precision import traced_at
from rljax.pallas import fused_topk_logprob, fused_topk_logprob_sharded
from rljax.sharding import mesh_batch_axes, with_logical_constraint
from rljax.trainer.judge import initial_policy_params
from rljax.trainer.services import Lazy
from rljax.trainer.heads import response_hidden
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
    """``teacher(state, inputs) -> {"teacher_logp": [B, T]}`` (or, ``topk``, ``{"teacher_topk_ids",
    "teacher_topk_logp": [B, T, K]}``): the teacher's pass over a learner batch's ``input_ids,
    attention_mask, positions`` (on the learner mesh, rows on ``dp``)."""

    def __init__(self, forward: Callable, params: Callable, *, topk: bool = False):
        self._forward, self._params = forward, params  # params(state): the teacher's weights now
        self.topk = topk

    def __call__(self, state, inputs: dict) -> dict:
        out = self._forward(self._params(state), inputs)
        if self.topk:
            return {"teacher_topk_ids": out[0], "teacher_topk_logp": out[1]}
        return {"teacher_logp": out[0]}


def make_topk_fn(graphdef, *, response_len: int, k: int, temperature: float, dtype="float32", mesh=None,
                 micro_batch_size: Optional[int] = None, matmul_precision: Optional[str] = None) -> Callable:
    """Jitted ``(params, batch) -> (ids int32, logp) [B, T, k]``: the ``k`` most likely tokens at
    each response position (hidden ``S - 1 + t``) and their log-probs at ``temperature``, in
    micro-batches of ``micro_batch_size`` rows; ``logp`` in ``dtype`` (the teacher's: ``model.dtype``)."""

    def one(params, chunk):
        hidden = response_hidden(graphdef, params, chunk, response_len=response_len, mesh=mesh)
        unembed, cap = F.unembedding(params), F.logit_softcap(graphdef)
        if mesh is None:
            ids, logp = fused_topk_logprob(hidden, unembed, k, temperature=temperature, softcap=cap)
        else:
            ids, logp = fused_topk_logprob_sharded(hidden, unembed, k, mesh=mesh, batch_axes=mesh_batch_axes(mesh),
                                                   temperature=temperature, softcap=cap)
        return ids, logp.astype(dtype)

    def compute(params, batch):
        fields = {key: batch[key] for key in ("input_ids", "attention_mask", "positions")}
        b = fields["input_ids"].shape[0]
        n = 1 if micro_batch_size is None else max(b // micro_batch_size, 1)
        chunks = jax.tree.map(lambda x: x.reshape((n, b // n) + x.shape[1:]), fields)
        out = tuple(x.reshape(b, response_len, k) for x in jax.lax.map(lambda c: one(params, c), chunks))
        if mesh is not None:  # rows stay on dp (and the response on sp), like the batch they belong to
            out = tuple(with_logical_constraint(x, ("batch", "length", None), mesh) for x in out)
        return out

    return jax.jit(traced_at(compute, matmul_precision))


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
    sizes, d = s.model.sizes, cfg.distillation.distillation_loss
    common = dict(response_len=sizes.learner_response_length, temperature=cfg.rollout.temperature, mesh=mesh,
                  micro_batch_size=sizes.micro_batch_trajectories, matmul_precision=cfg.model.matmul_precision)
    if d.loss_mode == "forward_kl_topk":
        k = min(d.topk, s.model.config.vocab_size)  # over the vocabulary: all of it (the exact forward KL)
        return Teacher(make_topk_fn(graphdef, k=k, dtype=cfg.model.dtype, **common), params, topk=True)
    return Teacher(make_logprob_fn(graphdef, impl=cfg.actor.logprob_impl, **common), params)


def teacher_service(s) -> Optional[Lazy]:
    """``Lazy(state -> ...)`` loading the run's :class:`Teacher` on first use (None without distillation)."""
    return Lazy(lambda: load_teacher(s)) if s.cfg.distillation.enabled else None


__all__ = ["REF", "Teacher", "distillation_spec", "load_teacher", "make_topk_fn", "teacher_service"]
