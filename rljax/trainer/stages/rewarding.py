"""Rewarding a batch: one home for scoring.

The task reward (:func:`task_scores`: the rule or plugin of ``reward.reward_fn``, or an
episode's final reward), DAPO's overlong shaping (:func:`overlong_penalty`), the reward model
(``reward_model``), the generative judge (``reward_judge``), their weighted combination
(:func:`combine`) and the ``reward.max_error_fraction`` bound (applied by each process to its
own rows on one process, to the whole batch in ``gather_rollout`` on several:
:meth:`rljax.trainer.distribute.Share.local_bound`) are all here. The ``reward`` stage is the
same for single-turn and multi-turn runs and for filtered batches (whose rows the rollout
stage already scored: it places their scores).

A new reward kind is a function here (or a plugin of :mod:`rljax.reward`) plus its test; see
``docs/development.md``.
"""

from __future__ import annotations

from typing import Optional

import jax
import numpy as np

from rljax.env import episode_scores
from rljax.reward import overlong_penalty as reward_overlong_penalty, score_batch
from rljax.trace import faults
from rljax.trace.facts import GroupView, padding_abs_sum
from rljax.trace.invariants import position_digest
from rljax.trainer import distribute
from rljax.trainer.distribute import assemble, local_rows
from rljax.trainer.runner import stage
from rljax.trainer.services import Services
from rljax.trainer.staleness import rows_staleness
from rljax.trainer.state import RunState

#: The learner batch fields that the forward passes read.
MODEL_INPUTS = ("input_ids", "attention_mask", "positions")


def model_inputs(b) -> dict:
    return {k: b[k] for k in MODEL_INPUTS}


# ---------------------------------------------------------------------------- scores


def score(s: Services, traj, prompts, *, max_error_fraction: float):
    """Scores (NumPy ``[B]``) and the reward report of a rollout."""
    responses = [s.rollout.tokenizer.decode(traj.response_ids[i, : traj.response_length[i]]) for i in range(traj.batch_size)]
    answers = faults.reward_answers([prompts[traj.group_id[i]].answer if not traj.is_padding[i] else ""
                                     for i in range(traj.batch_size)], traj)  # hook for rljax.trace.faults
    extras = [prompts[traj.group_id[i]].reward_extra() if not traj.is_padding[i] else {} for i in range(traj.batch_size)]
    return score_batch(s.reward.fn, responses, answers, list(traj.uid), max_error_fraction=max_error_fraction,
                       is_padding=traj.is_padding, extras=extras if any(extras) else None)


def task_scores(s: Services, traj, prompts, *, max_error_fraction: float):
    """The task reward of a rollout (NumPy ``[B]``) and its report: each trajectory's response
    scored by the reward function, or, for episodes (the run's client says so), each episode's
    final reward (the environment's, else its final turn's: :func:`rljax.env.episode_scores`)."""
    if s.rollout.client.episodes:
        return episode_scores(traj, s.reward.fn, prompts, max_error_fraction=max_error_fraction)
    return score(s, traj, prompts, max_error_fraction=max_error_fraction)


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


def response_digest(traj) -> np.ndarray:
    """Per row, the position-sensitive digest of the response tokens (observations included)."""
    present = np.arange(traj.response_ids.shape[1])[None, :] < np.asarray(traj.response_length)[:, None]
    return position_digest(present, np.asarray(traj.response_ids))



#: The scores combined with the rule's (``reward.combine``), in the order they are summed: the
#: batch field and the ``reward.combine`` weight that scales it. A field on the learner mesh (the
#: reward model's) is read there; a host one (the judge's) is placed on the mesh with the rule's.
COMBINED = (("rm_scores", "model_weight"), ("judge_scores", "judge_weight"))


