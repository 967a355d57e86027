"""The stages of one synchronous (colocated) RL step, as small functions over the batch dict.

:func:`sync_stages` lists them in order; :class:`rljax.trainer.runner.StepRunner` runs the
list, times each stage and tells the observers (trace, ledgers) what each one read and
wrote. A stage is ``fn(services, batch) -> outputs`` or, when it reads or changes the run's
state, ``fn(services, state, batch) -> (state, outputs)``: the services
(:class:`~rljax.trainer.services.Services`: model functions, sampler, reward, mesh) never
change, the state (:class:`~rljax.trainer.state.RunState`: train states, weight version,
KL coefficient, ...) is a value the runner threads through; no stage keeps either. Each stage
declares the fields it may read and write (:data:`READS`, :data:`WRITES`; the runner refuses
any other) and carries its trace facts (``*_facts(event, view)`` beside the stage function,
see :mod:`rljax.trainer.runner`). The table below is the overview:

====================  ==================  =================================================
stage                 ``timing_s/``       reads -> writes
====================  ==================  =================================================
dataset_item          ``data``            -> prompts, uids, weight_version
rollout_sessions      ``gen``             prompts, uids -> trajectories (host)
trajectory_fields     ``reshard``         trajectories -> input_ids, attention_mask,
                                          positions, loss_mask, rollout_logp, group_id,
                                          row_mask (global arrays on the learner mesh)
reward                ``reward``          trajectories, prompts -> scores, reward_report
gather_rollout        ``gather_rollout``  trajectories, reward_report, judge_report ->
                                          rollout_rows, reward_report, judge_report (the
                                          whole batch's; only with several processes,
                                          :mod:`rljax.trainer.distribute`)
old_log_prob          ``old_log_prob``    input_ids, ... -> old_logp, entropy (not in bypass
                                          mode: the update then reads ``rollout_logp``; not
                                          when the update is exactly on-policy, see below)
reference             ``ref``             input_ids, ... -> ref_logp (KL loss / KL reward)
values                ``values``          input_ids, ... -> values (``gae``)
advantages            ``adv``             scores, masks, log-probs, values ->
                                          token_level_rewards, advantages, returns,
                                          rollout_is_weights (:mod:`rljax.trainer.prepare`)
kl_controller         ``kl_ctrl``         kl_in_reward -> kl, kl_coef (state: the next
                                          step's coefficient; ``use_kl_in_reward``)
update_critic         ``update_critic``   ... -> critic_metrics (``gae``; state: critic)
actor_minibatch       ``update_actor``    ... -> actor_metrics (+ old_logp, see below;
                                          state: actor)
weight_sync           ``update_weights``  -> weight_version_after, sampler_version (state:
                                          version)
metrics               ``metrics``         -> metrics (host scalars)
====================  ==================  =================================================

When the update is exactly on-policy (one epoch over one mini-batch, nothing reading
``old_logp`` before the update: :func:`rljax.config.on_policy_blockers`) and
``actor.skip_old_log_prob`` is ``auto`` or ``true``, there is no ``old_log_prob`` stage: the
update takes its own log-probs, detached, as ``old_logp`` (what a separate pass with the same
parameters computes, as verl's and TRL's actors do) and ``actor_minibatch`` writes them, so
the trace shows ``old_logp`` produced inside the update.

The two schedulers run the same functions: :class:`~rljax.trainer.sync_loop.SyncSchedule`
the list as it is; :class:`~rljax.trainer.async_loop.AsyncSchedule` dataset_item +
rollout_sessions + reward on the producer thread (no run state there: the learner owns it),
the rest on the learner, with a ``dequeue`` stage (the staleness gate's facts) first and
the weight push in ``weight_sync``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from rljax import loss as rl
from rljax.env import episode_metrics, episode_scores
from rljax.models import abstract_params, flops, load_hf_reward_model, reward_scores
from rljax.models.lora import disable
from rljax.reward import overlong_metrics, overlong_penalty as reward_overlong_penalty, score_batch
from rljax.sharding import to_host
from rljax.trace import faults
from rljax.trace.facts import GroupView, message_count, number, padding_abs_sum
from rljax.trace.fields import host_rows
from rljax.trace.invariants import position_digest
from rljax.trainer import distribute, dynamic_sampling as ds
from rljax.trainer.distribute import assemble, check_async_share, local_rows
from rljax.trainer.dynamic_sampling import metrics as ds_metrics
from rljax.trainer.judge import Judge, initial_policy_params, judge_metrics
from rljax.trainer.runner import Stage
from rljax.trainer.services import Services
from rljax.trainer.state import RunState, step_key

#: The learner batch fields that the forward passes read.
MODEL_INPUTS = ("input_ids", "attention_mask", "positions")


def prompt_width(longest: int, prompt_len: int, *, multiple: int = 1) -> int:
    """The learner's prompt columns for a batch whose longest prompt has ``longest`` tokens
    (``data.trim_prompt_padding``): ``longest`` rounded up to four lengths per octave (5, 6, 7,
    8, 10, 12, 14, 16, 20, ...: at most 25% padding, few compiled programs), then to a multiple
    of ``multiple`` (``sp``), at most ``prompt_len``; at least one column."""
    n = max(int(longest), 1)
    q = 1 << max(0, n.bit_length() - 3)  # 2^(floor(log2 n) - 2)
    n = -(-n // q) * q
    n = -(-n // multiple) * multiple
    return min(n, prompt_len)


def prompt_longest(traj) -> int:
    """The prompt columns of a rollout from its first non-padding one (left-padded prompts): the
    longest prompt's length, 0 when every row is padding."""
    used = np.asarray(traj.prompt_mask).any(axis=0)
    return traj.prompt_ids.shape[1] - int(np.argmax(used)) if used.any() else 0


