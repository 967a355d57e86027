"""Multi-turn rollouts: episodes as a client of the rollout driver (:mod:`rljax.rollout.driver`).

A session (episode) starts from a prompt and alternates model turns and observations: a turn
decodes until the tool stop token, EOS, or its token budget; the environment answers the turn
(:meth:`Environment.step_many`); an observation is tokenized, cut to ``max_obs_tokens``, and
appended to the session's context; the next turn decodes from there. A session stays one
session: one trajectory keyed ``{uid}_{session}_0`` whatever its number of turns (the seed's
rule: turns do not create sessions; ``index`` 0 because an episode returns one output).

**Context continuation** (``continuation``, config ``env.continuation``):

``"kv"`` (default): a session keeps its decode slot and KV cache for the whole episode. The
scheduling is the sampler's :class:`rljax.rollout.driver.Driver` (the one decode driver; this
package holds no decode loop): each prompt is one multi-turn request of ``n`` sessions
(prefilled once, inserted into its sessions' slots as they free). When a session's turn ends
the driver raises ``turn_ended`` and *parks* its slot (its cache kept, nothing decoded for it);
the turn goes to the environment on a thread pool while the other slots keep decoding: each
session's :meth:`Environment.step` on its own worker, or, for an environment that overrides
:meth:`Environment.step_many` (e.g. :class:`ToolEnv`, whose sandbox runs a batch
concurrently), one ``step_many`` call per round's finished turns, several such calls at once.
After each round the host waits at most one decode step's time for answers still running, so
tools that answer at once resume together (one decode wave, not two) while a slow tool holds
up nobody for longer than a step. An answer with an observation resumes the session
(:meth:`Driver.resume`: the driver writes the turn's last token and the observation into the
slot's cache at its current length with :meth:`RljaxEngine.extend_many` -- one chunked forward
pass over the new tokens only; the earlier context is attended to, never recomputed -- samples
the next turn's first token, and the slot decodes on); an answer that ends the episode frees
the slot (:meth:`Driver.end`), which takes a waiting session: continuous batching across
turns. Per turn the prefilled tokens are the observation plus one.

``"reprefill"`` (the reference): each turn is a ``Sampler.generate`` call over all unfinished
sessions whose prompt is the session's whole context so far; every turn recomputes the
earlier context (``O(context)`` per turn), and all sessions wait for the slowest tool.

Both paths compute the same numbers: turn ``k`` of session ``(uid, s)`` samples from the
random stream of ``({uid}_{s}_t{k}, 0)``, and greedy decoding gives the same tokens (and
``rollout_logp`` to float rounding) on either path (``tests/env/test_env_kv.py``). A turn that
would pass the session's response budget is cut to it on the host (and ends the session) in
both paths.

Data contract (``T`` = ``data.max_response_length``): the response region holds the model
turns and the observations in order. ``response_mask`` and ``loss_mask`` are 1 only on
policy tokens (verl's convention: the response mask is the action mask), observations 0;
``response_attention`` is 1 on every token present; ``rollout_logp`` is 0 on observations;
``roles`` holds :class:`rljax.loss.Role` per token. Observations count against ``T`` (they
occupy the context), not against the policy's tokens: the response budget is ``T`` tokens
of context, of which the policy wrote ``response_mask.sum()``. Versions: a trajectory's
``min_version`` / ``max_version`` are the oldest / newest weight versions any of its turns
decoded with.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Optional

import flax
import numpy as np

from rljax.env._protocol import Environment, Example, Step, Turn, env_metrics
from rljax.loss import Role
from rljax.reward import score_batch
from rljax.rollout import DecodeParams, trajectory_keys
from rljax.rollout.driver import NO_VERSION, Request
from rljax.rollout.stream import RolloutStream, StreamBatch, empty_stats
from rljax.rollout.trajectory import RolloutStats, Trajectories

CONTINUATIONS = ("kv", "reprefill")


@flax.struct.dataclass
class EpisodeTrajectories(Trajectories):
    """:class:`Trajectories` of multi-turn episodes, plus (``B`` rows, ``T`` response columns):

    response_attention ``[B,T]`` bool: every token present (model turns and observations).
    roles ``[B,T]`` int8: :class:`rljax.loss.Role` per response token (``PADDING`` after).
    num_turns ``[B]`` int32: model turns. obs_tokens ``[B]`` int32: observation tokens.
    tool_calls ``[B]`` int32. env_reward ``[B]`` float32: the environment's final reward,
    NaN where ``reward.function`` scores the final turn. tool_s ``[B]`` float32: the
    session's tool latency (the tools' own seconds, :attr:`Step.seconds`, summed).
    env_wait_s ``[B]`` float32: wall seconds the session waited on its environment (turn end
    to answer, summed over turns; with ``continuation="kv"`` other sessions decode meanwhile).

    Host fields: final_text (the final turn's text per row), turn_spans (per row, the
    ``(start, end, role)`` spans of the response), episode (totals: tool calls, errors,
    timeouts, tool seconds, turns, the continuation and its prefill counts).
    """

    response_attention: np.ndarray = None
    roles: np.ndarray = None
    num_turns: np.ndarray = None
    obs_tokens: np.ndarray = None
    tool_calls: np.ndarray = None
    env_reward: np.ndarray = None
    tool_s: np.ndarray = None
    env_wait_s: np.ndarray = None
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
    versions: list = dataclasses.field(default_factory=list)  # weight version per response token (-1: observation)
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
    tool_s: float = 0.0
    env_wait_s: float = 0.0
    queue_s: float = 0.0  # seconds from the call's start to the session's first decode
    decode_s: float = 0.0  # seconds from its first decode to its end


@dataclasses.dataclass(frozen=True)
class _Limits:
    stop_id: int
    eos: tuple
    max_turns: int
    max_response_tokens: int
    max_obs_tokens: int


def _take_turn(s: _Session, ids, lps, lim: _Limits, tokenizer, versions) -> Turn:
    """Records a decoded turn (its tokens, log-probs and each token's weight version) in its
    session (cut to the session's response budget)."""
    budget = lim.max_response_tokens - len(s.resp)
    ids, lps = [int(t) for t in ids[:budget]], [float(x) for x in lps[:budget]]
    s.versions += [int(v) for v in versions[: len(ids)]]
    last = ids[-1] if ids else -1
    stopped = "tool" if last == lim.stop_id else ("eos" if last in lim.eos else "length")
    role = Role.AGENT_CALL if stopped == "tool" else Role.AGENT_ANSWER
    start = len(s.resp)
    s.resp += ids
    s.action += [1] * len(ids)
    s.logp += lps
    s.roles += [int(role)] * len(ids)
    s.context += ids
    s.spans.append((start, len(s.resp), int(role)))
    body = ids[:-1] if stopped != "length" else ids
    turn = Turn(text=tokenizer.decode(body), token_ids=tuple(ids), stopped=stopped, index=s.turns)
    s.turns += 1
    return turn


def _take_step(s: _Session, turn: Turn, step: Step, lim: _Limits, tokenizer) -> Optional[list]:
    """Applies the environment's answer; returns the observation tokens the session continues
    with, or ``None`` when the episode ended (a cut observation that fills the budget is
    recorded, and ends it)."""
    s.final_text = turn.text
    s.tool_s += float(step.seconds)
    if step.tool is not None or step.error:
        s.calls += 1
    if step.observation is None or turn.index == lim.max_turns - 1:
        s.done, s.reward = True, step.reward
        s.truncated = s.truncated or turn.stopped != "eos"
        return None
    obs = [int(x) for x in tokenizer.encode(step.observation)][: lim.max_obs_tokens]
    room = lim.max_response_tokens - len(s.resp)
    if len(obs) >= room:  # no room for the observation and another turn
        s.done = s.truncated = True
        obs = obs[:room]
    start = len(s.resp)
    s.resp += obs
    s.action += [0] * len(obs)
    s.logp += [0.0] * len(obs)
    s.versions += [NO_VERSION] * len(obs)
    s.roles += [int(Role.TOOL_RESULT)] * len(obs)
    s.context += obs
    s.obs += len(obs)
    if obs:
        s.spans.append((start, len(s.resp), int(Role.TOOL_RESULT)))
    return None if s.done else obs


def _turn_uid(uids, n, r, turn) -> str:
    """The random-stream uid of session ``r``'s turn (stream ``(uid, 0)``), the same on both paths."""
    return f"{uids[r // n]}_{r % n}_t{turn}"


def run_episodes(sampler, prompts: Sequence, *, uids: Sequence[str], n: int, decode, env_cls, tokenizer,
                 stop_id: int, max_turns: int, max_response_tokens: int, max_obs_tokens: int,
                 pad_to_multiple: int = 1, continuation: str = "kv", max_env_workers: int = 16) -> EpisodeTrajectories:
    """Runs ``n`` episodes (sessions) per prompt; returns one trajectory per session.

    Args:
      sampler: the :class:`rljax.rollout.Sampler` (its weights, engine and decode chunking).
        ``continuation="kv"``: the engine's cache must hold a prompt, ``max_response_tokens``
        and one turn (``max_len >= prompt + T + decode.max_new_tokens``); ``"reprefill"``: its
        ``max_prefill_length`` must hold a prompt plus ``max_response_tokens``.
      prompts: objects with ``ids``, ``prompt`` and ``answer`` (:class:`rljax.data.Prompt`).
      uids: one group key per prompt. decode: training / validation ``DecodeParams``
        (``max_new_tokens`` caps one turn).
      env_cls: the environment class (one instance per session).
      stop_id: the token that ends a turn as a tool call. max_turns: model turns per
        episode. max_response_tokens: ``T``, turns plus observations. max_obs_tokens: an
        observation is cut to this many tokens.
      continuation: ``"kv"`` (sessions keep their slot and KV cache across turns) or
        ``"reprefill"`` (each turn re-prefills the whole context); see the module docstring.
      max_env_workers: threads answering turns concurrently (``"kv"``).
    """
    if continuation not in CONTINUATIONS:
        raise ValueError(f"continuation is {continuation!r}; accepted: {', '.join(CONTINUATIONS)}")
    if continuation == "kv":
        stream = EpisodeStream(sampler, decode, n=n, env_cls=env_cls, tokenizer=tokenizer, stop_id=stop_id,
                               max_turns=max_turns, max_response_tokens=max_response_tokens,
                               max_obs_tokens=max_obs_tokens, pad_to_multiple=pad_to_multiple,
                               max_env_workers=min(max_env_workers, len(prompts) * n))
        done = []
        try:
            stream.submit(0, prompts, uids)
            while stream.busy:
                done += stream.step()
        finally:
            stream.close()
        return done[0][1]
    t0 = time.perf_counter()
    eos = tuple(sampler.engine.eos_ids(decode))
    turn_decode = dataclasses.replace(decode, eos_ids=eos + (int(stop_id),))
    lim = _Limits(stop_id=int(stop_id), eos=eos, max_turns=int(max_turns), max_response_tokens=int(max_response_tokens),
                  max_obs_tokens=int(max_obs_tokens))
    total = len(prompts) * n
    sessions = []
    for r in range(total):
        p, s = prompts[r // n], r % n
        ex = Example(prompt=str(getattr(p, "prompt", "")), answer=str(getattr(p, "answer", "")),
                     index=int(getattr(p, "index", r // n)), uid=str(uids[r // n]), session=s)
        sessions.append(_Session(env=env_cls(ex), context=list(int(t) for t in p.ids)))
    before = dict(sampler.engine.stats)
    stats, steps_all, episode = _reprefill_loop(sampler, uids, n, sessions, turn_decode, lim, tokenizer, t0)
    after = sampler.engine.stats
    for s in sessions:
        s.done = True
    ep = env_metrics(steps_all)
    ep.update(episode, continuation=continuation, turns=sum(s.turns for s in sessions),
              **{k: after.get(k, 0) - before.get(k, 0) for k in ("prefill_tokens", "extend_calls", "extended_tokens")})
    return _assemble(sampler, prompts, n, uids, decode, sessions, stats, ep, max_response_tokens, pad_to_multiple)


def _reprefill_loop(sampler, uids, n, sessions, turn_decode, lim: _Limits, tokenizer, t0):
    """Turn by turn: one ``Sampler.generate`` over every unfinished session's whole context."""
    steps_all: list[Step] = []
    gen_s = env_s = prefill_s = decode_s = sync_s = 0.0
    gen_tokens = prefill_calls = prefill_rows = chunks = 0
    version_start = version_end = None
    for turn in range(lim.max_turns):
        live = [r for r, s in enumerate(sessions) if not s.done]
        budget = {r: lim.max_response_tokens - len(sessions[r].resp) for r in live}
        for r in live:
            if budget[r] <= 0:
                sessions[r].done = sessions[r].truncated = True
        live = [r for r in live if budget[r] > 0]
        if not live:
            break
        cap = min(max(budget[r] for r in live), turn_decode.max_new_tokens)
        tg = time.perf_counter()
        out = sampler.generate([sessions[r].context for r in live], uids=[_turn_uid(uids, n, r, turn) for r in live],
                               n=1, decode=dataclasses.replace(turn_decode, max_new_tokens=cap))
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
            turns.append(_take_turn(s, out.response_ids[j, :length], out.rollout_logp[j, :length], lim, tokenizer,
                                    out.token_version[j, :length]))
            s.min_version = min(s.min_version, int(out.min_version[j]))
            s.max_version = max(s.max_version, int(out.max_version[j]))
        te = time.perf_counter()
        envs = [sessions[r].env for r in live]
        steps = type(envs[0]).step_many(envs, turns)
        waited = time.perf_counter() - te
        env_s += waited
        steps_all += steps
        for r, t, step in zip(live, turns, steps):
            sessions[r].env_wait_s += waited
            _take_step(sessions[r], t, step, lim, tokenizer)
    stats = RolloutStats(wall_s=time.perf_counter() - t0, prefill_s=prefill_s, decode_s=decode_s, weight_sync_s=sync_s,
                         generated_tokens=gen_tokens, prefill_calls=prefill_calls, prefill_rows=prefill_rows,
                         decode_chunks=chunks, num_slots=sampler.engine.num_slots,
                         version_start=int(version_start or 0), version_end=int(version_end or 0))
    return stats, steps_all, {"gen_s": gen_s, "env_s": env_s}


def _env_answer(envs, turns):
    return type(envs[0]).step_many(envs, turns)


@dataclasses.dataclass(eq=False)
class EpisodeBatch(StreamBatch):
    """A batch of multi-turn episodes in an :class:`EpisodeStream` (its sessions' host records too)."""

    episodes: list = dataclasses.field(default_factory=list, repr=False)  # _Session per row
    keys: Any = None  # uint32 [rows * max_turns, 2]: row r's turn k at r * max_turns + k
    gen_tokens: int = 0
    env_s: float = 0.0  # wall seconds the stream waited on environments while this batch was in flight
    steps: list = dataclasses.field(default_factory=list, repr=False)  # every Step its environments answered


class EpisodeStream(RolloutStream):
    """Multi-turn episodes (``continuation="kv"``) of many batches through one rollout driver.

    The multi-turn client of :class:`rljax.rollout.driver.Driver`: each prompt is a parking
    request of ``n`` sessions; a ``turn_ended`` event sends the turn to the environment on a
    thread pool while the other slots decode; an answer with an observation resumes the session
    in its own slot (:meth:`Driver.resume`), one that ends the episode frees the slot
    (:meth:`Driver.end`) for the next queued session, also one of a later batch (streaming
    admission, gated by ``admit`` as in :class:`~rljax.rollout.stream.RolloutStream`).
    :meth:`step` returns each batch as :class:`EpisodeTrajectories` once every episode of it
    ended, in submission order. :func:`run_episodes` is one batch of it; the asynchronous
    trainer's streaming producer keeps one for the run.

    After each round the host waits at most one decode step's time for answers still running
    (answers that come at once resume together, one decode wave, not two); when nothing decoded
    it waits for the first answer. The waits count in each in-flight batch's ``env_s``.
    Close it (:meth:`close`) to stop its environment threads.
    """

    def __init__(self, sampler, decode, *, n: int, env_cls, tokenizer, stop_id: int, max_turns: int,
                 max_response_tokens: int, max_obs_tokens: int, admit=None, pad_to_multiple: int = 1,
                 max_env_workers: int = 16):
        decode = DecodeParams() if decode is None else decode
        eos = tuple(sampler.engine.eos_ids(decode))
        super().__init__(sampler, dataclasses.replace(decode, eos_ids=eos + (int(stop_id),)), n=n, admit=admit,
                         pad_to_multiple=pad_to_multiple)
        self.episode_decode, self.env_cls, self.tokenizer = decode, env_cls, tokenizer
        self.lim = _Limits(stop_id=int(stop_id), eos=eos, max_turns=int(max_turns),
                           max_response_tokens=int(max_response_tokens), max_obs_tokens=int(max_obs_tokens))
        # an environment that overrides step_many answers a round's turns together (e.g. a sandbox batch)
        self.one_by_one = getattr(env_cls.step_many, "__func__", None) is Environment.step_many.__func__
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, int(max_env_workers)),
                                                           thread_name_prefix="rljax-env")
        self._inflight: dict = {}  # future -> ([(batch, row)], turns, submitted at)

    def submit(self, key, prompts, uids) -> EpisodeBatch:
        """Queues a batch of prompts (objects with ``ids``, ``prompt``, ``answer``), ``n`` episodes each."""
        eng, lim, n = self.sampler.engine, self.lim, self.n
        prompts, uids = list(prompts), [str(u) for u in uids]
        if len(prompts) != len(uids) or not prompts:
            raise ValueError(f"{len(prompts)} prompts and {len(uids)} uids; accepted: one uid per prompt, at least one")
        need = max(len(p.ids) for p in prompts) + lim.max_response_tokens + self.decode.max_new_tokens
        if need > eng.max_len:
            raise ValueError(f"continuation='kv' needs a cache of prompt + max_response_tokens + max_new_tokens = "
                             f"{need} entries per slot; the engine holds {eng.max_len} (max_prefill_length + "
                             "max_decode_length)")
        for i, p in enumerate(prompts):
            eng.check_prompt(p.ids, name=f"prompt {i} (uid {uids[i]!r})")
        total = len(prompts) * n
        batch = EpisodeBatch(key=key, prompts=prompts, uids=uids, t_submit=time.perf_counter())
        for r in range(total):
            p, s = prompts[r // n], r % n
            ex = Example(prompt=str(getattr(p, "prompt", "")), answer=str(getattr(p, "answer", "")),
                         index=int(getattr(p, "index", r // n)), uid=uids[r // n], session=s)
            batch.episodes.append(_Session(env=self.env_cls(ex), context=[int(t) for t in p.ids]))
        # every turn's key at once (one compiled shape per call size, not one per count of rows)
        batch.keys = trajectory_keys(self.decode.seed, [_turn_uid(uids, n, r, k) for r in range(total)
                                                        for k in range(lim.max_turns)], [0] * (total * lim.max_turns))
        for g, p in enumerate(prompts):
            first = [(g * n + s) * lim.max_turns for s in range(n)]
            batch.sessions += self.driver.submit(Request(np.asarray(p.ids, np.int32), keys=batch.keys[first],
                                                         rows=range(g * n, (g + 1) * n), park=True, tag=batch))
        self._batches.append(batch)
        return batch

    @property
    def busy(self) -> bool:
        return self.driver.busy or bool(self._inflight)

    @property
    def active(self) -> bool:
        return self.driver.in_progress or bool(self._inflight)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _wait(self, **kw) -> None:
        tw = time.perf_counter()
        concurrent.futures.wait(list(self._inflight), **kw)
        waited = time.perf_counter() - tw
        for b in self._batches:
            if b.in_flight:
                b.env_s += waited

    def step(self) -> list:
        """One driver round, the environments' answers it can take, and the batches it completed."""
        driver, lim = self.driver, self.lim
        chunks = driver.chunks
        ended = []  # (batch, row, turn)
        for ev in driver.step():
            if ev.session is None:  # weights_changed
                continue
            batch = ev.session.request.tag
            if ev.kind == "finished":
                self._finished(ev.session)
            elif ev.kind == "turn_ended":
                r = ev.session.row
                s = batch.episodes[r]
                if s.turns == 0:
                    s.queue_s = ev.session.inserted_at - batch.t_submit
                batch.gen_tokens += ev.length
                ended.append((batch, r, _take_turn(s, ev.tokens, ev.logp, lim, self.tokenizer, ev.versions)))
        if ended:
            now = time.perf_counter()
            if self.one_by_one:  # each session's turn on its own worker
                for batch, r, turn in ended:
                    fut = self._pool.submit(_env_answer, [batch.episodes[r].env], [turn])
                    self._inflight[fut] = ([(batch, r)], [turn], now)
            else:  # the environment answers the round's turns together (its step_many batches them)
                fut = self._pool.submit(_env_answer, [b.episodes[r].env for b, r, _ in ended], [t for _, _, t in ended])
                self._inflight[fut] = ([(b, r) for b, r, _ in ended], [t for _, _, t in ended], now)
        if driver.chunks == chunks and self._inflight:  # nothing decoded: every session in a slot waits on its env
            self._wait(return_when=concurrent.futures.FIRST_COMPLETED)
        if self._inflight:  # grace of one decode step: answers that come at once join the next chunk together
            self._wait(timeout=driver.last_step_s)
        for fut in [f for f in self._inflight if f.done()]:
            where, turns, submitted = self._inflight.pop(fut)
            steps = fut.result()
            now = time.perf_counter()
            for (batch, r), turn, st in zip(where, turns, steps):
                batch.steps.append(st)
                s = batch.episodes[r]
                s.env_wait_s += now - submitted
                obs = _take_step(s, turn, st, lim, self.tokenizer)
                handle = batch.sessions[r]
                if obs is not None:
                    driver.resume(handle, obs, batch.keys[r * lim.max_turns + s.turns])
                    continue
                driver.end(handle)  # the episode ended: its slot takes a waiting session
                s.decode_s = now - batch.t_submit - s.queue_s
        return self._completed()

    def take(self, batch: EpisodeBatch, groups) -> EpisodeTrajectories:
        """The episodes of ``groups`` (prompt indices whose episodes all ended), in that order,
        group ids ``0..``, before the batch is complete; their stats are empty."""
        groups = [int(g) for g in groups]
        rows = [g * self.n + s for g in groups for s in range(self.n)]
        if any(batch.sessions[r].status != "finished" for r in rows):
            raise ValueError(f"take: an episode of groups {groups} of batch {batch.key!r} has not ended")
        episodes = [dataclasses.replace(batch.episodes[r], min_version=batch.sessions[r].min_version,
                                        max_version=batch.sessions[r].max_version) for r in rows]
        return _assemble(self.sampler, [batch.prompts[g] for g in groups], self.n, [batch.uids[g] for g in groups],
                         self.episode_decode, episodes, empty_stats(self.sampler.engine.num_slots), {},
                         self.lim.max_response_tokens, 1)

    def _assemble(self, batch: EpisodeBatch) -> EpisodeTrajectories:
        for s, h in zip(batch.episodes, batch.sessions):
            s.min_version, s.max_version, s.done = h.min_version, h.max_version, True
        m0, m1 = batch.marks, self._marks()
        slot_steps = m1["slot_steps"] - m0["slot_steps"]
        stats = RolloutStats(
            wall_s=max(h.finished_at for h in batch.sessions) - batch.t_first,
            prefill_s=m1["prefill_s"] - m0["prefill_s"], decode_s=m1["decode_s"] - m0["decode_s"],
            weight_sync_s=m1["sync_s"] - m0["sync_s"], generated_tokens=batch.gen_tokens,
            prefill_calls=m1["prefill_calls"] - m0["prefill_calls"], prefill_rows=m1["prefill_rows"] - m0["prefill_rows"],
            decode_chunks=m1["chunks"] - m0["chunks"], num_slots=self.sampler.engine.num_slots,
            version_start=int(m0["version"]), version_end=int(max(h.max_version for h in batch.sessions)),
            slot_occupancy=(m1["live"] - m0["live"]) / slot_steps if slot_steps else float("nan"))
        ep = env_metrics(batch.steps)
        ep.update(gen_s=stats.prefill_s + stats.decode_s, env_s=batch.env_s, continuation="kv",
                  turns=sum(s.turns for s in batch.episodes),
                  **{k: m1[k] - m0[k] for k in ("prefill_tokens", "extend_calls", "extended_tokens")})
        return _assemble(self.sampler, batch.prompts, self.n, batch.uids, self.episode_decode, batch.episodes, stats,
                         ep, self.lim.max_response_tokens, self.pad_to_multiple)


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
    token_version = np.full((padded, T), NO_VERSION, np.int32)
    roles = np.full((padded, T), int(Role.PADDING), np.int8)
    length = np.zeros(padded, np.int32)
    plen = np.zeros(padded, np.int32)
    for r, s in enumerate(sessions):
        p = prompts[r // n].ids
        prompt_ids[r, s_max - len(p):], prompt_mask[r, s_max - len(p):], plen[r] = p, True, len(p)
        k = len(s.resp)
        resp[r, :k], action[r, :k], present[r, :k], logp[r, :k], roles[r, :k] = s.resp, s.action, True, s.logp, s.roles
        token_version[r, :k] = s.versions
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
        max_version=col([s.max_version for s in sessions], np.int32), token_version=token_version,
        is_padding=is_padding, queue_s=col([s.queue_s for s in sessions], np.float32), prefill_s=zeros,
        decode_s=col([s.decode_s for s in sessions], np.float32),
        uid=tuple(str(uids[r // n]) for r in range(total)) + ("",) * (padded - total),
        session=tuple(r % n for r in range(total)) + (-1,) * (padded - total),
        index=(0,) * total + (-1,) * (padded - total),
        decode=decode, stats=stats, num_groups=len(prompts), pad_id=pad_id,
        response_attention=present, roles=roles, num_turns=col([s.turns for s in sessions], np.int32),
        obs_tokens=col([s.obs for s in sessions], np.int32), tool_calls=col([s.calls for s in sessions], np.int32),
        env_reward=col([np.nan if s.reward is None else s.reward for s in sessions], np.float32, np.nan),
        tool_s=col([s.tool_s for s in sessions], np.float32),
        env_wait_s=col([s.env_wait_s for s in sessions], np.float32),
        final_text=tuple(s.final_text for s in sessions) + ("",) * (padded - total),
        turn_spans=tuple(tuple(s.spans) for s in sessions) + ((),) * (padded - total),
        episode=tuple(sorted(episode.items())),
    )


def episode_scores(traj: EpisodeTrajectories, reward_fn, prompts, *, max_error_fraction: float):
    """Scores ``[B]`` (the environment's final reward, else ``reward_fn`` on the final turn's
    text) and the reward report."""
    answers = [prompts[traj.group_id[i]].answer if not traj.is_padding[i] else "" for i in range(traj.batch_size)]
    extras = [prompts[traj.group_id[i]].reward_extra() if not traj.is_padding[i] else {} for i in range(traj.batch_size)]
    scores, report = score_batch(reward_fn, list(traj.final_text), answers, list(traj.uid),
                                 max_error_fraction=max_error_fraction, is_padding=traj.is_padding,
                                 extras=extras if any(extras) else None)
    env = np.asarray(traj.env_reward)
    return np.where(np.isnan(env), scores, env).astype(np.float32), report
