"""Publishing a step: the weight sync to the sampler (``weight_sync``) and the step's metrics
(``metrics``: verl's names, host scalars only)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from rljax import loss as rl
from rljax.models import flops
from rljax.reward import overlong_metrics
from rljax.sharding import to_host
from rljax.trace import faults
from rljax.trace.facts import GroupView, number
from rljax.trace.fields import host_rows
from rljax.trainer.dynamic_sampling import metrics as ds_metrics
from rljax.trainer.judge import judge_metrics
from rljax.trainer.runner import stage
from rljax.trainer.services import Services
from rljax.trainer.staleness import async_metrics
from rljax.trainer.stages.learning import rollout_mismatch
from rljax.trainer.stages.rewarding import overlong_penalty
from rljax.trainer.state import RunState


def weight_sync_facts(ev, v: GroupView) -> dict:
    w = ev.writes
    return dict(learner_version=w.get("weight_version_after"), sampler_version=w.get("sampler_version"),
                sync_s=round(float(w.get("weight_sync_s") or 0.0), 6))


@stage("weight_sync", timing="update_weights", state="changes",
       writes=("weight_version_after", "sampler_version", "weight_sync_s", "weight_pushed", "weight_pushes"),
       facts=weight_sync_facts,
       summary="-> weight_version_after, sampler_version (state: the version; the run's weight publisher installs "
               "or pushes the weights)")
def weight_sync(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    """The learner's version advances; the run's weight publisher (:mod:`rljax.trainer.weights`:
    the sampler installs now, or the asynchronous push) gets the new weights."""
    state = state.replace(version=state.version + 1)
    return state, {"weight_version_after": state.version, **s.rollout.weights.publish(state)}


def metrics_facts(ev, v: GroupView) -> dict:
    """What the logged metrics counted (real rows only), and some of them as logged."""
    real = ~v.is_padding
    scores = v.fields.get("scores")
    host_scores = host_rows(scores, np.nonzero(real)[0]) if scores is not None else None
    return dict(rows_counted=int(real.sum()), padding_rows=int(v.is_padding.sum()),
                response_length_mean_real=float(v.response_length[real].mean()) if real.any() else None,
                score_mean_real=float(host_scores.mean()) if host_scores is not None and real.any() else None,
                logged={k: number((ev.writes.get("metrics") or {}).get(k))
                        for k in ("critic/score/mean", "response_length/mean", "actor/entropy", "actor/pg_loss")})



def correction_metrics(b, actor: dict) -> dict:
    """verl's ``rollout_corr/*``: the prepare stage's (decoupled correction) or the bypass_mode loss's."""
    out = {k: float(v) for k, v in to_host(b["rollout_corr"]).items()} if "rollout_corr" in b else {}
    out.update({k: float(v) for k, v in actor.items() if k.startswith("rollout_corr/")})
    return out


@stage("metrics", timing="metrics",
       reads=("trajectories", "rollout_rows", "actor_metrics", "critic_metrics", "advantages", "loss_mask", "scores",
              "optimizer_steps", "weight_version_after", "rollout_tokens_per_s", "reward_report", "rollout_mismatch",
              "old_logp", "rollout_logp", "function_scores", "rm_scores", "judge_scores", "judge_report",
              "dynamic_sampling", "kl", "kl_coef", "kl_in_reward", "values", "returns", "rollout_corr", "dequeue",
              "weight_pushes"),
       writes=("metrics",), config=("reward.reward_kwargs", "data.max_response_length", "actor.ppo_epochs"),
       facts=metrics_facts, summary="-> metrics (host scalars: metrics.jsonl, TensorBoard, the progress line)")
