"""The pure train step: log-probs of a trajectory batch, the actor loss, and the PPO update.

One jitted function of ``(state, batch, key)`` does the whole actor update (PureJaxRL
style): ``ppo_epochs`` passes over (shuffled, ``actor.shuffle``) mini-batches, each accumulated over
micro-batches with the loss normalised by the *mini-batch's* global token / sequence
counts (so the micro-batch size does not change the update), then one optax step. A
non-finite loss or gradient skips the update and is counted; the parameters are untouched.

Batch layout (a dict of arrays, ``B`` trajectories):

* ``input_ids [B, S+T]``: the left-padded prompt (``S``) followed by the right-padded
  response (``T``); ``attention_mask [B, S+T]`` is True on real tokens (prompt, generated
  tokens and tool observations); ``positions [B, S+T]`` the rotary positions.
* ``loss_mask [B, T]``: 1 on tokens the policy generated (the action mask), 0 on tool
  observations, padding and padding rows.
* ``old_logp``, ``advantages`` (and ``ref_logp``, ``rollout_is_weights`` when used) ``[B, T]``.
  With ``StepConfig.on_policy`` the batch needs no ``old_logp``: one epoch over one
  mini-batch updates from the very parameters that would have scored it, so the old
  log-probs are the update pass's own, detached (``stop_gradient``), as verl and TRL do;
  the separate old-log-prob forward pass can be skipped. The update then also returns
  those log-probs: ``metrics["old_logp"] [B, T]`` (the batch's row order, rows on ``dp``), so
  the step still has the field a separate pass would have produced.

Hidden state ``S - 1 + t`` predicts response token ``t``.

LoRA: when ``state.params`` is a :class:`rljax.models.lora.LoRAParams`, only its adapters
are differentiated, clipped, optimised (``opt_state`` holds the adapters' moments only) and
checked for non-finite values; the frozen base passes through the step untouched.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rljax import loss as rl
from rljax.models.lora import LoRAParams
from rljax.models.precision import traced_at
from rljax.sharding import with_logical_constraint
from rljax.trace import faults
from rljax._digest import digest_traced as param_digest_traced
from rljax.trainer import packing, prefix
from rljax.trainer.prefix import host_spans  # noqa: F401  (re-exported: its home before rljax.trainer.prefix)
from rljax.trainer.heads import packed_response_logprobs, response_logprobs
from rljax.trainer.update_report import AGG_PROBE, REPORT, first_token, micro_report, update_report
from rljax.trainer.packing import (ROW_FIELDS as _ROW_FIELDS, SHARED_ROW_FIELDS as _SHARED_FIELDS,
                                   TOKEN_FIELDS as _TOKEN_FIELDS)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static hyper-parameters of the actor update (verl names)."""

    policy_loss: str = "vanilla"
    policy_loss_options: tuple = ()  # (name, value) pairs: the mode's own hyper-parameters (rljax.loss.policy_loss_options)
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: Optional[float] = 3.0
    loss_agg_mode: str = "token-mean"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 8  # trajectories per optimizer step
    ppo_micro_batch_size: int = 8  # trajectories per forward/backward
    temperature: float = 1.0
    logprob_impl: str = "auto"
    matmul_precision: Optional[str] = None  # model.matmul_precision (None: JAX's setting in effect)
    use_rollout_correction: bool = False
    shuffle: bool = True  # permute the trajectories before each epoch's mini-batch split
    # old_logp = stop_gradient(current logp) inside the update; only for one epoch over one
    # mini-batch (the train step checks), where it equals a separate old-log-prob pass.
    on_policy: bool = False
    # distillation.*: the teacher's term joins the loss (rljax.loss.with_distillation); None: no teacher
    distillation: Optional[rl.DistillationSpec] = None


#: Per-row ``[micro, T]`` outputs a loss function may put in its aux metrics: they are not
#: summed over micro-batches like the scalar metrics but gathered back into ``[B, T]`` in the
#: batch's row order (``StepConfig.on_policy``: the update's own detached log-probs).
ROW_OUTPUTS = ("old_logp",)
#: Distillation metrics normalised by the mini-batch's counts already (summed over micro-batches as they are);
#: its ``*_min`` / ``*_max`` ranges are combined by their extreme.
DISTILL_SUMMED = ("distillation/loss",)