def learner_layout(traj, *, prompt_len: int, response_len: int, trim: bool = False,
                   multiple: int = 1, longest: Optional[int] = None) -> dict[str, np.ndarray]:
    """The learner's ``[B, S+T]`` layout of a rollout (NumPy): left-padded prompts, right-padded
    responses, both widened to the learner lengths (multiples of ``sp``). With ``trim`` the
    prompt columns are :func:`prompt_width` of the batch's longest prompt instead of
    ``prompt_len``: the columns dropped are left padding in every row, so positions, masks and
    the response's log-probs are the same. ``longest``: the whole batch's longest prompt when
    ``traj`` holds only some of its rows (several processes agree on one width); default
    :func:`prompt_longest` of ``traj``, and at least that."""
    b, s = traj.prompt_ids.shape
    if trim:
        own = prompt_longest(traj)
        longest = own if longest is None else int(longest)
        if longest < own:
            raise ValueError(f"longest={longest} prompt columns for a rollout whose own longest prompt has {own}")
        if longest <= prompt_len:
            prompt_len = prompt_width(longest, prompt_len, multiple=multiple)
            if s > prompt_len:  # the sampler's columns beyond the width are padding in every row
                traj = traj.replace(prompt_ids=traj.prompt_ids[:, s - prompt_len:],
                                    prompt_mask=traj.prompt_mask[:, s - prompt_len:])
                s = prompt_len
    left = ((0, 0), (prompt_len - s, 0))
    right = ((0, 0), (0, response_len - traj.response_ids.shape[1]))
    prompt_ids = np.pad(traj.prompt_ids, left, constant_values=traj.pad_id)
    response_ids = np.pad(traj.response_ids, right, constant_values=traj.pad_id)
    # Multi-turn rollouts (rljax.env) attend to observations their response_mask leaves out.
    present = getattr(traj, "response_attention", None)
    present = traj.response_mask if present is None else present
    attention = np.concatenate([np.pad(traj.prompt_mask, left), np.pad(present, right)], axis=1)
    return {
        "input_ids": np.concatenate([prompt_ids, response_ids], axis=1).astype(np.int32),
        "attention_mask": attention,
        "positions": np.maximum(np.cumsum(attention, axis=1) - 1, 0).astype(np.int32),
        "loss_mask": np.pad(traj.loss_mask, right).astype(np.float32),
        "rollout_logp": np.pad(traj.rollout_logp, right).astype(np.float32),
        "group_id": traj.group_id.astype(np.int32),
        "row_mask": ~np.asarray(traj.is_padding),
    }


#: What each stage may read and write (a superset per configuration; the runner refuses any
#: other field). ``actor_minibatch``'s reads depend on the configuration (:func:`actor_reads`).
READS = {
    "dataset_item": ("step",),
    "rollout_sessions": ("step", "prompts", "uids", "weight_version", "batch_prompts"),  # the last: filter_groups
    "trajectory_fields": ("step", "trajectories"),
    "reward_model": MODEL_INPUTS,
    "reward_judge": ("trajectories", "prompts"),
    "reward": ("step", "trajectories", "prompts", "rm_scores", "judge_scores", "dynamic_sampling"),
    "gather_rollout": ("queue_item", "trajectories", "reward_report", "judge_scores", "judge_report"),
    "old_log_prob": (*MODEL_INPUTS, "rollout_logp", "loss_mask"),
    "reference": MODEL_INPUTS,
    "values": MODEL_INPUTS,
    "kl_controller": ("kl_in_reward", "rollout_rows", "trajectories"),
    "update_critic": ("step", *MODEL_INPUTS, "loss_mask", "values", "returns"),
    "weight_sync": (),
    "metrics": ("trajectories", "rollout_rows", "actor_metrics", "critic_metrics", "advantages", "loss_mask",
                "scores", "optimizer_steps", "weight_version_after", "rollout_tokens_per_s", "reward_report",
                "rollout_mismatch", "old_logp", "rollout_logp", "function_scores", "rm_scores", "judge_scores",
                "judge_report", "dynamic_sampling", "kl", "kl_coef", "kl_in_reward", "values", "returns"),
}
WRITES = {
    "dataset_item": ("prompts", "uids", "weight_version", "batch_prompts"),  # the last: filter_groups, processes > 1
    "rollout_sessions": ("trajectories", "prompts", "uids", "dynamic_sampling"),  # the last three: filter_groups
    "trajectory_fields": (*MODEL_INPUTS, "loss_mask", "rollout_logp", "group_id", "row_mask"),
    "reward_model": ("rm_scores",),
    "reward_judge": ("judge_scores", "judge_texts", "judge_status", "judge_report"),
    "reward": ("scores", "function_scores", "reward_report", "scored_rows"),
    "gather_rollout": ("rollout_rows", "reward_report", "rollout_tokens_per_s", "judge_report"),
    "old_log_prob": ("old_logp", "entropy", "rollout_mismatch"),
    "reference": ("ref_logp",),
    "values": ("values",),
    "advantages": ("token_level_rewards", "advantages", "returns", "rollout_is_weights", "kl_in_reward"),
    "kl_controller": ("kl", "kl_coef"),
    "update_critic": ("critic_metrics",),
    "actor_minibatch": ("actor_metrics", "optimizer_steps", "update_sizes", "old_logp"),
    "weight_sync": ("weight_version_after", "sampler_version", "weight_sync_s"),
    "metrics": ("metrics",),
}


