"""What the multi-turn stages of the step need (:mod:`rljax.trainer.stages`).

With ``env.function`` set, the step's ``rollout_sessions`` stage runs episodes
(``rollout_episodes``: one session per sample, several turns each, through
:meth:`EnvRuntime.run`) and the ``reward`` stage scores each session's final reward
(``episode_reward``); every learner-side stage is unchanged: they read ``loss_mask`` (1 only
on policy tokens) and the attention mask (every token present), so observations are context
and never trained on.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from rljax.env._check import run_sandbox
from rljax.env._protocol import load_env
from rljax.env._rollout import EpisodeStream, run_episodes
from rljax.errors import ConfigError


@dataclasses.dataclass
class EnvRuntime:
    """What the episode stages need besides the trainer's components."""

    env_cls: type
    stop_id: int
    max_turns: int
    max_obs_tokens: int
    max_response_tokens: int  # T: model turns + observations
    continuation: str = "kv"  # env.continuation: "kv" (slots keep their KV cache) or "reprefill"
    sandbox_probe: Optional[dict] = None  # what the python tool's sandbox really holds (None: no python tool)

    @classmethod
    def from_config(cls, cfg, tokenizer) -> "EnvRuntime":
        e = cfg.env
        ids = tokenizer.encode(e.stop)
        if len(ids) != 1:
            raise ConfigError(f"env.stop={e.stop!r} is {len(ids)} tokens of the tokenizer; it must be exactly one token")
        env_cls = load_env(e.function)
        sandbox = run_sandbox(cfg, env_cls)  # probed: a required protection missing is a ConfigError
        if sandbox is not None:
            env_cls = type(env_cls.__name__, (env_cls,), {"sandbox": sandbox})
        return cls(env_cls=env_cls, stop_id=int(ids[0]), max_turns=e.max_turns, max_obs_tokens=e.max_obs_tokens,
                   max_response_tokens=cfg.data.max_response_length, continuation=e.continuation,
                   sandbox_probe=None if sandbox is None else {**sandbox.probe(), "line": sandbox.describe()})

    def run(self, sampler, prompts, uids, *, n: int, decode, tokenizer):
        return run_episodes(sampler, prompts, uids=uids, n=n, decode=decode, env_cls=self.env_cls,
                            tokenizer=tokenizer, stop_id=self.stop_id, max_turns=self.max_turns,
                            max_response_tokens=self.max_response_tokens, max_obs_tokens=self.max_obs_tokens,
                            continuation=self.continuation)

    def stream(self, sampler, *, n: int, decode, tokenizer, admit=None) -> EpisodeStream:
        """Streaming admission over episodes (``continuation="kv"``): one driver for many batches
        (:class:`rljax.env._rollout.EpisodeStream`)."""
        if self.continuation != "kv":
            raise ValueError(f"streaming episodes need env.continuation=kv (it is {self.continuation!r})")
        return EpisodeStream(sampler, decode, n=n, env_cls=self.env_cls, tokenizer=tokenizer, stop_id=self.stop_id,
                             max_turns=self.max_turns, max_response_tokens=self.max_response_tokens,
                             max_obs_tokens=self.max_obs_tokens, admit=admit)


def episode_metrics(traj) -> dict[str, Any]:
    """``env/*`` metrics of a rollout (real rows): of episode trajectories, or of every process's
    episode facts (:class:`rljax.trainer.distribute.EpisodeRows`: ``policy_tokens`` per row
    instead of ``response_mask``)."""
    real = ~np.asarray(traj.is_padding)
    ep = traj.episode_stats
    policy = getattr(traj, "policy_tokens", None)
    policy = np.asarray(traj.response_mask).sum(axis=1) if policy is None else np.asarray(policy)
    return {"env/num_turns/mean": float(traj.num_turns[real].mean()),
            "env/num_turns/max": int(traj.num_turns[real].max()),
            "env/obs_tokens/mean": float(traj.obs_tokens[real].mean()),
            "env/tool_calls": int(ep.get("tool_calls", 0)),
            "env/tool_call_rate": float((traj.tool_calls[real] > 0).mean()),
            "env/tool_errors": int(ep.get("tool_errors", 0)),
            "env/tool_timeouts": int(ep.get("tool_timeouts", 0)),
            "env/policy_tokens/mean": float(policy[real].mean()),
            "timing_s/env": float(ep.get("env_s", 0.0))}
