"""Multi-turn rollouts: an episode loop over :class:`rljax.rollout.Sampler`.

Per turn, every unfinished session decodes one turn (until the tool stop token, EOS, or its
token budget); the environments answer all turns at once (:meth:`Environment.step_many`,
tools of many sessions concurrently); each observation is tokenized, cut to
``max_obs_tokens``, and appended to the session's context; the next turn decodes from the
whole context. A session stays one session: one trajectory keyed ``{uid}_{session}_0``
whatever its number of turns (the seed's rule: turns do not create sessions; ``index`` 0
because an episode returns one output).

**Context continuation: re-prefill, not in-place KV append.** Each turn is a
``Sampler.generate`` call whose prompt is the session's whole context so far (prompt, model
turns, observations): the sampler prefills it (one prefill for all the sessions of the
turn, batched) and decodes the next turn with continuous batching. The earlier context is
recomputed once per turn. Why: the engine's prefill writes a fresh cache row from position
0, and extending a live slot's cache by an observation needs a new engine entry point (a
prefill that starts at the slot's cache index and keeps the slot between turns) in code two
other helpers are changing now; the re-prefill costs ``O(context)`` per turn, which is
small next to the decode for short observations, and it computes exactly what the learner
recomputes (the same positions and tokens), so ``rollout_logp`` needs no special care.
The in-place continuation is the follow-up named in the README.

Data contract (``T`` = ``data.max_response_length``): the response region holds the model
turns and the observations in order. ``response_mask`` and ``loss_mask`` are 1 only on
policy tokens (verl's convention: the response mask is the action mask), observations 0;
``response_attention`` is 1 on every token present; ``rollout_logp`` is 0 on observations;
``roles`` holds :class:`rljax.loss.Role` per token. Observations count against ``T`` (they
occupy the context), not against the policy's tokens: the response budget is ``T`` tokens
of context, of which the policy wrote ``response_mask.sum()``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Optional

import flax
import numpy as np

from rljax.env._protocol import Example, Step, Turn, env_metrics
from rljax.loss import Role
from rljax.rollout.trajectory import RolloutStats, Trajectories


@flax.struct.dataclass
class EpisodeTrajectories(Trajectories):
    """:class:`Trajectories` of multi-turn episodes, plus (``B`` rows, ``T`` response columns):

    response_attention ``[B,T]`` bool: every token present (model turns and observations).
    roles ``[B,T]`` int8: :class:`rljax.loss.Role` per response token (``PADDING`` after).
    num_turns ``[B]`` int32: model turns. obs_tokens ``[B]`` int32: observation tokens.
    tool_calls ``[B]`` int32. env_reward ``[B]`` float32: the environment's final reward,
    NaN where ``reward.function`` scores the final turn.

    Host fields: final_text (the final turn's text per row), turn_spans (per row, the
    ``(start, end, role)`` spans of the response), episode (totals: tool calls, errors,
    timeouts, tool seconds, turns).
    """

    response_attention: np.ndarray = None
    roles: np.ndarray = None
    num_turns: np.ndarray = None
    obs_tokens: np.ndarray = None
    tool_calls: np.ndarray = None
    env_reward: np.ndarray = None
    final_text: tuple = flax.struct.field(pytree_node=False, default=())
    turn_spans: tuple = flax.struct.field(pytree_node=False, default=())
    episode: tuple = flax.struct.field(pytree_node=False, default=())  # sorted (name, value) items

    @property
    def episode_stats(self) -> dict:
        return dict(self.episode)


@dataclasses.dataclass
class _Session:
    env: object
    context: list
    resp: list = dataclasses.field(default_factory=list)
    action: list = dataclasses.field(default_factory=list)
    logp: list = dataclasses.field(default_factory=list)
    roles: list = dataclasses.field(default_factory=list)
    spans: list = dataclasses.field(default_factory=list)
    turns: int = 0
    obs: int = 0
    calls: int = 0
    done: bool = False
    truncated: bool = False
    reward: Optional[float] = None
    final_text: str = ""
    min_version: int = 1 << 30
    max_version: int = 0


def run_episodes(sampler, prompts: Sequence, *, uids: Sequence[str], n: int, decode, env_cls, tokenizer,
                 stop_id: int, max_turns: int, max_response_tokens: int, max_obs_tokens: int,
                 pad_to_multiple: int = 1) -> EpisodeTrajectories:
    """Runs ``n`` episodes (sessions) per prompt; returns one trajectory per session.

    Args:
      sampler: the :class:`rljax.rollout.Sampler` (its engine's ``max_prefill_length`` must
        hold a prompt plus ``max_response_tokens``).
      prompts: objects with ``ids``, ``prompt`` and ``answer`` (:class:`rljax.data.Prompt`).
      uids: one group key per prompt. decode: training / validation ``DecodeParams``
        (``max_new_tokens`` caps one turn).
      env_cls: the environment class (one instance per session).
      stop_id: the token that ends a turn as a tool call. max_turns: model turns per
        episode. max_response_tokens: ``T``, turns plus observations. max_obs_tokens: an
        observation is cut to this many tokens.
    """
    t0 = time.perf_counter()
    eos = tuple(sampler.engine.eos_ids(decode))
    turn_decode = dataclasses.replace(decode, eos_ids=eos + (int(stop_id),))
    total = len(prompts) * n
    sessions = []
    for r in range(total):
        p, s = prompts[r // n], r % n
        ex = Example(prompt=str(getattr(p, "prompt", "")), answer=str(getattr(p, "answer", "")),
                     index=int(getattr(p, "index", r // n)), uid=str(uids[r // n]), session=s)
        sessions.append(_Session(env=env_cls(ex), context=list(int(t) for t in p.ids)))
    steps_all: list[Step] = []
    gen_s = env_s = prefill_s = decode_s = sync_s = 0.0
    gen_tokens = prefill_calls = prefill_rows = chunks = 0
    version_start = version_end = None
    for turn in range(max_turns):
        live = [r for r, s in enumerate(sessions) if not s.done]
        if not live:
            break
        budget = {r: max_response_tokens - len(sessions[r].resp) for r in live}
        for r in live:
            if budget[r] <= 0:
                sessions[r].done = sessions[r].truncated = True
        live = [r for r in live if budget[r] > 0]
        if not live:
            break
        cap = min(max(budget[r] for r in live), decode.max_new_tokens)
        tg = time.perf_counter()
        out = sampler.generate([sessions[r].context for r in live],
                               uids=[f"{uids[r // n]}_{r % n}_t{turn}" for r in live], n=1,
                               decode=dataclasses.replace(turn_decode, max_new_tokens=cap))
        gen_s += time.perf_counter() - tg
        st = out.stats
        prefill_s, decode_s, sync_s = prefill_s + st.prefill_s, decode_s + st.decode_s, sync_s + st.weight_sync_s
        gen_tokens, prefill_calls = gen_tokens + st.generated_tokens, prefill_calls + st.prefill_calls
        prefill_rows, chunks = prefill_rows + st.prefill_rows, chunks + st.decode_chunks
        version_start = st.version_start if version_start is None else version_start
        version_end = st.version_end
        turns = []
        for j, r in enumerate(live):
            s = sessions[r]
            length = int(out.response_length[j])
            ids = [int(t) for t in out.response_ids[j, :length]]
            lps = [float(x) for x in out.rollout_logp[j, :length]]
            if length > budget[r]:
                ids, lps = ids[: budget[r]], lps[: budget[r]]
            last = ids[-1] if ids else -1
            stopped = "tool" if last == stop_id else ("eos" if last in eos else "length")
            role = Role.AGENT_CALL if stopped == "tool" else Role.AGENT_ANSWER
            start = len(s.resp)
            s.resp += ids
            s.action += [1] * len(ids)
            s.logp += lps
            s.roles += [int(role)] * len(ids)
            s.context += ids
            s.spans.append((start, len(s.resp), int(role)))
            s.turns += 1
            s.min_version = min(s.min_version, int(out.min_version[j]))
            s.max_version = max(s.max_version, int(out.max_version[j]))
            body = ids[:-1] if stopped != "length" else ids
            turns.append(Turn(text=tokenizer.decode(body), token_ids=tuple(ids), stopped=stopped, index=turn))
        te = time.perf_counter()
        envs = [sessions[r].env for r in live]
        steps = type(envs[0]).step_many(envs, turns)
        env_s += time.perf_counter() - te
        steps_all += steps
        for r, t, step in zip(live, turns, steps):
            s = sessions[r]
            s.final_text = t.text
            if step.tool is not None or step.error:
                s.calls += 1
            if step.observation is None or turn == max_turns - 1:
                s.done, s.reward = True, step.reward
                s.truncated = s.truncated or t.stopped != "eos"
                continue
            obs = [int(x) for x in tokenizer.encode(step.observation)][:max_obs_tokens]
            room = max_response_tokens - len(s.resp)
            if len(obs) >= room:  # no room for the observation and another turn
                s.done = s.truncated = True
                obs = obs[:room]
            start = len(s.resp)
            s.resp += obs
            s.action += [0] * len(obs)
            s.logp += [0.0] * len(obs)
            s.roles += [int(Role.TOOL_RESULT)] * len(obs)
            s.context += obs
            s.obs += len(obs)
            if obs:
                s.spans.append((start, len(s.resp), int(Role.TOOL_RESULT)))
    for s in sessions:
        s.done = True
    wall = time.perf_counter() - t0
    stats = RolloutStats(wall_s=wall, prefill_s=prefill_s, decode_s=decode_s, weight_sync_s=sync_s,
                         generated_tokens=gen_tokens, prefill_calls=prefill_calls, prefill_rows=prefill_rows,
                         decode_chunks=chunks, num_slots=sampler.engine.num_slots,
                         version_start=int(version_start or 0), version_end=int(version_end or 0))
    episode = env_metrics(steps_all)
    episode.update(gen_s=gen_s, env_s=env_s, turns=sum(s.turns for s in sessions))
    return _assemble(sampler, prompts, n, uids, decode, sessions, stats, episode, max_response_tokens,
                     pad_to_multiple)


def _assemble(sampler, prompts, n, uids, decode, sessions, stats, episode, T, pad_to_multiple):
    total = len(sessions)
    padded = -(-total // pad_to_multiple) * pad_to_multiple
    pad_id = sampler.pad_id
    s_max = max(len(p.ids) for p in prompts)
    prompt_ids = np.full((padded, s_max), pad_id, np.int32)
    prompt_mask = np.zeros((padded, s_max), bool)
    resp = np.full((padded, T), pad_id, np.int32)
    action = np.zeros((padded, T), bool)
    present = np.zeros((padded, T), bool)
    logp = np.zeros((padded, T), np.float32)
    roles = np.full((padded, T), int(Role.PADDING), np.int8)
    length = np.zeros(padded, np.int32)
    plen = np.zeros(padded, np.int32)
    for r, s in enumerate(sessions):
        p = prompts[r // n].ids
        prompt_ids[r, s_max - len(p):], prompt_mask[r, s_max - len(p):], plen[r] = p, True, len(p)
        k = len(s.resp)
        resp[r, :k], action[r, :k], present[r, :k], logp[r, :k], roles[r, :k] = s.resp, s.action, True, s.logp, s.roles
        length[r] = k
    is_padding = np.arange(padded) >= total

    def col(values, dtype, fill=0):
        out = np.full(padded, fill, dtype)
        out[:total] = values
        return out

    zeros = np.zeros(padded, np.float32)
    return EpisodeTrajectories(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=resp, response_mask=action,
        loss_mask=action & ~is_padding[:, None], rollout_logp=logp, prompt_length=plen, response_length=length,
        truncated=col([s.truncated for s in sessions], bool, False),
        group_id=col([r // n for r in range(total)], np.int32),
        min_version=col([s.min_version for s in sessions], np.int32),
        max_version=col([s.max_version for s in sessions], np.int32),
        is_padding=is_padding, queue_s=zeros, prefill_s=zeros.copy(), decode_s=zeros.copy(),
        uid=tuple(str(uids[r // n]) for r in range(total)) + ("",) * (padded - total),
        session=tuple(r % n for r in range(total)) + (-1,) * (padded - total),
        index=(0,) * total + (-1,) * (padded - total),
        decode=decode, stats=stats, num_groups=len(prompts), pad_id=pad_id,
        response_attention=present, roles=roles, num_turns=col([s.turns for s in sessions], np.int32),
        obs_tokens=col([s.obs for s in sessions], np.int32), tool_calls=col([s.calls for s in sessions], np.int32),
        env_reward=col([np.nan if s.reward is None else s.reward for s in sessions], np.float32, np.nan),
        final_text=tuple(s.final_text for s in sessions) + ("",) * (padded - total),
        turn_spans=tuple(tuple(s.spans) for s in sessions) + ((),) * (padded - total),
        episode=tuple(sorted(episode.items())),
    )


def episode_scores(traj: EpisodeTrajectories, reward_fn, prompts, *, max_error_fraction: float):
    """Scores ``[B]`` (the environment's final reward, else ``reward_fn`` on the final turn's
    text) and the reward report."""
    from rljax.reward import score_batch

    answers = [prompts[traj.group_id[i]].answer if not traj.is_padding[i] else "" for i in range(traj.batch_size)]
    scores, report = score_batch(reward_fn, list(traj.final_text), answers, list(traj.uid),
                                 max_error_fraction=max_error_fraction, is_padding=traj.is_padding)
    env = np.asarray(traj.env_reward)
    return np.where(np.isnan(env), scores, env).astype(np.float32), report
