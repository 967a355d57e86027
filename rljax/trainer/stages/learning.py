"""Learning from a batch: the log-prob passes (``old_log_prob``, ``reference``, ``teacher``, ``values``),
the advantages, the KL-in-reward controller and the updates of the critic and the actor.

When the update is exactly on-policy (one epoch over one mini-batch, nothing reading
``old_logp`` before the update: :func:`rljax.config.on_policy_blockers`) and
``actor.skip_old_log_prob`` is ``auto`` or ``true``, there is no ``old_log_prob`` stage: the
update takes its own log-probs, detached, as ``old_logp`` (what a separate pass with the same
parameters computes, as verl's and TRL's actors do) and ``actor_minibatch`` writes them, so
the trace shows ``old_logp`` produced inside the update.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from rljax import loss as rl
from rljax._digest import LOG
from rljax.trainer.loss_config import decoupled_correction
from rljax.trainer import prefix
from rljax.models.lora import disable
from rljax.sharding import data_shards, to_host
from rljax.trace import faults
from rljax.trace.facts import GroupView, number, padding_abs_sum
from rljax.trainer.runner import stage
from rljax.trainer.services import Services
from rljax.trainer.stages.rewarding import MODEL_INPUTS, model_inputs
from rljax.trainer.state import RunState, step_key
from rljax.trainer.update_report import REPORT

_mismatch = jax.jit(rl.rollout_mismatch)


def rollout_mismatch(old_logp, b) -> dict:
    """verl's ``training/rollout_*`` mismatch metrics of the learner's ``old_logp`` against the
    sampler's ``rollout_logp`` over the loss mask (:func:`rljax.loss.rollout_mismatch`; host
    floats): in the ``old_log_prob`` stage, or in ``metrics`` when the update wrote ``old_logp``
    (``actor.skip_old_log_prob``); none in ``algorithm.bypass_mode``, which has no learner
    log-probs to compare."""
    s = {k: float(v) for k, v in to_host(_mismatch(old_logp, b["rollout_logp"], b["loss_mask"])).items()}
    out = {f"training/rollout_{k}": s[k] for k in ("probs_diff_max", "probs_diff_mean", "probs_diff_std",
                                                    "logprobs_diff_max", "logprobs_diff_mean", "logprobs_diff_std")}
    out["training/rollout_actor_probs_pearson_corr"] = s["pearson_corr"]
    out["training/rollout_probs_diff_valid"] = int(s["tokens"] > 0)
    return out



# ---------------------------------------------------------------------------- log-prob passes


@stage("old_log_prob", timing="old_log_prob", state="reads", reads=(*MODEL_INPUTS, "rollout_logp", "loss_mask"),
       writes=("old_logp", "entropy", "rollout_mismatch"), config=("algorithm.bypass_mode",),
       when=lambda s: not s.cfg.algorithm.bypass_mode and not s.learner.old_logp_in_update,
       only="not in algorithm.bypass_mode, not when the update takes its own (actor.skip_old_log_prob)",
       summary="input_ids, ... -> old_logp, entropy, rollout_mismatch")
def old_log_prob(s: Services, state: RunState, b) -> dict:
    params = faults.old_params(state.actor.params)
    old_logp, entropy = s.learner.actor.forward(params, model_inputs(b))
    LOG.record("old", state.version, params)  # the trace ties the pass's weights to the version's
    return {"old_logp": old_logp, "entropy": entropy, "rollout_mismatch": rollout_mismatch(old_logp, b)}


@stage("reference", timing="ref", state="reads", reads=MODEL_INPUTS, writes=("ref_logp",),
       when=lambda s: s.learner.ref_params is not None or s.learner.ref_is_base,
       only="with a KL loss or a KL in the reward", summary="input_ids, ... -> ref_logp")
def reference(s: Services, state: RunState, b) -> dict:
    params = faults.reference_params(disable(state.actor.params) if s.learner.ref_is_base else s.learner.ref_params,
                                     state.actor.params)
    LOG.record("reference", 0, params)  # the trace ties the pass's weights to the initial policy's (version 0)
    return {"ref_logp": s.learner.actor.forward(params, model_inputs(b))[0]}


@stage("teacher", timing="teacher", state="reads", reads=MODEL_INPUTS,
       writes=("teacher_logp", "teacher_topk_ids", "teacher_topk_logp"), when=lambda s: s.teacher is not None,
       only="with distillation.enabled",
       summary="input_ids, ... -> teacher_logp (the teacher's log-probs of the sampled tokens), or with "
               "forward_kl_topk teacher_topk_ids, teacher_topk_logp (its top-k tokens; rljax.trainer.teacher)")
def teacher(s: Services, state: RunState, b) -> dict:
    return s.teacher.get()(state, model_inputs(b))


@stage("values", timing="values", state="reads", reads=MODEL_INPUTS, writes=("values",),
       when=lambda s: s.learner.critic is not None, only="algorithm.adv_estimator=gae",
       summary="input_ids, ... -> values")
def values(s: Services, state: RunState, b) -> dict:
    return {"values": s.learner.critic.forward(state.critic.params, model_inputs(b))}


# ---------------------------------------------------------------------------- advantages, KL control


def advantages_facts(ev, v: GroupView, *, estimator: str) -> dict:
    return dict(estimator=estimator, returns="materialised (critic targets)" if "values" in ev.reads
                else "= advantages (outcome estimators have no critic)")


@stage("advantages", timing="adv", state="reads",
       reads=("scores", "loss_mask", "group_id", "row_mask", "old_logp", "rollout_logp", "ref_logp", "values"),
       writes=("token_level_rewards", "advantages", "returns", "rollout_is_weights", "kl_in_reward", "rollout_corr"),
       config=("algorithm.adv_estimator", "algorithm.rollout_correction"), facts=advantages_facts,
       facts_args=lambda s: dict(estimator=s.cfg.algorithm.adv_estimator),
       summary="scores, masks, log-probs, values -> token_level_rewards, advantages, returns, rollout_is_weights "
               "(rljax.trainer.prepare: the fields its configuration reads)")
def advantages(s: Services, state: RunState, b) -> dict:
    fields = {k: b[k] for k in s.learner.prepare_inputs}
    return dict(s.learner.prepare(fields, jnp.float32(state.kl_coef)))


@stage("kl_controller", timing="kl_ctrl", state="changes", reads=("kl_in_reward", "rollout_rows", "trajectories"),
       writes=("kl", "kl_coef"), config=("algorithm.use_kl_in_reward", "algorithm.kl_ctrl"),
       when=lambda s: s.cfg.algorithm.use_kl_in_reward, only="with algorithm.use_kl_in_reward",
       summary="kl_in_reward -> kl, kl_coef (state: the next step's coefficient)")
def kl_controller(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    """``algorithm.use_kl_in_reward``: the step's measured KL (``critic/kl``) and the coefficient
    its advantages used (``critic/kl_coef``); with ``algorithm.kl_ctrl.type=adaptive`` the next
    step's coefficient follows :func:`rljax.loss.adaptive_kl_coef` (verl's controller: it grows
    while the KL is above ``target_kl``, shrinks below; a non-finite KL leaves it)."""
    kl = float(to_host(b["kl_in_reward"]))
    rows = b["rollout_rows"] if "rollout_rows" in b else b["trajectories"]  # every process's rows
    coef, ctrl = state.kl_coef, s.cfg.algorithm.kl_ctrl
    if ctrl.type == "adaptive" and math.isfinite(kl):
        n = int((~np.asarray(rows.is_padding)).sum())
        coef = float(rl.adaptive_kl_coef(coef, kl, n, target_kl=ctrl.target_kl, horizon=ctrl.horizon))
    return state.replace(kl_coef=coef), {"kl": kl, "kl_coef": state.kl_coef}



# ---------------------------------------------------------------------------- updates


@stage("update_critic", timing="update_critic", state="changes",
       reads=("step", *MODEL_INPUTS, "loss_mask", "values", "returns"), writes=("critic_metrics",),
       when=lambda s: s.learner.critic is not None, only="algorithm.adv_estimator=gae",
       summary="... -> critic_metrics (state: the critic)")
def update_critic(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    batch = dict(model_inputs(b), loss_mask=b["loss_mask"], old_values=b["values"], returns=b["returns"])
    critic, metrics = s.learner.critic.update(state.critic, batch, step_key(state, b["step"]))
    return state.replace(critic=critic), {"critic_metrics": to_host(metrics)}


def actor_batch(s: Services, b) -> dict:
    """The fields the actor update consumes, under the names :mod:`rljax.trainer.step` uses."""
    cfg = s.cfg
    batch = dict(model_inputs(b), loss_mask=b["loss_mask"], advantages=b["advantages"])
    if not s.learner.old_logp_in_update:
        batch["old_logp"] = b[s.behaviour_logp]
    if cfg.actor.use_kl_loss:
        batch["ref_logp"] = b["ref_logp"]
    if cfg.rollout.correction != "none" or decoupled_correction(cfg):
        batch["rollout_is_weights"] = b["rollout_is_weights"]
    distill = s.model.step_config.distillation
    if distill is not None:  # the teacher stage's fields, for the distillation term
        for k in ("teacher_topk_ids", "teacher_topk_logp") if distill.uses_topk else ("teacher_logp",):
            batch[k] = b[k]
    return batch


def actor_minibatch_facts(ev, v: GroupView, *, bypass_mode: bool, dp: int) -> dict:
    """The update's sizes as it reported them (``update_sizes``), the loss tokens it consumed, its
    metrics, and which behaviour log-prob it read (and who produced it)."""
    reads, sizes = ev.reads, dict(ev.writes.get("update_sizes") or {})
    B, mini, micro = sizes.get("global_batch_size"), sizes.get("ppo_mini_batch_size"), sizes.get("ppo_micro_batch_size")
    behaviour = "old_logp" if "old_logp" in reads else ("rollout_logp" if "rollout_logp" in reads else None)
    in_update = behaviour is None and "old_logp" in ev.writes  # actor.skip_old_log_prob: the update wrote its own
    if in_update:
        behaviour = "old_logp"
    loss_tokens = loss_rows = pad_tokens = None
    per_row, pad = (v.row_tokens if "loss_mask" in reads else None), v.is_padding
    if per_row is not None:
        loss_tokens, loss_rows = int(per_row.sum()), int((per_row > 0).sum())
        pad_tokens = int(per_row[pad].sum()) if pad.any() else 0
    minibatch = {**sizes, "mini_batches_per_epoch": B // mini if B and mini else None,
                 "micro_batches_per_mini_batch": mini // micro if mini and micro else None,
                 "optimizer_steps_after": ev.writes.get("optimizer_steps"), "loss_tokens": loss_tokens,
                 "loss_rows": loss_rows, "loss_tokens_on_padding_rows": pad_tokens,
                 "advantages_on_padding_rows_abs_sum": padding_abs_sum(reads.get("advantages"), pad),
                 "dp_shard_rows": B // dp if B and B % dp == 0 else None, "actor_dp": dp}
    actor = {k: number(x) for k, x in (ev.writes.get("actor_metrics") or {}).items()}
    return dict(minibatch=minibatch, actor_metrics=actor,
                behaviour_logp={"field": behaviour, "producer": ev.producers.get(behaviour) if behaviour else None,
                                "bypass_mode": bypass_mode, "in_update": in_update})



@stage("actor_minibatch", timing="update_actor", state="changes",
       reads=("step", *MODEL_INPUTS, "loss_mask", "advantages", "old_logp", "rollout_logp", "ref_logp",
              "rollout_is_weights", "teacher_logp", "teacher_topk_ids", "teacher_topk_logp"),
       writes=("actor_metrics", "optimizer_steps", "update_sizes", "old_logp"),
       config=("algorithm.bypass_mode", "actor.use_kl_loss", "rollout.correction", "algorithm.rollout_correction"),
       facts=actor_minibatch_facts,
       facts_args=lambda s: dict(bypass_mode=bool(s.cfg.algorithm.bypass_mode), dp=data_shards(s.mesh)),
       summary="... -> actor_metrics, optimizer_steps (+ old_logp when the update takes its own; state: the actor)")
def actor_minibatch(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    batch = actor_batch(s, b)
    before = int(state.actor.step)
    actor, metrics = s.learner.actor.update(state.actor, batch, step_key(state, b["step"]))
    if REPORT in metrics:  # the update digested its output: the next passes reading these arrays take it (no recompute)
        LOG.known(actor.params, metrics[REPORT]["param_digest_after"])
    out = {}
    if s.learner.old_logp_in_update:  # the update's own log-probs before its step (detached), [B, T] on the mesh
        out["old_logp"] = metrics.pop("old_logp")
    steps = int(actor.step)
    sc = s.model.step_config  # what the update was built with
    sizes = {"global_batch_size": int(batch["loss_mask"].shape[0]), "ppo_mini_batch_size": int(sc.ppo_mini_batch_size),
             "ppo_micro_batch_size": int(sc.ppo_micro_batch_size), "ppo_epochs": int(sc.ppo_epochs),
             "optimizer_steps_taken": steps - before,
             "learner_layout": prefix.learner_layout(s.learner.actor.update)}  # padded / packed / shared_prefix
    return state.replace(actor=actor), {"actor_metrics": to_host(metrics), "optimizer_steps": steps,
                                        "update_sizes": sizes, **out}


#: This module's stages in the order of a step (:data:`rljax.trainer.stages.STEP`).
STAGES = (old_log_prob, reference, teacher, values, advantages, kl_controller, update_critic, actor_minibatch)
