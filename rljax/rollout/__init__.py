"""Rollout: a JetStream engine for the rljax model and the continuous-batching RL sampler.

::

    from rljax.rollout import DecodeParams, RljaxEngine, Sampler, sampler_mesh

    engine = RljaxEngine(config, num_slots=32, max_prefill_length=256, max_decode_length=512,
                         mesh=sampler_mesh(rollout_tp=2))
    sampler = Sampler(engine, params, version=0)        # params in any layout
    traj = sampler.generate(prompts, uids=uids, n=8,
                            decode=DecodeParams(temperature=1.0, max_new_tokens=256))
    sampler.update_weights(new_params, version=1)        # reshards, timed, versions increase

Where things are: :mod:`~rljax.rollout.engine` (the JetStream ``Engine``),
:mod:`~rljax.rollout.driver` (the one continuous-batching scheduler: slots, requests, events),
:mod:`~rljax.rollout.sampler` (single-turn generation as a driver client, versions, ``on_chunk``),
:mod:`~rljax.rollout.trajectory` (the returned batch and its padding conventions),
:mod:`~rljax.rollout.sampling` (decode parameters, random streams, what
``rollout_logp`` means).

``DecodeParams``, ``Trajectories`` and the sampling functions import only JAX and flax;
``RljaxEngine``, ``Sampler`` and the tokenizers import JetStream (and, through it,
TensorFlow, kept off accelerators by :mod:`rljax.rollout._jetstream`) on first use.
"""

from rljax.rollout.sampling import DecodeParams, sample_tokens, trajectory_key, trajectory_keys, truncate_logits
from rljax.rollout.trajectory import RolloutStats, Trajectories

_LAZY = {
    "RljaxEngine": "rljax.rollout.engine",
    "Prefix": "rljax.rollout.engine",
    "DecodeState": "rljax.rollout.engine",
    "RljaxResultTokens": "rljax.rollout.engine",
    "check_params": "rljax.rollout.engine",
    "Sampler": "rljax.rollout.sampler",
    "ChunkInfo": "rljax.rollout.sampler",
    "Driver": "rljax.rollout.driver",
    "Request": "rljax.rollout.driver",
    "Event": "rljax.rollout.driver",
    "Results": "rljax.rollout.driver",
    "JetStreamTokenizer": "rljax.rollout.tokenizer",
    "sampler_mesh": "rljax.rollout.mesh",
}

__all__ = [
    "DecodeParams",
    "RolloutStats",
    "Trajectories",
    "sample_tokens",
    "trajectory_key",
    "trajectory_keys",
    "truncate_logits",
    *_LAZY,
]


def __getattr__(name):
    if name in _LAZY:
        import importlib  # pylint: disable=import-outside-toplevel

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rljax.rollout' has no attribute {name!r}")
