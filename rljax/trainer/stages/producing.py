"""Producing a batch: the prompts (``dataset_item``), their rollout (``rollout_sessions``) and
the learner's layout of it (``trajectory_fields``).

The rollout goes through the run's client (:mod:`rljax.trainer.clients`, single-turn or
episodes, chosen in build); with ``algorithm.filter_groups`` the rollout stage is the
filtered variant (:mod:`rljax.trainer.dynamic_sampling`): it draws, generates and scores
prompt batches until the batch is full (its reward time counts in ``timing_s/gen``).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from rljax.trace import faults
from rljax.trace.facts import GroupView, message_count
from rljax.trace.rederive import future_rows_error
from rljax.trainer import distribute, dynamic_sampling as ds
from rljax.trainer.clients import SINGLE_TURN
from rljax.trainer.distribute import assemble
from rljax.trainer.runner import stage
from rljax.trainer.services import Services
from rljax.trainer.stages.rewarding import overlong_shaping, response_digest, task_scores
from rljax.trainer.state import RunState

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


# ---------------------------------------------------------------------------- dataset_item


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



@stage("dataset_item", timing="data", state="reads", reads=("step",),
       writes=("prompts", "uids", "weight_version", "batch_prompts"),  # the last: filter_groups, processes > 1
       config=("algorithm.filter_groups.enable", "data.system_prompt"),
       facts=dataset_item_facts, facts_args=lambda s: dict(system_prompt=s.cfg.data.system_prompt),
       summary="-> prompts, uids, weight_version (the learner's)")
def dataset_item(s: Services, state: RunState, b) -> dict:
    """:func:`draw_prompts`, to be generated with the learner's weight version."""
    return {**draw_prompts(s, b), "weight_version": state.version}


# ---------------------------------------------------------------------------- rollout_sessions


def rollout_facts(ev, v: GroupView, *, n: int, client=SINGLE_TURN) -> dict:
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
    episode = client.episode_facts(traj, rows, trajs)  # multi-turn: turns, tool calls, observation masks
    return dict(sessions=sorted({t["session"] for t in trajs}), n=n, trajectories=trajs, episode=episode,
                t_submit=t_submit, weight_version=ev.reads.get("weight_version"),
                decode={"temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p,
                        "max_new_tokens": d.max_new_tokens, "seed": d.seed},
                min_version=min((t["min_version"] for t in trajs), default=None),
                max_version=max((t["max_version"] for t in trajs), default=None))


def check_weight_version(traj, version: int) -> None:
    """A synchronous rollout's trajectories were all generated with the learner's ``version``."""
    used = int(traj.min_version.min())
    if used != version:
        raise RuntimeError(f"rollout used weight version {used}, the learner is at {version}: the weight "
                           "sync did not reach the sampler")



def generate_rollout(s: Services, b, *, on_chunk: Optional[Callable] = None) -> dict:
    """``{"trajectories"}`` of the batch's prompts through the run's client, checked to be
    generated with the batch's weight version (a filtered step's each draw)."""
    traj = s.rollout.client.generate(b["prompts"], b["uids"], n=s.cfg.rollout.n, decode=s.rollout.decode,
                                     on_chunk=on_chunk)
    check_weight_version(traj, b["weight_version"])
    return {"trajectories": traj}


def _release_after(s: Services, out: dict) -> dict:
    """A synchronous step's generation has ended: the sampler's copy of the weights is not read
    again before ``weight_sync`` installs the updated ones, so the learner passes run without
    it (31.6M: 121 MiB less at the update's peak). Not in ``trainer.mode=async``, whose
    producer keeps generating during the update."""
    release = getattr(s.rollout.sampler, "release_weights", None)
    if release is not None and s.cfg.trainer.mode != "async":
        release()
    return out


_ROLLOUT = dict(timing="gen", facts=rollout_facts,
                facts_args=lambda s: dict(n=int(s.cfg.rollout.n), client=s.rollout.client),
                options=("on_chunk",))


@stage("rollout_sessions", reads=("step", "prompts", "uids", "weight_version"), writes=("trajectories",),
       config=("rollout.n", "trainer.mode", "algorithm.filter_groups.enable"),
       when=lambda s: not s.cfg.algorithm.filter_groups.enable, only="without algorithm.filter_groups",
       summary="prompts, uids -> trajectories (host; rollout.n sessions per prompt, multi-turn: whole episodes)",
       **_ROLLOUT)