@flax.struct.dataclass
class TrainState:
    params: Any
    opt_state: Any
    step: jax.Array  # optimizer steps taken (int32)
    skipped: jax.Array  # updates skipped for non-finite loss / gradients (int32)


def make_optimizer(*, lr: float, weight_decay: float = 0.0, warmup_steps: int = 0, grad_clip: Optional[float] = 1.0,
                   betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, scheduler: str = "constant",
                   total_steps: Optional[int] = None, min_lr_ratio: float = 0.0) -> optax.GradientTransformation:
    """AdamW with linear warm-up, then a constant or cosine rate, and global-norm gradient clipping.

    ``total_steps`` counts optimizer updates (needed by the cosine schedule).
    """
    if scheduler == "cosine":
        if not total_steps:
            raise ValueError("the cosine learning-rate schedule needs total_steps (optimizer updates)")
        schedule = optax.warmup_cosine_decay_schedule(0.0, lr, max(warmup_steps, 0), max(total_steps, warmup_steps + 1),
                                                      end_value=lr * min_lr_ratio)
    elif scheduler == "constant":
        schedule = optax.linear_schedule(0.0, lr, warmup_steps) if warmup_steps > 0 else lr
    else:
        raise ValueError(f"unknown lr scheduler {scheduler!r}; accepted: constant, cosine")
    adamw = optax.adamw(schedule, b1=betas[0], b2=betas[1], eps=eps, weight_decay=weight_decay)
    return adamw if grad_clip is None else optax.chain(optax.clip_by_global_norm(grad_clip), adamw)


def trainable(params):
    """The parameters the update changes: a LoRA model's adapters, else all of them."""
    return params.adapters if isinstance(params, LoRAParams) else params


def _with_trainable(params, new, dropout_key=None):
    """``params`` with its trainable part replaced by ``new`` (and the LoRA dropout key set)."""
    return params.replace(adapters=new, dropout_key=dropout_key) if isinstance(params, LoRAParams) else new


def _dropout(params) -> bool:
    return isinstance(params, LoRAParams) and params.config.dropout > 0


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
    """Optimizer state for :func:`trainable` ``(params)`` only (the adapters of a LoRA model)."""
    return TrainState(params=params, opt_state=optimizer.init(trainable(params)), step=jnp.zeros((), jnp.int32),
                      skipped=jnp.zeros((), jnp.int32))


