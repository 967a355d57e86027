"""Pure RL loss functions: advantages, policy / value losses, KL, entropy, aggregation,
rollout correction and staleness rules.

Every function is pure, takes arrays and keyword-only hyper-parameters, validates its
inputs with chex, and works under ``jax.jit``, ``jax.grad`` and ``jax.vmap``. Semantics
follow verl's ``core_algos.py`` (differences are documented per function).

This package imports only jax, chex and numpy: no flax, TensorFlow, TFDS or JetStream.

>>> from rljax.loss import grpo_advantages, policy_loss
"""

from rljax.loss._advantages import (
    gae_advantages,
    grpo_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rljax.loss._estimators import get_adv_estimator, register_adv_estimator, registered_adv_estimators
from rljax.loss._aggregate import AGGREGATION_MODES, aggregate
from rljax.loss._correction import rollout_correction_weights
from rljax.loss._distill import (
    DISTILLATION_LOSS_MODES,
    DistillationSpec,
    clamp_distillation_losses,
    distillation_loss,
    estimator_distillation_losses,
    forward_kl_topk,
    with_distillation,
)
from rljax.loss._kl import adaptive_kl_coef, entropy_from_logits, kl_penalty, mean_sequence_kl
from rljax.loss._mismatch import rollout_mismatch
from rljax.loss._masked import masked_mean, masked_sum, masked_var, masked_whiten
from rljax.loss._policy import (
    get_policy_loss,
    policy_loss,
    policy_loss_options,
    register_policy_loss,
    registered_policy_losses,
)
from rljax.loss import _bypass, _covariance, _policy_variants  # noqa: F401  (register verl's other losses)
from rljax.loss._rollout_corr import (
    RS_OPTIONS,
    offpolicy_metrics,
    parse_is_threshold,
    parse_rs_thresholds,
    rollout_correction,
    rollout_is_weights,
    rollout_rejection_mask,
)
from rljax.loss._roles import Role, action_mask
from rljax.loss._staleness import StalenessReport, policy_staleness, raise_on_future, staleness_filter, staleness_gate
from rljax.loss._value import value_loss

__all__ = [
    "DISTILLATION_LOSS_MODES",
    "DistillationSpec",
    "clamp_distillation_losses",
    "distillation_loss",
    "with_distillation",
    "estimator_distillation_losses",
    "forward_kl_topk",
    "AGGREGATION_MODES",
    "Role",
    "StalenessReport",
    "action_mask",
    "adaptive_kl_coef",
    "aggregate",
    "entropy_from_logits",
    "gae_advantages",
    "get_adv_estimator",
    "get_policy_loss",
    "grpo_advantages",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mean_sequence_kl",
    "offpolicy_metrics",
    "parse_is_threshold",
    "parse_rs_thresholds",
    "policy_loss",
    "policy_loss_options",
    "RS_OPTIONS",
    "registered_policy_losses",
    "rollout_correction",
    "rollout_is_weights",
    "rollout_rejection_mask",
    "policy_staleness",
    "raise_on_future",
    "register_adv_estimator",
    "register_policy_loss",
    "registered_adv_estimators",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "rollout_correction_weights",
    "rollout_mismatch",
    "staleness_filter",
    "staleness_gate",
    "value_loss",
]