def rollout_sessions(s: Services, b, *, on_chunk: Optional[Callable] = None) -> dict:
    """The step's rollout through the run's client (single-turn or episodes). ``on_chunk``: called
    by the sampler between decode chunks (the asynchronous schedule installs pushes there with
    ``async_training.partial_rollout``)."""
    return _release_after(s, generate_rollout(s, b, on_chunk=on_chunk))


@stage("rollout_sessions", reads=("step", "prompts", "uids", "weight_version", "batch_prompts"),
       writes=("trajectories", "prompts", "uids", "dynamic_sampling"),
       config=("rollout.n", "trainer.mode", "algorithm.filter_groups", "data.train_batch_size",
               "reward.max_error_fraction", "reward.reward_kwargs", "data.max_response_length"),
       when=lambda s: s.cfg.algorithm.filter_groups.enable, only="with algorithm.filter_groups",
       summary="prompts -> the kept groups' trajectories, prompts, uids and dynamic_sampling (their scores)",
       **_ROLLOUT)
def rollout_filtered(s: Services, b, *, on_chunk: Optional[Callable] = None) -> dict:
    """DAPO dynamic sampling: generate, score and keep prompt groups until the batch is full
    (:func:`rljax.trainer.dynamic_sampling.filtered_rollout`); the ``reward`` stage then places
    the kept rows' scores. With several processes the reward bound applies to the whole batch
    (``gather_rollout``), so every process stops together."""
    bound = s.rollout.share.local_bound(s.cfg.reward.max_error_fraction)
    out = ds.filtered_rollout(s, b, rollout_fn=lambda s, b: generate_rollout(s, b, on_chunk=on_chunk),
                              score_fn=lambda s, traj, prompts: task_scores(s, traj, prompts, max_error_fraction=bound),
                              shape_fn=overlong_shaping, digest_fn=response_digest)
    return _release_after(s, out)


# ---------------------------------------------------------------------------- trajectory_fields


def trajectory_fields_facts(ev, v: GroupView, *, client=SINGLE_TURN) -> dict:
    """Per trajectory: prompt, response and sequence lengths, action and observation tokens."""
    traj, rows = v.traj, v.rows
    resp_len = np.asarray(traj.response_length)
    mask_sum = np.asarray(traj.response_mask)[rows].sum(axis=1)
    turns = client.turns(traj)
    per = [{"key": v.key_of[int(i)], "prompt_len": int(traj.prompt_length[i]), "response_len": int(resp_len[i]),
            "seq_len": int(traj.prompt_length[i] + resp_len[i]), "response_mask_sum": int(m),
            "observation_tokens": int(resp_len[i] - m), "num_turns": int(turns[i])}
           for i, m in zip(rows, mask_sum)]
    return dict(trajectories=per, layout="prompts left-padded to the learner's prompt length, responses "
                                         "right-padded; input_ids = [prompt | response]")



@stage("trajectory_fields", timing="reshard", state="reads", reads=("step", "trajectories"),
       writes=("input_ids", "attention_mask", "positions", "loss_mask", "rollout_logp", "group_id", "row_mask"),
       config=("data.trim_prompt_padding", "trainer.seed", "trace.groups", "trainer.mode"),
       facts=trajectory_fields_facts,
       facts_args=lambda s: dict(client=s.rollout.client),
       summary="trajectories -> input_ids, attention_mask, positions, loss_mask, rollout_logp, group_id, row_mask "
               "(global arrays on the learner mesh)")
def trajectory_fields(s: Services, state: RunState, b) -> dict:
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
    future = s.cfg.trainer.mode != "async" and future_rows_error(traj, state.version, b["step"])
    if future:  # a synchronous step trains its own version's rows only: stopped before the update
        raise RuntimeError(future)
    return assemble(host, s.mesh, share)


#: This module's stages in the order of a step (:data:`rljax.trainer.stages.STEP`).
STAGES = (dataset_item, rollout_sessions, rollout_filtered, trajectory_fields)