def actor_loss(params, graphdef, micro: dict, counts: tuple[jax.Array, jax.Array], cfg: StepConfig,
               mesh: Optional[Mesh]) -> tuple[jax.Array, dict]:
    """Policy loss (+ KL loss, - entropy bonus) of one micro-batch, normalised by mini-batch counts."""
    num_tokens, num_seqs = counts
    mask = micro["loss_mask"]
    topk = cfg.distillation is not None and cfg.distillation.uses_topk  # the student's log-probs at the teacher's top-k
    logp, entropy, *student_topk = response_logprobs(
        graphdef, params, micro, response_len=mask.shape[1], temperature=cfg.temperature, impl=cfg.logprob_impl,
        mesh=mesh, at_ids=micro["teacher_topk_ids"] if topk else None)
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs)
    old_logp = jax.lax.stop_gradient(logp) if cfg.on_policy else micro["old_logp"]
    pg_loss, pg_metrics = rl.policy_loss(
        logp, old_logp, micro["advantages"], mask, mode=cfg.policy_loss,
        clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
        loss_agg_mode=cfg.loss_agg_mode,
        is_weights=micro.get("rollout_is_weights") if cfg.use_rollout_correction else None, **agg,
        **dict(cfg.policy_loss_options))
    entropy_agg = rl.aggregate(entropy, mask, mode=cfg.loss_agg_mode, **agg)
    loss = pg_loss - cfg.entropy_coeff * entropy_agg
    metrics = {"pg_loss": pg_loss, "entropy": entropy_agg}
    if cfg.on_policy:
        metrics["old_logp"] = old_logp
    if cfg.use_kl_loss:
        kl = rl.aggregate(rl.kl_penalty(logp, micro["ref_logp"], kind=cfg.kl_loss_type), mask,
                          mode=cfg.loss_agg_mode, **agg)
        loss = loss + cfg.kl_loss_coef * kl
        metrics["kl_loss"] = kl
    # Per-micro-batch ratios (clip fractions, ppo_kl) are token-weighted when summed below.
    weight = jnp.sum(mask) / jnp.maximum(num_tokens, 1.0)
    metrics.update({k: v * weight for k, v in pg_metrics.items()})
    if cfg.distillation is not None:  # the teacher's term (its loss is normalised by the mini-batch's counts already)
        loss, distill = rl.with_distillation(
            loss, logp, old_logp, mask, cfg.distillation, teacher_logp=micro.get("teacher_logp"),
            student_topk_logp=student_topk[0] if topk else None, teacher_topk_logp=micro.get("teacher_topk_logp"),
            loss_agg_mode=cfg.loss_agg_mode, is_weights=micro.get("rollout_is_weights") if cfg.use_rollout_correction
            else None, **agg)
        metrics.update({k: v if k in DISTILL_SUMMED or _extreme(k) else v * weight for k, v in distill.items()})
    # What the aggregation really did (the update's report, :func:`update_report`): the same mode and
    # denominators applied to 1 on each row's first loss token, a value that differs between the modes.
    metrics[AGG_PROBE] = rl.aggregate(first_token(mask), mask, mode=cfg.loss_agg_mode, **agg)
    return loss, metrics


def _extreme(key: str) -> str:
    """``"min"`` / ``"max"`` for a distillation range metric (combined over micro-batches by its
    extreme), else ``""`` (summed: token-weighted or normalised by the mini-batch's counts)."""
    return key.rsplit("_", 1)[-1] if key.startswith("distillation/") and key.endswith(("_min", "_max")) else ""


def _combine(key: str, acc, value):
    kind = _extreme(key)
    return jnp.minimum(acc, value) if kind == "min" else jnp.maximum(acc, value) if kind == "max" else acc + value


def _metric_start(key: str, shape):
    kind = _extreme(key)
    return jnp.full(shape.shape, jnp.inf if kind == "min" else -jnp.inf if kind == "max" else 0, shape.dtype)