def combine(s: Services, b, traj, scores, *, penalty=None, digest=None) -> dict:
    """``reward.combine``: ``function_weight * rule + penalty + model_weight * rm_scores +
    judge_weight * judge_scores`` (the terms of :data:`COMBINED` present) on the learner mesh
    (``scores``, with ``function_scores``), and ``scored_rows``: the same sum of this process's
    rows computed on the host from the same terms (the reward model's rows fetched from the
    learner mesh), beside the digest of the tokens the rule and the judge read (the trace's
    reward tie). ``penalty`` / ``digest``: the rows' overlong penalty and token digests where the
    caller has them (dynamic sampling's kept rows: the digests taken where they were scored);
    else computed from ``traj``."""
    share, w = s.rollout.share, s.cfg.reward.combine
    penalty = overlong_penalty(s, traj) if penalty is None else penalty
    host = {"function_scores": np.asarray(scores, np.float32),
            "penalty": np.zeros(traj.batch_size, np.float32) if penalty is None else penalty}
    terms = [(field, getattr(w, weight), isinstance(b[field], jax.Array)) for field, weight in COMBINED if field in b]
    host.update({field: np.asarray(b[field], np.float32) for field, _, on_mesh in terms if not on_mesh})
    expect = np.float32(w.function_weight) * host["function_scores"] + host["penalty"]
    for field, weight, on_mesh in terms:
        expect = expect + np.float32(weight) * (local_rows(b[field], share) if on_mesh else host[field])
    scored = {"digest": response_digest(traj) if digest is None else digest, "scores": expect.astype(np.float32)}
    host["function_scores"] = host["function_scores"].copy()
    faults.reward_scores(host["function_scores"], traj, seed=s.cfg.trainer.seed, step=b["step"],
                         groups=s.cfg.trace.groups)
    dev = assemble(host, s.mesh, share)
    combined = w.function_weight * dev["function_scores"] + dev["penalty"]
    for field, weight, on_mesh in terms:
        combined = combined + weight * (b[field] if on_mesh else dev[field])
    return {"scores": combined, "function_scores": dev["function_scores"], "scored_rows": scored}




def _combining(b) -> bool:
    """``reward.model.path`` / ``reward.judge.path``: the rule's scores are combined with theirs."""
    return any(field in b for field, _ in COMBINED)


def _placed(s: Services, b, traj) -> dict:
    """The scores of a filtered batch (``algorithm.filter_groups``), which the rollout stage computed
    while it kept the groups: the rule's plus the overlong penalty, with the digest of the tokens
    each was computed for, taken where it was scored (before the processes' exchange)."""
    d = b["dynamic_sampling"]
    if _combining(b):  # the kept rows' rule scores are the filter's minus the penalty (float32), then combined
        p = overlong_penalty(s, traj)
        p = np.zeros(traj.batch_size, np.float32) if p is None else p
        rule = np.asarray(d["scores"], np.float32) - p
        return dict(combine(s, b, traj, rule, penalty=p, digest=d["scored_rows"]["digest"]),
                    reward_report=d["reward_report"])
    return {"scores": np.array(d["scores"], np.float32), "reward_report": d["reward_report"],
            "scored_rows": d["scored_rows"]}


def reward_facts(ev, v: GroupView) -> dict:
    """Where the reward sits, and that padding rows got none."""
    scores = ev.writes.get("scores")
    return dict(placement="outcome reward: one scalar per trajectory, on its last action token",
                padding_rows=int(v.is_padding.sum()),
                padding_reward_abs_sum=padding_abs_sum(scores, v.is_padding) if scores is not None else None)


_SCORING = ("reward.max_error_fraction", "reward.combine", "reward.reward_kwargs", "data.max_response_length",
            "trainer.seed", "trace.groups")


@stage("reward", timing="reward", reads=("step", "trajectories", "prompts", "dynamic_sampling",
                                         *(field for field, _ in COMBINED)),
       writes=("scores", "function_scores", "reward_report", "scored_rows"), config=_SCORING, facts=reward_facts,
       summary="trajectories, prompts (+ rm_scores, judge_scores) -> scores, reward_report, scored_rows")
def reward(s: Services, b) -> dict:
    """Scores of this process's trajectories, where they were generated: the task reward plus the
    overlong penalty, or (``reward.model`` / ``reward.judge``) :func:`combine`'s weighted sum; a
    filtered batch's scores as the rollout stage computed them. With several processes the
    ``reward.max_error_fraction`` bound applies to the whole batch (``gather_rollout``), so every
    process stops together."""
    traj = b["trajectories"]
    if "dynamic_sampling" in b:
        out = _placed(s, b, traj)
        if "function_scores" in out:
            return out
        scores, report, scored = out["scores"], out["reward_report"], out["scored_rows"]
    else:
        bound = s.rollout.share.local_bound(s.cfg.reward.max_error_fraction)
        scores, report = task_scores(s, traj, b["prompts"], max_error_fraction=bound)
        if _combining(b):  # reward.combine: weighted rule, model and judge scores + penalty
            return dict(combine(s, b, traj, scores), reward_report=report)
        scores = overlong_shaping(s, traj, scores).astype(np.float32)
        # What was scored, per row: the digest of the response tokens and the score (the trace ties
        # each row's score, as the advantage stage reads it, to the trajectory it was computed for).
        scored = {"digest": response_digest(traj), "scores": scores.copy()}
    faults.reward_scores(scores, traj, seed=s.cfg.trainer.seed, step=b["step"], groups=s.cfg.trace.groups)
    return {"scores": assemble({"scores": scores}, s.mesh, s.rollout.share)["scores"], "reward_report": report,
            "scored_rows": scored}