def actor_reads(s: Services) -> tuple[str, ...]:
    """The fields the actor update reads in this configuration (:func:`actor_batch`): its
    behaviour log-prob is the learner's ``old_logp`` or, in bypass mode, the sampler's
    ``rollout_logp``; none when the update takes its own (``actor.skip_old_log_prob``)."""
    keys = ["step", *MODEL_INPUTS, "loss_mask", "advantages"]
    if not s.learner.old_logp_in_update:
        keys.append(s.behaviour_logp)
    if s.cfg.actor.use_kl_loss:
        keys.append("ref_logp")
    if s.cfg.rollout.correction != "none":
        keys.append("rollout_is_weights")
    return tuple(keys)


def stage(s: Services, name: str, fn: Callable, timing: str, *, updates_state: bool = False,
          facts: Optional[Callable] = None, reads: Optional[tuple] = None, comm: bool = False) -> Stage:
    """The stage ``name`` over ``fn(s, [state,] batch)``, with its declared fields and facts."""
    return Stage(name, functools.partial(fn, s), timing, updates_state=updates_state,
                 reads=READS[name] if reads is None else reads, writes=WRITES[name], facts=facts, comm=comm)


def sync_stages(s: Services, *, on_chunk: Optional[Callable] = None) -> list[Stage]:
    """The stage list of a synchronous step for this configuration. ``on_chunk``: called by the
    sampler between decode chunks (the asynchronous schedule installs weight pushes there
    with ``async_training.partial_rollout``)."""
    cfg, learner = s.cfg, s.learner
    rollout_fn, reward_fn = functools.partial(rollout_sessions, on_chunk=on_chunk), reward
    if s.rollout.env is not None:  # multi-turn episodes (rljax.env): same stage names, same learner side
        rollout_fn, reward_fn = rollout_episodes, episode_reward
    if cfg.algorithm.filter_groups.enable:  # DAPO dynamic sampling: generate and score until the batch is full
        rollout_fn, reward_fn = _filtered_stages(s, rollout_fn)
    stages = [stage(s, "dataset_item", dataset_item, "data", updates_state=True,
                    facts=functools.partial(dataset_item_facts, system_prompt=cfg.data.system_prompt)),
              stage(s, "rollout_sessions", lambda s, b: _release_after(s, rollout_fn(s, b)), "gen",
                    facts=functools.partial(rollout_facts, n=int(cfg.rollout.n))),
              stage(s, "trajectory_fields", trajectory_fields, "reshard", updates_state=True,
                    facts=trajectory_fields_facts)]
    if cfg.reward.model.path is not None:  # a discriminative reward model scores the learner batch
        stages.append(stage(s, "reward_model", reward_model, "reward_model"))
    if cfg.reward.judge.path is not None:  # a generative judge reads each trajectory on the rollout engine
        stages.append(stage(s, "reward_judge", reward_judge, "reward_judge", updates_state=True,
                            facts=reward_judge_facts))
    stages.append(stage(s, "reward", reward_fn, "reward", facts=reward_facts))
    if s.rollout.share.processes > 1:  # the whole batch's row facts and reward report, on the learner side
        stages.append(stage(s, "gather_rollout", gather_rollout, "gather_rollout", comm=True))
    if not cfg.algorithm.bypass_mode and not learner.old_logp_in_update:
        stages.append(stage(s, "old_log_prob", old_log_prob, "old_log_prob", updates_state=True))
    if learner.ref_params is not None or learner.ref_is_base:
        stages.append(stage(s, "reference", reference, "ref", updates_state=True))
    if learner.critic is not None:
        stages.append(stage(s, "values", values, "values", updates_state=True))
    stages.append(stage(s, "advantages", advantages, "adv", updates_state=True, reads=learner.prepare_inputs,
                        facts=functools.partial(advantages_facts, estimator=cfg.algorithm.adv_estimator)))
    if cfg.algorithm.use_kl_in_reward:  # the KL-in-reward controller adapts the next step's coefficient
        stages.append(stage(s, "kl_controller", kl_controller, "kl_ctrl", updates_state=True))
    if learner.critic is not None:
        stages.append(stage(s, "update_critic", update_critic, "update_critic", updates_state=True))
    stages += [stage(s, "actor_minibatch", actor_minibatch, "update_actor", updates_state=True, reads=actor_reads(s),
                     facts=functools.partial(actor_minibatch_facts, bypass_mode=bool(cfg.algorithm.bypass_mode),
                                             dp=int(dict(s.mesh.shape).get("dp", 1)))),
               stage(s, "weight_sync", weight_sync, "update_weights", updates_state=True, facts=weight_sync_facts),
               stage(s, "metrics", step_metrics, "metrics", facts=metrics_facts)]
    return stages