def _split(tree, n: int):
    """``[B, ...] -> [n, B/n, ...]`` for every leaf."""
    return jax.tree.map(lambda x: x.reshape((n, x.shape[0] // n) + x.shape[1:]), tree)


def _all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _nonfinite_groups(grads) -> dict:
    """``{"nonfinite_grad/<group>": 1.0 if any gradient of the group is NaN/inf}`` per parameter
    group (the first two levels of the tree: ``embed``, ``layers.attn``, ``layers.mlp``, ``lm_head``);
    what a skipped update reports as non-finite."""
    groups: dict[str, list] = {}
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
        groups.setdefault(".".join(keys[:2] if len(keys) > 2 else keys[:1]), []).append(g)
    return {f"nonfinite_grad/{name}": (~_all_finite(gs)).astype(jnp.float32) for name, gs in groups.items()}


def apply_gradients(state: "TrainState", grads, loss: jax.Array, optimizer: optax.GradientTransformation):
    """One optimizer step from a mini-batch's summed gradients, skipped (parameters and optimizer
    state untouched, ``skipped`` counted) when the loss or any gradient is not finite. Returns
    ``(state, {"grad_norm", "nonfinite_grad/<group>"...})``."""
    train = trainable(state.params)
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & _all_finite(grads)
    updates, new_opt = optimizer.update(grads, state.opt_state, train)
    new_train = optax.apply_updates(train, updates)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)  # noqa: E731
    state = TrainState(params=_with_trainable(state.params, keep(new_train, train)),
                       opt_state=keep(new_opt, state.opt_state),
                       step=state.step + ok.astype(jnp.int32), skipped=state.skipped + (~ok).astype(jnp.int32))
    return state, dict(grad_norm=grad_norm, **_nonfinite_groups(grads))


def _split_rows(metrics: dict) -> tuple[dict, dict]:
    """A loss function's aux metrics -> (scalar metrics, :data:`ROW_OUTPUTS` per-row arrays)."""
    return ({k: v for k, v in metrics.items() if k not in ROW_OUTPUTS},
            {k: v for k, v in metrics.items() if k in ROW_OUTPUTS})


def make_train_step(graphdef, optimizer: optax.GradientTransformation, cfg: StepConfig,
                    mesh: Optional[Mesh] = None, *, loss_fn: Callable = None, packed: bool = False) -> Callable:
    """``train_step(state, batch, key) -> (state, metrics)``, jitted.

    With ``packed=True`` it is ``train_step(state, batch, packed_arrays)`` instead: the
    shuffle, mini-batches and micro-batches come from :func:`rljax.trainer.packing.pack`
    (``[M, U, ...]`` arrays, ``M`` = epochs x mini-batches, run in order); ``batch``
    supplies the ``[B, T]`` trajectory fields (its padded token fields are not used).
    The forward runs on packed rows and log-probs are gathered back to ``[B, T]``, so the
    loss and metrics are the padded step's (see ``rljax/trainer/packing.py``). LoRA
    dropout is not applied on the packed path.

    ``loss_fn(params, graphdef, micro_batch, (num_tokens, num_seqs), cfg, mesh) -> (loss, metrics)``
    is the per-micro-batch loss (default :func:`actor_loss`; the critic passes its value
    loss); ``cfg`` supplies ``ppo_epochs``, ``ppo_mini_batch_size`` and
    ``ppo_micro_batch_size`` (in trajectories). ``B`` must be a multiple of the mini-batch,
    itself a multiple of the micro-batch (the config validates this before anything runs).
    """
    loss_fn = actor_loss if loss_fn is None else loss_fn
    mini, micro_size = cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size
    if mini % micro_size:
        raise ValueError(f"ppo_mini_batch_size={mini} must be a multiple of ppo_micro_batch_size={micro_size}")

    def trainable_loss(train, params, key, *args):
        return loss_fn(_with_trainable(params, train, key), *args)

    grad_fn = jax.value_and_grad(trainable_loss, has_aux=True)

    def constrain(tree):
        if mesh is None:
            return tree
        return jax.tree.map(lambda x: with_logical_constraint(x, ("batch", "length")[: x.ndim] + (None,) * (x.ndim - 2), mesh), tree)

    if faults.active("loss_agg_mode"):  # an update built with another aggregation than it was configured with
        cfg = dataclasses.replace(cfg, loss_agg_mode=next(m for m in rl.AGGREGATION_MODES if m != cfg.loss_agg_mode))

    def minibatch_update(state: TrainState, xs):
        minibatch, dropout_key = xs
        return micro_batches_update(state, (_split(minibatch, mini // micro_size), dropout_key))

    def micro_batches_update(state: TrainState, xs):
        """One optimizer step from a mini-batch given as ``[n_micro, ...]`` micro-batches;
        the loss is normalised by the mini-batch's global counts."""
        micro_batches, dropout_key = xs
        mask = micro_batches["loss_mask"]
        counts = (jnp.sum(mask).astype(jnp.float32), jnp.sum(jnp.any(mask > 0, axis=-1)).astype(jnp.float32))
        train = trainable(state.params)

        def accumulate(carry, xs):
            micro, key, index = xs
            grads_acc, loss_acc, metrics_acc = carry
            if faults.active("drop_micro_row"):  # the first micro-batch of each mini-batch loses its first row
                micro = dict(micro, loss_mask=micro["loss_mask"].at[0].multiply(jnp.where(index == 0, 0.0, 1.0)))
            (loss, metrics), grads = grad_fn(train, state.params, key, graphdef, constrain(micro), counts, cfg, mesh)
            metrics, rows = _split_rows(metrics)
            report = micro_report(micro["loss_mask"], metrics.pop(AGG_PROBE, None))
            grads_acc = jax.tree.map(jnp.add, grads_acc, grads)
            metrics_acc = {k: _combine(k, metrics_acc[k], v) for k, v in metrics.items()}
            return (grads_acc, loss_acc + loss, metrics_acc), (rows, report)

        n_micro = mask.shape[0]
        micro_keys = None if dropout_key is None else jax.random.split(dropout_key, n_micro)
        zeros = jax.tree.map(jnp.zeros_like, train)
        metric_shapes = jax.eval_shape(lambda: _split_rows(loss_fn(state.params, graphdef, jax.tree.map(lambda x: x[0], micro_batches), counts, cfg, mesh)[1])[0])
        metric_shapes.pop(AGG_PROBE, None)
        metric_zeros = {k: _metric_start(k, s) for k, s in metric_shapes.items()}
        (grads, loss, metrics), (rows, report) = jax.lax.scan(
            accumulate, (zeros, jnp.zeros((), jnp.float32), metric_zeros),
            (micro_batches, micro_keys, jnp.arange(n_micro)))
        state, checks = apply_gradients(state, grads, loss, optimizer)
        metrics = dict(metrics, loss=loss, **checks)
        report["denominators"] = jnp.stack(counts)  # what the loss divided by: the mini-batch's tokens, rows
        return state, (metrics, rows, report)  # rows: [n_micro, micro, T] per ROW_OUTPUTS key

    def train_step(state: TrainState, batch: dict, key: jax.Array):
        batch_size = batch["loss_mask"].shape[0]
        if batch_size % mini:
            raise ValueError(f"batch of {batch_size} trajectories does not divide into mini-batches of {mini}")
        if getattr(cfg, "on_policy", False) and (cfg.ppo_epochs != 1 or batch_size != mini):
            raise ValueError(f"StepConfig.on_policy needs one epoch over one mini-batch; got ppo_epochs={cfg.ppo_epochs} "
                             f"and {batch_size // mini} mini-batches of {mini} (later updates would be off-policy)")
        all_metrics, reports = [], []
        n_mini = batch_size // mini
        before = param_digest_traced(state.params)
        row_tokens = jnp.zeros((batch_size,), jnp.float32)
        for epoch_key in jax.random.split(key, cfg.ppo_epochs):
            perm = jax.random.permutation(epoch_key, batch_size) if cfg.shuffle else None
            epoch_batch = batch if perm is None else jax.tree.map(lambda x: x[perm], batch)
            # LoRA dropout draws from its own stream, so the shuffle is the same with or without it
            dropout_keys = jax.random.split(jax.random.fold_in(epoch_key, 1), n_mini) if _dropout(state.params) else None
            state, (metrics, rows, report) = jax.lax.scan(minibatch_update, state,
                                                          (_split(epoch_batch, n_mini), dropout_keys))
            tokens = report.pop("row_tokens").reshape(batch_size)  # [n_mini, n_micro, micro] in the epoch's order
            row_tokens = row_tokens + (tokens if perm is None else jnp.zeros_like(tokens).at[perm].set(tokens))
            all_metrics.append(metrics)
            reports.append(report)
        metrics = jax.tree.map(lambda *xs: jnp.mean(jnp.concatenate(xs)), *all_metrics)
        metrics["skipped_updates"] = state.skipped
        metrics[REPORT] = update_report(reports, row_tokens, cfg, before, param_digest_traced(state.params))
        # on_policy: one epoch, one mini-batch; its rows [1, n_micro, micro, T] back in batch order
        out_rows = {}
        for k, x in rows.items():
            x = x.reshape((batch_size,) + x.shape[3:])
            out_rows[k] = x if perm is None else jnp.zeros_like(x).at[perm].set(x)
        return state, metrics, constrain(out_rows)

    def packed_train_step(state: TrainState, batch: dict, packed: dict):
        # [B, T] trajectory fields -> [M, U, Bm, T] micro-batch slots (empty slots: zeros)
        index = packed["traj_index"]
        if getattr(cfg, "on_policy", False) and index.shape[0] != 1:
            raise ValueError(f"StepConfig.on_policy needs one epoch over one mini-batch; got {index.shape[0]} "
                             "packed mini-batch passes (later updates would be off-policy)")
        take = lambda x: jnp.take(x, index, axis=0, mode="fill", fill_value=0)  # noqa: E731
        minis = {k: take(v) for k, v in batch.items() if k not in _TOKEN_FIELDS}
        minis["packed"] = {k: packed[k] for k in (*_ROW_FIELDS, *_SHARED_FIELDS, "gather") if k in packed}
        before = param_digest_traced(state.params)
        state, (metrics, rows, report) = jax.lax.scan(micro_batches_update, state, (minis, None))
        metrics = jax.tree.map(jnp.mean, metrics)
        metrics["skipped_updates"] = state.skipped
        b = batch["loss_mask"].shape[0]
        flat = index.reshape(-1)  # slot -> trajectory row (b for empty slots, dropped)
        row_tokens = jnp.zeros((b + 1,), jnp.float32).at[flat].add(report.pop("row_tokens").reshape(-1))[:b]
        metrics[REPORT] = update_report([report], row_tokens, cfg, before, param_digest_traced(state.params))
        out_rows = {k: jnp.zeros((b + 1,) + x.shape[3:], x.dtype).at[flat].set(x.reshape((-1,) + x.shape[3:]))[:b]
                    for k, x in rows.items()}
        return state, metrics, constrain(out_rows)

    return _PinnedStateStep(traced_at(packed_train_step if packed else train_step, cfg.matmul_precision), mesh)


#: XLA:CPU options for the update. By default XLA:CPU hands each dot to YNNPACK on its own
#: and materialises transposed copies of the operands around it: in the backward pass of
#: the MLP, the weight gradients' [tokens, mlp] operands are transposed in memory per layer
#: (``copy_bitcast_fusion`` in a profile, ~35% of the update at 31.6M). Fusing dots into
#: YNNPACK fusions (``LIBRARY_FUSION_TYPE_DOT``) avoids them: value_and_grad of the actor
#: loss 0.64x the default's time (wall and CPU, 31.6M, 32 x 40 tokens, bench in the README),
#: float32 results equal to ~2e-6 relative (summation order). Not for forward-only programs:
#: the old-log-prob forward ran 1.27x slower with it.
CPU_COMPILER_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}


def cpu_compiler_options() -> Optional[dict]:
    """:data:`CPU_COMPILER_OPTIONS` on the CPU backend (unless ``RLJAX_XLA_CPU_DEFAULTS=1``), else None."""
    import os

    if jax.default_backend() != "cpu" or os.environ.get("RLJAX_XLA_CPU_DEFAULTS") == "1":
        return None
    return dict(CPU_COMPILER_OPTIONS)


class _PinnedStateStep:
    """``train_step`` jitted with the state's output layout equal to its input layout.

    Left free, XLA may return the updated state in another layout than the initial one,
    and the second step would compile again for the new input layout. The layout is taken
    from the first state seen; ``lower`` exposes the compiled program (memory analysis) and
    also takes a state of ``jax.ShapeDtypeStruct`` leaves with shardings (nothing allocated).
    """

    def __init__(self, train_step: Callable, mesh: Optional[Mesh]):
        self._train_step, self._mesh = train_step, mesh
        self._layout = None
        self._jitted = None

    def _prepare(self, state):
        if self._jitted is None:
            mesh = self._mesh

            def layout(x):
                sharding = getattr(x, "sharding", None)
                if isinstance(sharding, NamedSharding) or mesh is None:
                    return sharding
                return NamedSharding(mesh, PartitionSpec())

            scalar = None if mesh is None else NamedSharding(mesh, PartitionSpec())
            self._layout = jax.tree.map(layout, state)
            # per-row outputs (ROW_OUTPUTS) keep the layout the step constrained them to
            self._jitted = jax.jit(self._train_step, donate_argnums=(0,), out_shardings=(self._layout, scalar, None),
                                   compiler_options=cpu_compiler_options())
        abstract = all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))
        if not abstract:  # committed to the pinned layout (optimizer counters created on one device join the mesh)
            state = jax.device_put(state, self._layout)
        return state

    def __call__(self, state, batch, key):
        state = self._prepare(state)
        state, metrics, rows = self._jitted(state, batch, key)
        return state, {**metrics, **rows}

    def lower(self, state, batch, key):
        state = self._prepare(state)
        return self._jitted.lower(state, batch, key)


def make_logprob_fn(graphdef, *, response_len: int, temperature: float, impl: str = "auto",
                    mesh: Optional[Mesh] = None, micro_batch_size: Optional[int] = None,
                    matmul_precision: Optional[str] = None) -> Callable:
    """Jitted ``(params, batch) -> (logp, entropy)`` for old / reference log-probs, in micro-batches."""

    def compute(params, batch):
        fields = {k: batch[k] for k in ("input_ids", "attention_mask", "positions")}
        b = fields["input_ids"].shape[0]
        n = 1 if micro_batch_size is None else max(b // micro_batch_size, 1)
        fn = lambda chunk: response_logprobs(graphdef, params, chunk, response_len=response_len,  # noqa: E731
                                             temperature=temperature, impl=impl, mesh=mesh)
        logp, entropy = jax.lax.map(fn, _split(fields, n))
        out = logp.reshape(b, -1), entropy.reshape(b, -1)
        if mesh is not None:  # rows stay on dp (and the response on sp), like the batch they belong to
            out = tuple(with_logical_constraint(x, ("batch", "length"), mesh) for x in out)
        return out

    return jax.jit(traced_at(compute, matmul_precision))


# --------------------------------------------------------------------------- packed log-probs


def make_packed_logprob_fn(graphdef, *, temperature: float, impl: str = "auto",
                           mesh: Optional[Mesh] = None, matmul_precision: Optional[str] = None) -> Callable:
    """Jitted ``(params, packed, batch_size) -> (logp, entropy) [B, T]`` for old / reference log-probs
    from :func:`rljax.trainer.packing.pack_logprob_batch` arrays (``[1, U, R, L]`` rows,
    one micro-batch per ``U``, mapped sequentially); rows come back in the batch's order."""

    def compute(params, packed, b):
        rows = {k: packed[k][0] for k in (*_ROW_FIELDS, *_SHARED_FIELDS) if k in packed}
        fn = lambda r: packed_response_logprobs(graphdef, params, r, r["gather"], temperature=temperature,  # noqa: E731
                                                impl=impl, mesh=mesh)
        logp, entropy = jax.lax.map(fn, dict(rows, gather=packed["gather"][0]))  # [U, Bm, T]
        index = packed["traj_index"][0].reshape(-1)  # slot -> trajectory row (B for empty slots)

        def scatter(x):
            out = jnp.zeros((b + 1, x.shape[-1]), x.dtype).at[index].set(x.reshape(-1, x.shape[-1]))
            out = out[:b]
            return out if mesh is None else with_logical_constraint(out, ("batch", "length"), mesh)

        return scatter(logp), scatter(entropy)

    return jax.jit(traced_at(compute, matmul_precision), static_argnums=2)


class PackedTrainStep:
    """The packed actor update behind the padded step's signature: ``(state, batch, key) ->
    (state, metrics)`` for a ``[B, S+T]`` learner batch.

    Each call reads every row's real-token span back to the host (:func:`host_spans`: three
    ``[B]`` int arrays, all-gathered with several processes; never the tokens), draws the
    epoch orders the padded step would draw from ``key``
    (:func:`rljax.trainer.packing.epoch_orders`), plans the packing from the spans
    (:func:`rljax.trainer.packing.plan`), takes the packed rows' tokens on the devices
    (:func:`rljax.trainer.packing.take_rows_on_mesh`) and runs the packed step; numbers equal
    the padded step's to float tolerance. ``shared_prefix`` (True / False / "auto"): lay each
    group's prompt once (:mod:`rljax.trainer.prefix`; the prompts' hashes are read too). ``stats``
    holds the last call's packing statistics (``dp_token_imbalance``, ``padding_frac``: the
    fraction of processed token slots that are padding, ``gathered_bytes``: what this process
    all-gathered to plan, ``shared_prefix``: the layout used, ``shared_saved_tokens``) and
    ``compiles`` the number of distinct packed programs seen so far.
    """

    def __init__(self, graphdef, optimizer: optax.GradientTransformation, cfg: StepConfig, pack_cfg,
                 mesh: Optional[Mesh] = None, *, response_len: int, loss_fn: Optional[Callable] = None,
                 shared_prefix=False):
        self._step = make_train_step(graphdef, optimizer, cfg, mesh, loss_fn=loss_fn, packed=True)
        self.cfg, self.pack_cfg, self.mesh, self.response_len = cfg, pack_cfg, mesh, response_len
        self.shared_prefix = shared_prefix  # actor.shared_prefix: True, False or "auto" (rljax.trainer.prefix.plan_layout)
        self.shapes: set = set()
        self.stats: dict = {}

    @property
    def compiles(self) -> int:
        return len(self.shapes)

    def _packed(self, batch: dict, key):
        b, width = batch["input_ids"].shape
        orders = packing.epoch_orders(key, b, self.cfg.ppo_epochs, self.cfg.shuffle)
        index, self.stats = prefix.plan_batch(batch, self.response_len, orders, self.cfg.ppo_mini_batch_size,
                                              self.pack_cfg, self.shared_prefix)
        self.shapes.add((self.stats["shape"], self.stats["shared_prefix"]))
        return packing.take_rows_on_mesh(batch["input_ids"], batch["positions"], index, self.mesh)

    def __call__(self, state, batch: dict, key):
        packed = self._packed(batch, key)
        self._last_abstract = _abstract(packed)
        return self._step(state, batch, packed)

    def lower(self, state, batch: dict, key):
        # The program the last call ran: packing again would read the batch back to the host,
        # a collective with several processes, and the ledgers lower on the main process only.
        packed = getattr(self, "_last_abstract", None) or self._packed(batch, key)
        return self._step.lower(state, batch, packed)


class PackedLogprob:
    """Packed old / reference log-probs behind the padded signature ``(params, inputs) ->
    (logp, entropy) [B, T]`` (``inputs``: ``input_ids, attention_mask, positions``); with
    ``packed_fn`` any such packed pass, e.g. the critic's values (``V [B, T]``)."""

    def __init__(self, graphdef, pack_cfg, *, response_len: int, temperature: float = 1.0, impl: str = "auto",
                 mesh: Optional[Mesh] = None, packed_fn: Optional[Callable] = None,
                 matmul_precision: Optional[str] = None, shared_prefix=False):
        # packed_fn: another jitted (params, packed, batch_size) pass, e.g. the critic's values
        self._fn = packed_fn or make_packed_logprob_fn(graphdef, temperature=temperature, impl=impl, mesh=mesh,
                                                       matmul_precision=matmul_precision)
        self.pack_cfg, self.mesh, self.response_len = pack_cfg, mesh, response_len
        self.shared_prefix = shared_prefix  # as PackedTrainStep's
        self.shapes: set = set()
        self.stats: dict = {}

    @property
    def compiles(self) -> int:
        return len(self.shapes)

    def _packed(self, inputs: dict):
        b = inputs["input_ids"].shape[0]
        index, self.stats = prefix.plan_batch(inputs, self.response_len, [np.arange(b)], b, self.pack_cfg,
                                              self.shared_prefix)
        self.shapes.add((self.stats["shape"], self.stats["shared_prefix"]))
        return packing.take_rows_on_mesh(inputs["input_ids"], inputs["positions"], index, self.mesh), b

    def __call__(self, params, inputs: dict):
        packed, b = self._packed(inputs)
        self._last_abstract = (_abstract(packed), b)
        return self._fn(params, packed, b)

    def lower(self, params, inputs: dict):
        packed, b = getattr(self, "_last_abstract", None) or self._packed(inputs)  # see PackedTrainStep.lower
        return self._fn.lower(params, packed, b)


def _abstract(tree):
    """Shapes, dtypes and shardings of ``tree``'s arrays (enough to lower a program; holds no memory)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), tree)