# ---------------------------------------------------------------------------- reward model, judge


@stage("reward_model", timing="reward_model", reads=MODEL_INPUTS, writes=("rm_scores",), config=("reward.model.path",),
       when=lambda s: s.cfg.reward.model.path is not None, only="with reward.model.path",
       summary="input_ids, attention_mask, positions -> rm_scores (on the learner mesh)")
def reward_model(s: Services, b) -> dict:
    """``reward.model.path``: the reward model's score of each row's prompt + response (``rm_scores
    [B]``), batched over the whole learner batch on the learner mesh: the rows are already
    there in the learner layout (``trajectory_fields``), so no second reshard, and in the
    synchronous step the learner's devices are idle while the reward is computed."""
    return {"rm_scores": s.reward.model.get()(model_inputs(b))}



def reward_judge_facts(ev, v: GroupView) -> dict:
    """Each traced row's verdict text (cut to 200 characters), parsed score and status; the batch's
    report (several processes: every process's, merged in ``gather_rollout``)."""
    w = ev.writes
    texts, status, scores = w.get("judge_texts") or (), w.get("judge_status") or (), w.get("judge_scores")
    verdicts = [{"key": v.key_of[int(i)], "text": texts[i][:200], "score": float(scores[i]), "status": status[i]}
                for i in v.rows if i < len(texts)]
    report = v.fields.get("judge_report", w.get("judge_report"))
    return dict(verdicts=verdicts, batch=report.metrics() if report is not None else None)



@stage("reward_judge", timing="reward_judge", state="reads", reads=("trajectories", "prompts"),
       writes=("judge_scores", "judge_texts", "judge_status", "judge_report"),
       config=("reward.judge.path", "reward.max_error_fraction"), facts=reward_judge_facts,
       when=lambda s: s.cfg.reward.judge.path is not None, only="with reward.judge.path",
       summary="trajectories, prompts -> judge_scores, judge_texts, judge_status, judge_report")
def reward_judge(s: Services, state: RunState, b) -> dict:
    """``reward.judge``: the generative judge's verdict on each row (:mod:`rljax.trainer.judge`):
    ``judge_scores [B]`` (host), the verdict texts and statuses, and the verdicts' report. The
    judge loads on the first call (``path=ref``: from the policy's weights as the state holds
    them then, before any update). Several processes: each judges the rows it holds; the
    reports are merged and the ``reward.max_error_fraction`` bound applied to the whole batch in
    ``gather_rollout``, so every process stops together."""
    judge = s.reward.judge.get(state)
    bound = s.rollout.share.local_bound(s.cfg.reward.max_error_fraction)
    return judge(b["trajectories"], b["prompts"], policy_tokenizer=s.rollout.tokenizer, max_error_fraction=bound)


# ---------------------------------------------------------------------------- several processes


@stage("gather_rollout", timing="gather_rollout", comm=True,
       reads=("queue_item", "dequeue", "trajectories", "reward_report", "judge_scores", "judge_report"),
       writes=("rollout_rows", "reward_report", "rollout_tokens_per_s", "judge_report", "dequeue"),
       config=("reward.max_error_fraction",), when=lambda s: s.rollout.share.processes > 1,
       only="with several processes",
       summary="trajectories, reward_report, judge_report -> rollout_rows, reward_report, judge_report (the whole "
               "batch's; the bound reward.max_error_fraction checked over it)")
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
    rows = distribute.gather_rows(b["trajectories"], share, judge_scores=b.get("judge_scores"),
                                  episodes=s.rollout.client.gather_episodes)
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
    if "dequeue" in b:  # trainer.mode=async: the staleness facts over every process's rows
        judged["dequeue"] = rows_staleness(b["dequeue"], rows)
    return {"rollout_rows": rows, "reward_report": report, "rollout_tokens_per_s": rate, **judged}


#: This module's stages in the order of a step (:data:`rljax.trainer.stages.STEP`).
STAGES = (reward_model, reward_judge, reward, gather_rollout)
