"""The prepare stage: from scores and log-probs to what the update consumes, in one jitted function.

``prepare(fields, kl_coef) -> dict`` computes, on the mesh and without leaving the device:

1. token-level rewards: each trajectory's outcome score on its last action token
   (:func:`rljax.trainer.critic.outcome_token_rewards`); with KL in the reward, minus
   ``kl_coef * KL(old || ref)`` on every action token (verl's ``apply_kl_penalty``);
2. advantages and returns through the estimator registry (one signature, see
   :mod:`rljax.loss._estimators`): ``grpo``, ``rloo``, ``reinforce_plus_plus_baseline``,
   ``gae`` or a user's registered function;
3. rollout-correction weights (truncated IS, ``π_old / π_rollout``) when enabled.

``kl_coef`` is a traced scalar, so the adaptive KL controller changing it every step does
not recompile. Everything else is static (:class:`PrepareConfig`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp

from rljax import loss as rl
from rljax.errors import ConfigError
from rljax.reward import load_function
from rljax.trainer.critic import outcome_token_rewards


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """Static settings of the prepare stage.

    Args:
      estimator: a name registered with :func:`rljax.loss.register_adv_estimator`.
      num_groups: prompt groups in the batch.
      algorithm: ``algorithm.*`` hyper-parameters handed to the estimator as ``config``
        (items, so the dataclass stays hashable).
      use_kl_in_reward: subtract the KL penalty from the token rewards.
      kl_penalty: the KL estimator (``rljax.loss.kl_penalty`` ``kind``).
      correction: ``none``, ``token`` or ``sequence`` rollout correction.
      correction_threshold: truncation of the correction weights.
      behaviour_logp: the batch field holding the behaviour policy's log-probs
        (``old_logp``; ``rollout_logp`` in bypass mode).
    """

    estimator: str
    num_groups: int
    algorithm: tuple = ()
    use_kl_in_reward: bool = False
    kl_penalty: str = "low_var_kl"
    correction: str = "none"
    correction_threshold: float = 2.0
    rollout_correction: tuple = ()  # algorithm.rollout_correction items (decoupled mode); () when off
    behaviour_logp: str = "old_logp"

    def inputs(self, *, critic: bool) -> tuple[str, ...]:
        """The batch fields :func:`prepare` reads."""
        keys = ["scores", "loss_mask", "group_id", "row_mask"]
        if self.use_kl_in_reward:
            keys += [self.behaviour_logp, "ref_logp"]
        if critic:
            keys.append("values")
        if self.correction != "none" or self.rollout_correction:
            keys += ["old_logp", "rollout_logp"]
        return tuple(dict.fromkeys(keys))


def prepare(fields: Mapping[str, jax.Array], kl_coef: jax.Array, *, cfg: PrepareConfig,
            estimator: Optional[Callable] = None) -> dict[str, Any]:
    """``token_level_rewards``, ``advantages``, ``returns`` (+ ``rollout_is_weights``, ``kl_in_reward``, and with
    ``algorithm.rollout_correction`` in decoupled mode ``rollout_corr``: verl's ``rollout_corr/*`` scalars)."""
    mask = jnp.asarray(fields["loss_mask"], jnp.float32)
    row = jnp.asarray(fields["row_mask"], bool)
    token_rewards = outcome_token_rewards(fields["scores"], mask)
    out: dict[str, Any] = {}
    if cfg.use_kl_in_reward:
        kl = rl.kl_penalty(fields[cfg.behaviour_logp], fields["ref_logp"], kind=cfg.kl_penalty) * mask
        token_rewards = token_rewards - kl_coef * kl
        out["kl_in_reward"] = rl.mean_sequence_kl(kl, mask, row_mask=row)  # what the adaptive controller steers
    fn = estimator or rl.get_adv_estimator(cfg.estimator)
    advantages, returns = fn(token_rewards, mask, group_id=fields["group_id"], num_groups=cfg.num_groups,
                             row_mask=row, values=fields.get("values"), config=dict(cfg.algorithm))
    out.update(token_level_rewards=token_rewards, advantages=jnp.asarray(advantages, jnp.float32),
               returns=jnp.asarray(returns, jnp.float32))
    if cfg.correction != "none":
        out["rollout_is_weights"] = rl.rollout_correction_weights(
            fields["old_logp"], fields["rollout_logp"], mask, level=cfg.correction,
            threshold=cfg.correction_threshold)
    if cfg.rollout_correction:
        out["rollout_is_weights"], out["rollout_corr"] = decoupled_weights(fields, mask, dict(cfg.rollout_correction))
    return out


def decoupled_weights(fields, mask, rc: dict):
    """verl's decoupled rollout correction as one weight per token: the IS weight (1 without
    ``rollout_is``) times the rejection mask (``rollout_rs``), and verl's ``rollout_corr/*`` metrics.
    verl drops rejected tokens from the response mask instead; here they weigh 0 in the policy
    loss but stay in its normaliser and in the entropy / KL terms (docs: algorithms guide)."""
    weights, kept, metrics = rl.rollout_correction(
        fields["old_logp"], fields["rollout_logp"], mask, rollout_is=rc["rollout_is"],
        rollout_is_threshold=rc["rollout_is_threshold"], rollout_is_batch_normalize=rc["rollout_is_batch_normalize"],
        rollout_rs=rc["rollout_rs"], rollout_rs_threshold=rc["rollout_rs_threshold"])
    return (kept if weights is None else weights * kept), metrics


#: Keyword arguments every estimator accepts (the registry's one signature).
ESTIMATOR_KWARGS = ("group_id", "num_groups", "row_mask", "values", "config")


def check_estimator_signature(fn: Callable, spec: str) -> None:
    """``ConfigError`` unless ``fn`` takes the registry's signature (see :mod:`rljax.loss._estimators`)."""
    import inspect

    try:
        inspect.signature(fn).bind(None, None, **{k: None for k in ESTIMATOR_KWARGS})
    except TypeError:
        raise ConfigError(
            f"algorithm.adv_estimator={spec!r}: {getattr(fn, '__name__', fn)}{inspect.signature(fn)} must accept "
            "(token_level_rewards, response_mask, *, group_id, num_groups, row_mask, values, config)") from None
    except ValueError:  # no signature to inspect: called as is
        pass


def load_estimator(spec: str) -> Callable:
    """The estimator named ``spec``: a registered name, or ``path/to/file.py:function`` (a user's
    file, like reward plugins), which is checked and registered under ``spec``."""
    if ":" not in spec:
        return rl.get_adv_estimator(spec)

    fn = load_function(spec, key="algorithm.adv_estimator", prefix="rljax_estimator_plugin")
    check_estimator_signature(fn, spec)
    if spec not in rl.registered_adv_estimators():
        rl.register_adv_estimator(spec)(fn)
    return rl.get_adv_estimator(spec)


def make_prepare_fn(cfg: PrepareConfig, estimator: Optional[Callable] = None) -> Callable:
    """``prepare_fn(fields, kl_coef) -> dict``, jitted once for ``cfg``."""
    return jax.jit(lambda fields, kl_coef: prepare(fields, kl_coef, cfg=cfg, estimator=estimator))
