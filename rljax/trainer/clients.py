"""The rollout client of a run, chosen once in :func:`rljax.trainer.build.build`.

The stages, the asynchronous producers and validation generate through
``services.rollout.client`` and never ask which kind of rollout the run has:

* :class:`TurnClient`: single-turn rollouts, one response per session
  (:meth:`rljax.rollout.Sampler.generate`, :meth:`~rljax.rollout.Sampler.stream`);
* :class:`EpisodeClient`: multi-turn episodes (``env.function``), several turns per session
  with the environment's observations between them (:class:`rljax.env.EnvRuntime`).

Both take the step's prompts (:class:`rljax.data.Prompt`) and uids and return the rollout's
trajectories; with several processes each process's client generates its share of the batch
(the share is cut by the stage that draws the prompts). What differs between the two beyond
generation is the client's too: the rows' turns, the episode facts of the trace, the ``env/*``
metrics, the episode counters every process gathers, validation's per-row tool use.
``episodes`` is the one flag read elsewhere: by the reward (an episode is scored by its final
reward, :func:`rljax.env.episode_scores`).
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from rljax.env import episode_metrics
from rljax.trainer.distribute import gather_episodes


class TurnClient:
    """Single-turn rollouts on the run's sampler."""

    episodes = False

    def __init__(self, sampler):
        self.sampler = sampler

    def generate(self, prompts: list, uids: list, *, n: int, decode, on_chunk: Optional[Callable] = None):
        """The trajectories of ``n`` sessions per prompt (``on_chunk``: called between decode chunks)."""
        return self.sampler.generate([p.ids for p in prompts], uids=uids, n=n, decode=decode, on_chunk=on_chunk)

    def stream(self, *, n: int, decode, admit: Callable):
        """A stream over the run's rollout driver (:class:`rljax.rollout.stream.RolloutStream`)."""
        return self.sampler.stream(decode, n=n, admit=admit)

    def submitted(self, prompts: list) -> list:
        """What :meth:`stream`'s ``submit`` takes for ``prompts``: their token ids."""
        return [p.ids for p in prompts]

    def row_facts(self, traj) -> dict:
        """Per-row facts validation logs beside the scores: none for single-turn rollouts."""
        return {}

    sandbox_probe = None

    @staticmethod
    def by_source(collector, traj, prompts, scores, report) -> None:
        """Validation's rows into ``collector`` by their prompts' data source (verl's val-core/...)."""
        collector.add(traj, prompts, scores, report)

    gather_episodes = None  # rljax.trainer.distribute.gather_rows: no episode counters to gather

    def turns(self, traj) -> np.ndarray:
        """Each row's turns: one."""
        return np.ones(traj.batch_size, np.int64)

    def episode_facts(self, traj, rows, trajs: list) -> Optional[dict]:
        """The trace's episode facts of a rollout: none."""
        return None

    def metrics(self, rows) -> dict:
        """The step's ``env/*`` metrics: none."""
        return {}

    @property
    def streaming_limit(self) -> Optional[str]:
        """Why a stream does not apply to this client (``async_training.streaming``), or ``None``."""
        return None


class EpisodeClient:
    """Multi-turn episodes (``env.function``): the environment runs the turns on the sampler."""

    episodes = True

    def __init__(self, sampler, env, tokenizer):
        self.sampler, self.env, self.tokenizer = sampler, env, tokenizer

    def generate(self, prompts: list, uids: list, *, n: int, decode, on_chunk: Optional[Callable] = None):
        """One episode per session (``on_chunk`` is not called: the turns are separate generate calls)."""
        return self.env.run(self.sampler, prompts, uids, n=n, decode=decode, tokenizer=self.tokenizer)

    def stream(self, *, n: int, decode, admit: Callable):
        """An ``EpisodeStream`` (:meth:`rljax.env.EnvRuntime.stream`): a session parked on its
        environment keeps its slot, an ended episode frees it."""
        return self.env.stream(self.sampler, n=n, decode=decode, tokenizer=self.tokenizer, admit=admit)

    def submitted(self, prompts: list) -> list:
        """The prompts themselves: an episode's environment reads the prompt's text and answer."""
        return list(prompts)

    def row_facts(self, traj) -> dict:
        """Per row, whether the episode called a tool and its turns (``val/env/*``); empty arrays
        for ``traj=None``."""
        if traj is None:
            return {"tool_called": np.zeros(0, bool), "num_turns": np.zeros(0, np.int64)}
        return {"tool_called": np.asarray(traj.tool_calls) > 0, "num_turns": np.array(traj.num_turns)}

    @staticmethod
    def by_source(collector, traj, prompts, scores, report) -> None:
        """Episodes are not split by data source (validation's val-core/... is single-turn's)."""

    @property
    def sandbox_probe(self) -> Optional[dict]:
        """What the python tool's sandbox holds (``env.tools``), for the run's log and trace."""
        return self.env.sandbox_probe

    def turns(self, traj) -> np.ndarray:
        return np.asarray(traj.num_turns)

    @staticmethod
    def gather_episodes(traj, share):
        """Every process's episode counters (:func:`rljax.trainer.distribute.gather_episodes`)."""
        return gather_episodes(traj, share)

    def metrics(self, rows) -> dict:
        """The step's ``env/*`` metrics of its episodes (:func:`rljax.env.episode_metrics`; ``rows``:
        the trajectories, or every process's :class:`~rljax.trainer.distribute.EpisodeRows`)."""
        return episode_metrics(rows)

    @staticmethod
    def episode_facts(traj, rows, trajs: list) -> dict:
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

    @property
    def streaming_limit(self) -> Optional[str]:
        if self.env.continuation != "kv":
            return "env.continuation=reprefill re-prefills every turn in one generate call per turn"
        return None


#: The single-turn client's row semantics without a sampler (the trace facts' default).
SINGLE_TURN = TurnClient(None)

