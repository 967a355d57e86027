"""The value model for PPO with GAE: the policy's transformer with a scalar value head.

Values live at the same positions as the response log-probs: the hidden state at index
``S - 1 + t`` gives ``V_t``, the value of the state before response token ``t``. The
critic is initialised from the policy's weights with a zero head (verl initialises it from
the policy checkpoint too) and trained with the clipped value loss over the same
mini-/micro-batch schedule as the actor (:func:`rljax.trainer.step.make_train_step`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rljax import loss as rl
from rljax.models import functional as F
from rljax.models.precision import traced_at
from rljax.sharding import with_logical_constraint
from rljax.trainer.packing import ROW_FIELDS


@dataclasses.dataclass(frozen=True)
class CriticStepConfig:
    """Static hyper-parameters of the critic update."""

    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 8  # trajectories
    ppo_micro_batch_size: int = 8  # trajectories
    shuffle: bool = True  # permute the trajectories before each epoch's mini-batch split (actor.shuffle)
    matmul_precision: Optional[str] = None  # model.matmul_precision (None: JAX's setting in effect)


def init_critic(policy_params: dict) -> dict:
    """Critic parameters: a copy of the policy's transformer and a zero value head ``[H] , []``."""
    model = jax.tree.map(jnp.copy, policy_params)
    embed = model["embed"]
    hidden = embed.shape[-1]
    head = {"w": jnp.zeros((hidden,), jnp.float32, device=_replicated_like(embed)),
            "b": jnp.zeros((), jnp.float32, device=_replicated_like(embed))}
    return {"model": model, "head": head}


def _replicated_like(x):
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    return sharding


def critic_values(graphdef, params: dict, batch: dict, *, response_len: int, mesh: Optional[Mesh] = None) -> jax.Array:
    """``V [B, T]`` float32 for the response positions of ``batch`` (same layout as the actor's).

    A packed micro-batch (``batch["packed"]``, :mod:`rljax.trainer.packing`) runs on its
    packed rows and is gathered back to the same ``[B, T]`` layout."""
    if "packed" in batch:
        return _packed_values(graphdef, params, batch["packed"], mesh=mesh)
    ids = batch["input_ids"]
    prompt_len = ids.shape[1] - response_len
    hidden = F.forward(graphdef, params["model"], ids, positions=batch["positions"], mask=batch["attention_mask"],
                       mesh=mesh)
    hidden = hidden[:, prompt_len - 1: prompt_len - 1 + response_len]
    if mesh is not None:
        hidden = with_logical_constraint(hidden, ("batch", "length", "embed"), mesh)
    head = params["head"]
    return jnp.einsum("bth,h->bt", hidden.astype(jnp.float32), head["w"]) + head["b"]


def _packed_values(graphdef, params: dict, rows: dict, *, mesh: Optional[Mesh] = None) -> jax.Array:
    """``V [Bm, T]`` of a packed micro-batch (``rows``: ``tokens, positions, segment_ids [R, L]``
    and ``gather [Bm, T]``, flat indices into ``R*L``)."""
    seg = rows["segment_ids"]
    hidden = F.forward(graphdef, params["model"], rows["tokens"], positions=rows["positions"], mask=seg > 0,
                       mesh=mesh, segment_ids=seg)
    if mesh is not None:
        hidden = with_logical_constraint(hidden, ("batch", "length", "embed"), mesh)
    head = params["head"]
    values = jnp.einsum("rlh,h->rl", hidden.astype(jnp.float32), head["w"]) + head["b"]
    return jnp.take(values.reshape(-1), rows["gather"], axis=0)


def make_packed_values_fn(graphdef, *, mesh: Optional[Mesh] = None, matmul_precision: Optional[str] = None):
    """Jitted ``(params, packed, batch_size) -> V [B, T]`` from
    :func:`rljax.trainer.packing.pack_logprob_batch` arrays (one chunk per ``U``, mapped
    sequentially); rows come back in the batch's order."""
    def compute(params, packed, b):
        rows = {k: packed[k][0] for k in ROW_FIELDS}
        values = jax.lax.map(lambda r: _packed_values(graphdef, params, r, mesh=mesh),
                             dict(rows, gather=packed["gather"][0]))  # [U, Bm, T]
        index = packed["traj_index"][0].reshape(-1)  # slot -> trajectory row (B for empty slots)
        t = values.shape[-1]
        out = jnp.zeros((b + 1, t), values.dtype).at[index].set(values.reshape(-1, t))[:b]
        return out if mesh is None else with_logical_constraint(out, ("batch", "length"), mesh)

    return jax.jit(traced_at(compute, matmul_precision), static_argnums=2)


def critic_loss(params, graphdef, micro: dict, counts, cfg: CriticStepConfig, mesh: Optional[Mesh]):
    """Clipped value loss of one micro-batch, normalised by the mini-batch's global counts."""
    num_tokens, num_seqs = counts
    mask = micro["loss_mask"]
    values = critic_values(graphdef, params, micro, response_len=mask.shape[1], mesh=mesh)
    loss, metrics = rl.value_loss(values, micro["old_values"], micro["returns"], mask,
                                  clip_range=cfg.cliprange_value, loss_agg_mode=cfg.loss_agg_mode,
                                  num_tokens=num_tokens, num_seqs=num_seqs)
    weight = jnp.sum(mask) / jnp.maximum(num_tokens, 1.0)
    return loss, {"vf_loss": loss, "vf_clipfrac": metrics["vf_clipfrac"] * weight}


def outcome_token_rewards(scores: jax.Array, response_mask: jax.Array) -> jax.Array:
    """``[B, T]``: each trajectory's scalar score on its last generated token, 0 elsewhere."""
    t = response_mask.shape[1]
    last = t - 1 - jnp.argmax(jnp.flip(response_mask > 0, axis=1), axis=1)
    has_token = jnp.any(response_mask > 0, axis=1)
    onehot = (jnp.arange(t)[None, :] == last[:, None]) & has_token[:, None]
    return jnp.where(onehot, scores[:, None], 0.0).astype(jnp.float32)