def _filtered_stages(s: Services, rollout_fn):
    """``algorithm.filter_groups``: the rollout stage draws, generates and scores prompt batches
    until the batch is full (:mod:`rljax.trainer.dynamic_sampling`; its reward time is in
    ``timing_s/gen``); the reward stage places the kept rows' scores."""
    multi = s.rollout.share.processes > 1
    if multi and s.cfg.trainer.mode == "async":  # launch refuses it first, with exit status 2
        check_async_share(s.rollout.share, s.cfg.trainer.mesh, filter_groups=True)

    def task_score(s, traj, prompts):
        # several processes: the bound applies to the whole batch (gather_rollout), so every process stops together
        bound = 1.0 if multi else s.cfg.reward.max_error_fraction
        if s.rollout.env is not None:  # multi-turn: the episode's reward (the environment's, else the final turn's)
            return episode_scores(traj, s.reward.fn, prompts, max_error_fraction=bound)
        return score(s, traj, prompts, max_error_fraction=bound)

    def rollout(s, b):
        return ds.filtered_rollout(s, b, rollout_fn=rollout_fn, score_fn=task_score, shape_fn=overlong_shaping,
                                   digest_fn=response_digest)

    def kept_reward(s, b):
        d = b["dynamic_sampling"]
        if "rm_scores" in b or "judge_scores" in b:  # reward.model / reward.judge: the kept rows' rule scores
            # (the filter kept them by acc, the rule's) combined with the model's scores of the learner batch and
            # the judge's verdicts on the kept rows; the filter's scores are the rule's plus the overlong
            # penalty, so the rule's are those minus the penalty (float32)
            traj = b["trajectories"]
            p = overlong_penalty(s, traj)
            p = np.zeros(traj.batch_size, np.float32) if p is None else p
            rule = np.asarray(d["scores"], np.float32) - p
            return dict(combine(s, b, traj, rule, penalty=p, digest=d["scored_rows"]["digest"]),
                        reward_report=d["reward_report"])
        # scored_rows: each kept row's score with the digest of the tokens it was computed for, taken
        # where it was scored (before the processes' exchange): the trace ties them to what is trained
        scores = np.array(d["scores"], np.float32)
        faults.reward_scores(scores, b["trajectories"], seed=s.cfg.trainer.seed, step=b["step"], groups=s.cfg.trace.groups)
        return {"scores": assemble({"scores": scores}, s.mesh, s.rollout.share)["scores"],
                "reward_report": d["reward_report"], "scored_rows": d["scored_rows"]}

    return rollout, kept_reward


def _release_after(s: Services, out: dict) -> dict:
    """A synchronous step's generation has ended: the sampler's copy of the weights is not read
    again before ``weight_sync`` installs the updated ones, so the learner passes run without
    it (31.6M: 121 MiB less at the update's peak). Not in ``trainer.mode=async``, whose
    producer keeps generating during the update."""
    release = getattr(s.rollout.sampler, "release_weights", None)
    if release is not None and s.cfg.trainer.mode != "async":
        release()
    return out


# ---------------------------------------------------------------------------- producer side


