"""The run's state as one value, and what a checkpoint holds of it.

:class:`RunState` is everything that changes from step to step: the actor's and the critic's
train states, the weight version, the KL-in-reward coefficient (the adaptive controller's
state), the data position, the run's random key and the asynchronous producer's position.
Stages that change it take it and return a new one (``fn(state, batch) -> (state,
outputs)``); nothing else holds it. The things that do not change (model functions, the
sampler, the reward, the mesh) are the run's *services* (:mod:`rljax.trainer.build`).

It is a ``flax.struct`` dataclass: the device arrays (train states, key) are pytree
leaves, the host counters are static fields, so ``jax.tree.map`` over a state touches the
arrays only and ``state.replace(version=...)`` makes a new value. A checkpoint is a
``RunState``: :func:`checkpoint_tree` (the arrays orbax writes: a LoRA actor's adapters, not
its frozen base) and :func:`checkpoint_meta` (the counters, as JSON) are its two halves,
:func:`from_checkpoint` puts them back. The layout on disk is the one checkpoints had before
``RunState`` existed (``{"actor", "critic"}`` arrays, ``step`` / ``version`` / ``data`` /
``kl_coef`` / ``async`` in the meta), so those restore unchanged; the root key, written since,
is derived from ``trainer.seed`` for a checkpoint without it (it never advances: each step's
key is ``fold_in(key, step)``).
"""

from __future__ import annotations

from typing import Any, Optional

import flax
import jax
import numpy as np

from rljax.models.lora import LoRAParams
from rljax.trainer.step import TrainState, trainable


@flax.struct.dataclass
class RunState:
    """One run's changing state (see the module docstring).

    Attributes:
      actor: the policy's :class:`~rljax.trainer.step.TrainState` (LoRA: adapters on a base).
      critic: the value model's train state (``adv_estimator=gae``), else ``None``.
      key: the run's root random key; step ``k``'s update key is ``fold_in(key, k)``.
      step: the last step run (0 before the first).
      version: the learner's weight version (one per update).
      kl_coef: the KL-in-reward coefficient the next step's advantages use (0 without
        ``algorithm.use_kl_in_reward``).
      data: the train split's position after the last trained batch (``PromptIterator.state()``).
      produced: ``trainer.mode=async``: the batch index the producer starts from after a resume.
      async_counts: ``trainer.mode=async``: the run's counters as the checkpoint this state was
        restored from saved them (``generated_rows``, ``weight_pushes``, ``dropped_stale``,
        ``dropped_overflow``), which the resumed run's ``async/*`` metrics continue from; ``None``
        for a fresh run (or an older checkpoint: a count it lacks starts at 0).
    """

    actor: TrainState
    critic: Optional[TrainState]
    key: jax.Array
    step: int = flax.struct.field(pytree_node=False, default=0)
    version: int = flax.struct.field(pytree_node=False, default=0)
    kl_coef: float = flax.struct.field(pytree_node=False, default=0.0)
    data: Any = flax.struct.field(pytree_node=False, default=None)
    produced: int = flax.struct.field(pytree_node=False, default=1)
    async_counts: Any = flax.struct.field(pytree_node=False, default=None)


#: The asynchronous schedule's run-long counters a checkpoint's ``async`` meta holds (since issue 39; the
#: dropped rows were saved before as the saving launch's own, now as the run's).
ASYNC_COUNTS = ("generated_rows", "weight_pushes", "dropped_stale", "dropped_overflow")


def step_key(state: RunState, step: int) -> jax.Array:
    """The random key of step ``step``'s updates."""
    return jax.random.fold_in(state.key, step)


def checkpoint_tree(state: RunState) -> dict:
    """The arrays a checkpoint of ``state`` writes: the actor's trainable part (a LoRA run saves
    its adapters, not the frozen base) and the critic."""
    tree = {"actor": state.actor.replace(params=trainable(state.actor.params))}
    if state.critic is not None:
        tree["critic"] = state.critic
    return tree


def checkpoint_meta(state: RunState) -> dict:
    """The counters a checkpoint of ``state`` writes (JSON): step, weight version, data position,
    KL coefficient, root key, and the producer's position (read only by ``trainer.mode=async``)."""
    return {"step": state.step, "version": state.version, "data": state.data, "kl_coef": state.kl_coef,
            "key": [int(x) for x in np.asarray(jax.random.key_data(state.key)).ravel()],
            "produced": state.produced}


def from_checkpoint(like: RunState, tree: dict, meta: dict, *, weights_only: bool = False,
                    kl_in_reward: bool = False) -> RunState:
    """``like`` (this run's freshly built state) with a checkpoint's arrays and counters.

    ``weights_only``: the actor's and critic's parameters alone (another task: fresh optimizer
    states, data position and KL coefficient), the step and version counted on.
    ``kl_in_reward``: take the saved KL coefficient (the run adapts it)."""
    actor = tree["actor"]
    if isinstance(like.actor.params, LoRAParams):
        actor = actor.replace(params=like.actor.params.replace(adapters=actor.params))  # LoRA: back onto the base
    critic = tree.get("critic")
    counters = {"step": int(meta["step"]), "version": int(meta["version"])}
    async_meta = meta.get("async") or {}
    counts = {k: int(async_meta[k]) for k in ASYNC_COUNTS if k in async_meta} or None
    if weights_only:
        actor = like.actor.replace(params=actor.params)
        critic = None if like.critic is None else like.critic.replace(params=critic.params)
        return like.replace(actor=actor, critic=critic, produced=counters["step"] + 1, async_counts=counts,
                            **counters)
    key = like.key
    if "key" in meta:
        key = jax.random.wrap_key_data(np.asarray(meta["key"], np.uint32), impl=jax.random.key_impl(like.key))
    kl_coef = float(meta["kl_coef"]) if kl_in_reward and "kl_coef" in meta else like.kl_coef
    produced = int(async_meta.get("next_index", meta.get("produced", counters["step"] + 1)))
    return like.replace(actor=actor, critic=critic, key=key, kl_coef=kl_coef, data=meta["data"], produced=produced,
                        async_counts=counts, **counters)