def step_metrics(s: Services, b) -> dict:
    """verl's metric names, from the fields the step produced (host scalars only)."""
    traj, actor = b["trajectories"], b["actor_metrics"]
    if faults.active("keep_batch_field"):
        faults.keep(b["advantages"])
    rows = b["rollout_rows"] if "rollout_rows" in b else traj  # every process's rows (several processes)
    real = ~np.asarray(rows.is_padding)
    scores = np.asarray(to_host(b["scores"]))
    lengths = rows.response_length[real]
    adv_mean, loss_tokens = to_host((rl.masked_mean(b["advantages"], b["loss_mask"]), jnp.sum(b["loss_mask"])))
    m: dict[str, Any] = {
        "actor/pg_loss": actor["pg_loss"], "actor/pg_clipfrac": actor["pg_clipfrac"],
        "actor/pg_clipfrac_lower": actor["pg_clipfrac_lower"], "actor/ppo_kl": actor["ppo_kl"],
        "actor/entropy": actor["entropy"],  # of the policy being updated, as verl reports it
        "actor/grad_norm": actor["grad_norm"], "actor/loss": actor["loss"],
        "actor/skipped_updates": int(actor["skipped_updates"]), "actor/lr_step": int(b["optimizer_steps"]),
        "critic/score/mean": float(scores[real].mean()), "critic/score/max": float(scores[real].max()),
        "critic/score/min": float(scores[real].min()), "critic/advantages/mean": float(adv_mean),
        "response_length/mean": float(lengths.mean()), "response_length/max": int(lengths.max()),
        "response_length/min": int(lengths.min()),
        "response_length/clip_ratio": float(rows.truncated[real].mean()),
        "prompt_length/mean": float(rows.prompt_length[real].mean()),
        "training/weight_version": int(b["weight_version_after"]),
        "perf/total_num_tokens": int(loss_tokens) + int(rows.prompt_length[real].sum()),
        "perf/rollout_tokens_per_s": (b["rollout_tokens_per_s"] if "rollout_tokens_per_s" in b
                                      else traj.stats.tokens_per_s),
        **b["reward_report"].metrics(),
        **(b["rollout_mismatch"] if "rollout_mismatch" in b else {}),
        **correction_metrics(b, actor),
    }
    occupancy = getattr(traj.stats, "slot_occupancy", None)  # live slots / slots over the decode steps
    if occupancy is not None and np.isfinite(occupancy):
        m["rollout/slot_occupancy"] = float(occupancy)
    if s.learner.old_logp_in_update:  # the update wrote old_logp (the update must not read rollout_logp: the trace
        m.update(rollout_mismatch(b["old_logp"], b))  # tells its behaviour log-prob by what it reads)
    if "function_scores" in b:  # reward.model.path / reward.judge.path: the rule's scores before combining
        m["reward/function/mean"] = float(np.asarray(to_host(b["function_scores"]))[real].mean())
    if "rm_scores" in b:
        rm = np.asarray(to_host(b["rm_scores"]))[real]
        m.update({"reward/model/mean": float(rm.mean()), "reward/model/max": float(rm.max()),
                  "reward/model/min": float(rm.min())})
    if "judge_report" in b:  # reward.judge: the parsed verdicts and how many failed to parse (every process's)
        judged = rows.judge_scores if "rollout_rows" in b else b["judge_scores"]
        m.update(judge_metrics(judged, b["judge_report"], real))
    if "dynamic_sampling" in b:
        m.update(ds_metrics(b["dynamic_sampling"]))
    penalty = overlong_penalty(s, rows)
    if penalty is not None and s.cfg.reward.reward_kwargs.overlong_buffer_cfg.log:
        m.update(overlong_metrics(penalty, real))
    # multi-turn episodes' env/* (several processes: of every process's episodes); none for single-turn
    m.update(s.rollout.client.metrics(rows.episodes if "rollout_rows" in b else traj))
    m.update(_model_flops(s, rows, real))
    m.update(_update_metrics(b, actor))
    if "dequeue" in b:  # trainer.mode=async: the batch's staleness (every process's rows), the queue, the pushes
        m.update(async_metrics(b["dequeue"], b["weight_pushes"]))
    return {"metrics": m}


def _update_metrics(b, actor: dict) -> dict:
    """The actor's KL loss, what a skipped update saw, the KL in the reward, the critic's update."""
    m: dict[str, Any] = {}
    if "kl_loss" in actor:
        m["actor/kl_loss"] = actor["kl_loss"]
    m.update({k: float(v) for k, v in actor.items() if k.startswith("distillation/")})  # distillation.enabled
    for role, ms in (("actor", actor), ("critic", b.get("critic_metrics") or {})):  # what a skipped update saw
        m.update({f"{role}/{k}": float(v) for k, v in ms.items() if k.startswith("nonfinite_grad/") and v > 0})
    if "kl_coef" in b:  # the kl_controller stage (algorithm.use_kl_in_reward)
        m["critic/kl"], m["critic/kl_coef"] = b["kl"], b["kl_coef"]
    elif "kl_in_reward" in b:
        m["critic/kl"] = float(to_host(b["kl_in_reward"]))
    if "critic_metrics" in b:
        cm = b["critic_metrics"]
        v_mean, r_mean = to_host((rl.masked_mean(b["values"], b["loss_mask"]),
                                  rl.masked_mean(b["returns"], b["loss_mask"])))
        m.update({"critic/vf_loss": cm["vf_loss"], "critic/vf_clipfrac": cm["vf_clipfrac"],
                  "critic/grad_norm": cm["grad_norm"], "critic/values/mean": float(v_mean),
                  "critic/returns/mean": float(r_mean)})
    return m


def _model_flops(s: Services, traj, real) -> dict:
    """``perf/model_flops/actor`` (forward + backward of every PPO epoch over the real tokens)
    and ``perf/model_flops/rollout`` (prefill + decode), :mod:`rljax.models.flops`; the
    trainer divides them by the stage times and the devices' peak into ``perf/mfu/*``."""
    config = getattr(getattr(s.rollout.sampler, "engine", None), "config", None)
    if config is None:
        return {}
    p, r = np.asarray(traj.prompt_length)[real], np.asarray(traj.response_length)[real]
    return {"perf/model_flops/actor": s.cfg.actor.ppo_epochs * flops.train_flops(config, p + r),
            "perf/model_flops/rollout": flops.rollout_flops(config, p, r)}


#: This module's stages in the order of a step (:data:`rljax.trainer.stages.STEP`).
STAGES = (weight_sync, step_metrics)