def dataset_item(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    """:func:`draw_prompts`, to be generated with the learner's weight version."""
    return state, {**draw_prompts(s, b), "weight_version": state.version}


def dataset_item_facts(ev, v: GroupView, *, system_prompt: Optional[str] = None) -> dict:
    """The group's prompt: its dataset row, position, length, messages and uid."""
    w = v.fields if "dynamic_sampling" in v.fields else ev.writes  # filter_groups: the kept groups' prompts
    p = w["prompts"][v.group]
    return dict(row_index=int(p.index), position=int(p.position), prompt_tokens=len(p.ids),
                truncated=bool(p.truncated), message_count=message_count(getattr(p, "prompt", ""), system_prompt),
                prompt_key=w["uids"][v.group], uid_rule="uid = '{step}-{index in batch}'", num_groups=len(w["uids"]),
                weight_version=w.get("weight_version"))


def draw_prompts(s: Services, b) -> dict:
    """The step's prompts (this process's share of them with several processes) and their uids
    ``{step}-{index in the batch}`` (the one-process uids, so the same random streams)."""
    step = b["step"]
    prompts = next(s.rollout.prompts)
    uids = [f"{step}-{i}" for i in range(len(prompts))]
    share = s.rollout.share
    if share.processes > 1:
        if len(prompts) != share.num_prompts:
            raise RuntimeError(f"step {step}: {len(prompts)} prompts, the rollout shares were made for "
                               f"{share.num_prompts}")
        if s.cfg.algorithm.filter_groups.enable:  # the filter's agreement reads every process's groups
            return {"prompts": prompts[share.lo:share.hi], "uids": uids[share.lo:share.hi], "batch_prompts": prompts}
        prompts, uids = prompts[share.lo:share.hi], uids[share.lo:share.hi]
    return {"prompts": prompts, "uids": uids}


def rollout_sessions(s: Services, b, *, on_chunk: Optional[Callable] = None) -> dict:
    prompts = b["prompts"]
    traj = s.rollout.sampler.generate([p.ids for p in prompts], uids=b["uids"], n=s.cfg.rollout.n,
                                      decode=s.rollout.decode, on_chunk=on_chunk)
    check_weight_version(traj, b["weight_version"])
    return {"trajectories": traj}


def rollout_facts(ev, v: GroupView, *, n: int) -> dict:
    """The group's sessions: per trajectory its versions, status and engine times (multi-turn:
    turns, tool calls, observation masks), and the decode parameters."""
    traj, rows, key_of = v.traj, v.rows, v.key_of
    d = traj.decode
    t_submit = v.wall(ev.t_start)
    trajs = []
    for i in rows:
        insert = t_submit + float(traj.queue_s[i])
        trajs.append({"key": key_of[int(i)], "session": int(traj.session[i]), "index": int(traj.index[i]),
                      "min_version": int(traj.min_version[i]), "max_version": int(traj.max_version[i]),
                      "token_versions": traj.version_spans(int(i)),
                      "status": "truncated" if traj.truncated[i] else "eos",
                      "t_insert": round(insert, 6), "t_finish": round(insert + float(traj.decode_s[i]), 6)})
    episode = _episode_facts(traj, rows, trajs) if getattr(traj, "num_turns", None) is not None else None
    return dict(sessions=sorted({t["session"] for t in trajs}), n=n, trajectories=trajs, episode=episode,
                t_submit=t_submit, weight_version=ev.reads.get("weight_version"),
                decode={"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
                        "max_new_tokens": d.max_new_tokens, "seed": d.seed},
                min_version=min((t["min_version"] for t in trajs), default=None),
                max_version=max((t["max_version"] for t in trajs), default=None))


def _episode_facts(traj, rows, trajs: list) -> dict:
    """Multi-turn episodes (:mod:`rljax.env`): per trajectory (added to ``trajs``) the observation
    tokens' mask and log-prob sums, turns and tool times; the batch's episode counts."""
    ep = traj.episode_stats
    for t, i in zip(trajs, rows):
        roles = np.asarray(traj.roles[i])
        obs, act = roles == 2, (roles == 1) | (roles == 3)  # rljax.loss.Role TOOL_RESULT, actions
        t.update(obs_mask_sum=int(np.asarray(traj.response_mask[i])[obs].sum()),
                 obs_logp_abs_sum=float(np.abs(np.asarray(traj.rollout_logp[i])[obs]).sum()),
                 policy_unmasked=int((act & ~np.asarray(traj.response_mask[i], bool)).sum()))
        t.update(num_turns=int(traj.num_turns[i]), observation_tokens=int(traj.obs_tokens[i]),
                 tool_calls=int(traj.tool_calls[i]), role_spans=[list(sp) for sp in traj.turn_spans[i]])
        if getattr(traj, "tool_s", None) is not None:  # tool latency, and the wait on the env
            t.update(tool_s=round(float(traj.tool_s[i]), 6), env_wait_s=round(float(traj.env_wait_s[i]), 6))
    return {"tool_calls": ep.get("tool_calls"), "tool_errors": ep.get("tool_errors"),
            "tool_timeouts": ep.get("tool_timeouts"), "tool_s": round(float(ep.get("tool_s", 0.0)), 6),
            "env_s": round(float(ep.get("env_s", 0.0)), 6), "turns": ep.get("turns"),
            "context": ("kv: sessions keep their slot and KV cache; observations appended by an extend prefill "
                        f"({ep.get('extended_tokens', 0)} tokens in {ep.get('extend_calls', 0)} calls)"
                        if ep.get("continuation") == "kv" else
                        "re-prefill per turn (observations appended to the context, not the KV cache)"),
            "prefill_tokens": ep.get("prefill_tokens")}


def rollout_episodes(s: Services, b) -> dict:
    """The ``rollout_sessions`` stage of a multi-turn run (``env.function``): one session per
    sample, several turns each (:class:`rljax.env.EnvRuntime`)."""
    r = s.rollout
    traj = r.env.run(r.sampler, b["prompts"], b["uids"], n=s.cfg.rollout.n, decode=r.decode, tokenizer=r.tokenizer)
    check_weight_version(traj, b["weight_version"])
    return {"trajectories": traj}


def check_weight_version(traj, version: int) -> None:
    """A synchronous rollout's trajectories were all generated with the learner's ``version``."""
    used = int(traj.min_version.min())
    if used != version:
        raise RuntimeError(f"rollout used weight version {used}, the learner is at {version}: the weight "
                           "sync did not reach the sampler")


def trajectory_fields(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    """The learner batch as global arrays, assembled from this process's rows (group ids made
    global: this process's prompts start at ``share.lo``). With ``data.trim_prompt_padding`` and
    several processes, the processes all-gather one int (their longest prompt) to agree on the
    prompt width."""
    share = s.rollout.share
    traj, trim, longest = b["trajectories"], s.cfg.data.trim_prompt_padding, None
    if trim and share.processes > 1:  # one width for every process's rows: the longest prompt of all
        longest = int(distribute.per_process(np.array([prompt_longest(traj)], np.int32)).max())
    host = learner_layout(traj, prompt_len=s.learner.prompt_len, response_len=s.learner.response_len, trim=trim,
                          multiple=dict(s.mesh.shape).get("sp", 1), longest=longest)
    if share.processes > 1:
        host["group_id"] = host["group_id"] + np.int32(share.lo)
    faults.learner_fields(host, traj, seed=s.cfg.trainer.seed, step=b["step"], groups=s.cfg.trace.groups,
                          version=state.version)
    return state, assemble(host, s.mesh, share)


def trajectory_fields_facts(ev, v: GroupView) -> dict:
    """Per trajectory: prompt, response and sequence lengths, action and observation tokens."""
    traj, rows = v.traj, v.rows
    resp_len = np.asarray(traj.response_length)
    mask_sum = np.asarray(traj.response_mask)[rows].sum(axis=1)
    turns = getattr(traj, "num_turns", None)
    per = [{"key": v.key_of[int(i)], "prompt_len": int(traj.prompt_length[i]), "response_len": int(resp_len[i]),
            "seq_len": int(traj.prompt_length[i] + resp_len[i]), "response_mask_sum": int(m),
            "observation_tokens": int(resp_len[i] - m), "num_turns": 1 if turns is None else int(turns[i])}
           for i, m in zip(rows, mask_sum)]
    return dict(trajectories=per, layout="prompts left-padded to the learner's prompt length, responses "
                                         "right-padded; input_ids = [prompt | response]")


def score(s: Services, traj, prompts, *, max_error_fraction: float):
    """Scores (NumPy ``[B]``) and the reward report of a rollout."""
    responses = [s.rollout.tokenizer.decode(traj.response_ids[i, : traj.response_length[i]]) for i in range(traj.batch_size)]
    answers = [prompts[traj.group_id[i]].answer if not traj.is_padding[i] else "" for i in range(traj.batch_size)]
    extras = [prompts[traj.group_id[i]].reward_extra() if not traj.is_padding[i] else {} for i in range(traj.batch_size)]
    return score_batch(s.reward.fn, responses, answers, list(traj.uid), max_error_fraction=max_error_fraction,
                       is_padding=traj.is_padding, extras=extras if any(extras) else None)


def reward(s: Services, b) -> dict:
    """Scores of this process's trajectories, where they were generated. With several processes
    the ``reward.max_error_fraction`` bound applies to the whole batch (``gather_rollout``), so
    every process stops together."""
    share = s.rollout.share
    bound = s.cfg.reward.max_error_fraction if share.processes == 1 else 1.0
    traj = b["trajectories"]
    scores, report = score(s, traj, b["prompts"], max_error_fraction=bound)
    if "rm_scores" in b or "judge_scores" in b:  # reward.combine: weighted rule, model and judge scores + penalty
        return dict(combine(s, b, traj, scores), reward_report=report)
    scores = overlong_shaping(s, traj, scores).astype(np.float32)
    # What was scored, per row: the digest of the response tokens and the score (the trace ties
    # each row's score, as the advantage stage reads it, to the trajectory it was computed for).
    scored = {"digest": response_digest(traj), "scores": scores.copy()}
    faults.reward_scores(scores, traj, seed=s.cfg.trainer.seed, step=b["step"], groups=s.cfg.trace.groups)
    return {"scores": assemble({"scores": scores}, s.mesh, share)["scores"], "reward_report": report,
            "scored_rows": scored}


def combine(s: Services, b, traj, scores, *, penalty=None, digest=None) -> dict:
    """``reward.combine``: ``function_weight * rule + penalty + model_weight * rm_scores +
    judge_weight * judge_scores`` on the learner mesh (``scores``, with ``function_scores``), and
    ``scored_rows``: the same sum of this process's rows computed on the host from the same
    terms (the reward model's rows fetched from the learner mesh), beside the digest of the
    tokens the rule and the judge read (the trace's reward tie). ``penalty`` / ``digest``: the
    rows' overlong penalty and token digests where the caller has them (dynamic sampling's kept
    rows: the digests taken where they were scored); else computed from ``traj``."""
    share = s.rollout.share
    penalty = overlong_penalty(s, traj) if penalty is None else penalty
    host = {"function_scores": np.asarray(scores, np.float32),
            "penalty": np.zeros(traj.batch_size, np.float32) if penalty is None else penalty}
    if "judge_scores" in b:
        host["judge_scores"] = np.asarray(b["judge_scores"], np.float32)
    w = s.cfg.reward.combine
    expect = np.float32(w.function_weight) * host["function_scores"] + host["penalty"]
    if "rm_scores" in b:
        expect = expect + np.float32(w.model_weight) * local_rows(b["rm_scores"], share)
    if "judge_scores" in b:
        expect = expect + np.float32(w.judge_weight) * host["judge_scores"]
    scored = {"digest": response_digest(traj) if digest is None else digest, "scores": expect.astype(np.float32)}
    host["function_scores"] = host["function_scores"].copy()
    faults.reward_scores(host["function_scores"], traj, seed=s.cfg.trainer.seed, step=b["step"],
                         groups=s.cfg.trace.groups)
    dev = assemble(host, s.mesh, share)
    combined = w.function_weight * dev["function_scores"] + dev["penalty"]
    if "rm_scores" in b:
        combined = combined + w.model_weight * b["rm_scores"]
    if "judge_scores" in b:
        combined = combined + w.judge_weight * dev["judge_scores"]
    return {"scores": combined, "function_scores": dev["function_scores"], "scored_rows": scored}


def reward_facts(ev, v: GroupView) -> dict:
    """Where the reward sits, and that padding rows got none."""
    scores = ev.writes.get("scores")
    return dict(placement="outcome reward: one scalar per trajectory, on its last action token",
                padding_rows=int(v.is_padding.sum()),
                padding_reward_abs_sum=padding_abs_sum(scores, v.is_padding) if scores is not None else None)


def response_digest(traj) -> np.ndarray:
    """Per row, the position-sensitive digest of the response tokens (observations included)."""
    present = np.arange(traj.response_ids.shape[1])[None, :] < np.asarray(traj.response_length)[:, None]
    return position_digest(present, np.asarray(traj.response_ids))


def reward_model(s: Services, b) -> dict:
    """``reward.model.path``: the reward model's score of each row's prompt + response (``rm_scores
    [B]``), batched over the whole learner batch on the learner mesh: the rows are already
    there in the learner layout (``trajectory_fields``), so no second reshard, and in the
    synchronous step the learner's devices are idle while the reward is computed."""
    return {"rm_scores": s.reward.model.get()(model_inputs(b))}


def load_reward_model(s: Services) -> Callable:
    """``inputs -> [B]`` scores of ``reward.model.path`` (:func:`rljax.models.load_hf_reward_model`),
    parameters sharded on the learner mesh, in the policy's compute dtype."""
    rm = s.cfg.reward.model
    config, head, params, head_w = load_hf_reward_model(rm.path, dtype=s.cfg.model.dtype, mesh=s.mesh)
    if rm.label >= head.num_labels:
        raise ValueError(f"reward.model.label={rm.label}, but {rm.path} has {head.num_labels} label(s)")
    policy = getattr(getattr(s.rollout.sampler, "engine", None), "config", None)
    if policy is not None and policy.vocab_size > config.vocab_size:
        raise ValueError(f"reward.model.path={rm.path} has a vocabulary of {config.vocab_size} tokens, the policy's "
                         f"{policy.vocab_size}: the reward model reads the policy's token ids (same tokenizer needed)")
    graphdef, mesh, label = abstract_params(config)[0], s.mesh, rm.label
    fn = jax.jit(lambda p, w, x: reward_scores(graphdef, p, w, x["input_ids"], mask=x["attention_mask"],
                                               positions=x["positions"], mesh=mesh)[:, label])
    return lambda inputs: fn(params, head_w, inputs)


def reward_judge(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    """``reward.judge``: the generative judge's verdict on each row (:mod:`rljax.trainer.judge`):
    ``judge_scores [B]`` (host), the verdict texts and statuses, and the verdicts' report. The
    judge loads on the first call (``path=ref``: from the policy's weights as the state holds
    them then, before any update). Several processes: each judges the rows it holds; the
    reports are merged and the ``reward.max_error_fraction`` bound applied to the whole batch in
    ``gather_rollout``, so every process stops together."""
    judge = s.reward.judge.get(s, state)
    bound = s.cfg.reward.max_error_fraction if s.rollout.share.processes == 1 else 1.0
    return state, judge(b["trajectories"], b["prompts"], policy_tokenizer=s.rollout.tokenizer, max_error_fraction=bound)


def reward_judge_facts(ev, v: GroupView) -> dict:
    """Each traced row's verdict text (cut to 200 characters), parsed score and status; the batch's
    report (several processes: every process's, merged in ``gather_rollout``)."""
    w = ev.writes
    texts, status, scores = w.get("judge_texts") or (), w.get("judge_status") or (), w.get("judge_scores")
    verdicts = [{"key": v.key_of[int(i)], "text": texts[i][:200], "score": float(scores[i]), "status": status[i]}
                for i in v.rows if i < len(texts)]
    report = v.fields.get("judge_report", w.get("judge_report"))
    return dict(verdicts=verdicts, batch=report.metrics() if report is not None else None)


def load_judge(s: Services, state: RunState):
    """The :class:`~rljax.trainer.judge.Judge` of ``reward.judge``, on the policy sampler's devices,
    with a slot for each row this process judges (its share of the batch); ``path=ref``: the
    policy's initial weights (the reference's copy when the run keeps one; on several processes
    their gathered values, as the policy's sampler takes its weights: its mesh is process-local)."""
    engine, share = s.rollout.sampler.engine, s.rollout.share

    def initial():
        if s.learner.ref_params is not None:
            params = s.learner.ref_params
        elif s.learner.ref_is_base:
            params = disable(state.actor.params)
        else:
            params = initial_policy_params(s.cfg, engine.config, s.mesh)
        return to_host(params) if jax.process_count() > 1 else params

    return Judge.from_config(s.cfg, policy_config=engine.config, policy_tokenizer=s.rollout.tokenizer,
                             devices=list(engine.mesh.devices.flat), initial_params=initial, rows=share.num_rows)


def overlong_penalty(s: Services, rows) -> Optional[np.ndarray]:
    """DAPO's overlong penalty of each row (0 on padding; :func:`rljax.reward.overlong_penalty`),
    ``None`` unless ``reward.reward_kwargs.overlong_buffer_cfg.enable``."""
    kw = s.cfg.reward.reward_kwargs
    ob = kw.overlong_buffer_cfg
    if not ob.enable:
        return None

    p = reward_overlong_penalty(rows.response_length, max_resp_len=kw.max_resp_len or s.cfg.data.max_response_length,
                                buffer_len=ob.len, penalty_factor=ob.penalty_factor)
    return np.where(np.asarray(rows.is_padding), np.float32(0), p)


def overlong_shaping(s: Services, traj, scores: np.ndarray) -> np.ndarray:
    """The task scores plus the overlong penalty (the scores unchanged when it is off)."""
    p = overlong_penalty(s, traj)
    return scores if p is None else np.asarray(scores, np.float32) + p


def episode_reward(s: Services, b) -> dict:
    """The ``reward`` stage of a multi-turn run: each session's final reward, of this process's
    episodes (with several processes the ``reward.max_error_fraction`` bound applies to the whole
    batch, in ``gather_rollout``, as in :func:`reward`)."""
    share = s.rollout.share
    bound = s.cfg.reward.max_error_fraction if share.processes == 1 else 1.0
    scores, report = episode_scores(b["trajectories"], s.reward.fn, b["prompts"], max_error_fraction=bound)
    traj = b["trajectories"]
    if "rm_scores" in b or "judge_scores" in b:  # reward.model / reward.judge: of prompt + whole episode, combined
        return dict(combine(s, b, traj, scores), reward_report=report)
    scores = overlong_shaping(s, traj, scores).astype(np.float32)
    scored = {"digest": response_digest(traj), "scores": scores.copy()}  # the trace's reward tie, as in reward()
    faults.reward_scores(scores, traj, seed=s.cfg.trainer.seed, step=b["step"], groups=s.cfg.trace.groups)
    return {"scores": assemble({"scores": scores}, s.mesh, share)["scores"], "reward_report": report,
            "scored_rows": scored}


def gather_rollout(s: Services, b) -> dict:
    """Several processes: the per-row facts of every process's rows (uids, lengths, versions, the
    generating process; no token arrays) and the whole batch's reward report, on every process.
    Runs on the learner side (in ``trainer.mode=async`` the producer threads never communicate).
    Raises when the batch's reward errors exceed ``reward.max_error_fraction``, or when the
    processes trained different queue batches (asynchronous mode)."""
    share = s.rollout.share
    item = b["queue_item"] if "queue_item" in b else None
    if item is not None:
        indices = distribute.per_process(np.array([int(item["batch_index"])]))[:, 0]
        if len(set(indices.tolist())) > 1:
            raise RuntimeError(f"the processes dequeued different batches {indices.tolist()} for one learner step "
                               "(the staleness gate or an overflow drop differed between processes)")
    rows = distribute.gather_rows(b["trajectories"], share, judge_scores=b.get("judge_scores"))
    report = distribute.merge_reward_reports(b["reward_report"], share)
    bound = s.cfg.reward.max_error_fraction
    report.check(bound, where=f" over {share.processes} processes")
    judged = {}
    if "judge_report" in b:  # reward.judge: every process judged its own rows
        judged["judge_report"] = distribute.merge_judge_reports(b["judge_report"], share)
        judged["judge_report"].check(bound, where=f" over {share.processes} processes")
    stats = b["trajectories"].stats  # the batch's generation rate: every process's tokens over the slowest's time
    per = distribute.per_process(np.array([stats.generated_tokens, stats.wall_s], np.float64))
    rate = float(per[:, 0].sum() / per[:, 1].max()) if per[:, 1].max() > 0 else 0.0
    return {"rollout_rows": rows, "reward_report": report, "rollout_tokens_per_s": rate, **judged}


# ---------------------------------------------------------------------------- learner side


def model_inputs(b) -> dict:
    return {k: b[k] for k in MODEL_INPUTS}


def old_log_prob(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    old_logp, entropy = s.learner.actor.forward(state.actor.params, model_inputs(b))
    return state, {"old_logp": old_logp, "entropy": entropy, "rollout_mismatch": rollout_mismatch(old_logp, b)}


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


def reference(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    params = disable(state.actor.params) if s.learner.ref_is_base else s.learner.ref_params
    return state, {"ref_logp": s.learner.actor.forward(params, model_inputs(b))[0]}


def values(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    return state, {"values": s.learner.critic.forward(state.critic.params, model_inputs(b))}


def advantages(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    fields = {k: b[k] for k in s.learner.prepare_inputs}
    return state, dict(s.learner.prepare(fields, jnp.float32(state.kl_coef)))


def advantages_facts(ev, v: GroupView, *, estimator: str) -> dict:
    return dict(estimator=estimator, returns="materialised (critic targets)" if "values" in ev.reads
                else "= advantages (outcome estimators have no critic)")


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
    if cfg.rollout.correction != "none":
        batch["rollout_is_weights"] = b["rollout_is_weights"]
    return batch


def actor_minibatch(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    batch = actor_batch(s, b)
    before = int(state.actor.step)
    actor, metrics = s.learner.actor.update(state.actor, batch, step_key(state, b["step"]))
    out = {}
    if s.learner.old_logp_in_update:  # the update's own log-probs before its step (detached), [B, T] on the mesh
        out["old_logp"] = metrics.pop("old_logp")
    steps = int(actor.step)
    sc = s.model.step_config  # what the update was built with
    sizes = {"global_batch_size": int(batch["loss_mask"].shape[0]), "ppo_mini_batch_size": int(sc.ppo_mini_batch_size),
             "ppo_micro_batch_size": int(sc.ppo_micro_batch_size), "ppo_epochs": int(sc.ppo_epochs),
             "optimizer_steps_taken": steps - before}
    return state.replace(actor=actor), {"actor_metrics": to_host(metrics), "optimizer_steps": steps,
                                        "update_sizes": sizes, **out}


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


def weight_sync(s: Services, state: RunState, b) -> tuple[RunState, dict]:
    state = state.replace(version=state.version + 1)
    s.rollout.sampler.update_weights(s.rollout.to_sampler(state.actor.params), state.version)
    return state, {"weight_version_after": state.version, "sampler_version": int(s.rollout.sampler.version),
            "weight_sync_s": float(getattr(s.rollout.sampler, "last_weight_sync_s", 0.0))}


def weight_sync_facts(ev, v: GroupView) -> dict:
    w = ev.writes
    return dict(learner_version=w.get("weight_version_after"), sampler_version=w.get("sampler_version"),
                sync_s=round(float(w.get("weight_sync_s") or 0.0), 6), next_rollout_version=w.get("sampler_version"))


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
    if getattr(traj, "num_turns", None) is not None:  # several processes: of every process's episodes
        m.update(episode_metrics(rows.episodes if "rollout_rows" in b else traj))
    m.update(_model_flops(s, rows, real))
    m.update(_update_metrics(b, actor))
    return {"metrics": m}


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


def _update_metrics(b, actor: dict) -> dict:
    """The actor's KL loss, what a skipped update saw, the KL in the reward, the critic's update."""
    m: dict[str, Any] = {}
    if "kl_loss" in actor:
        m["actor/kl_loss"] = actor["kl_loss"]
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
