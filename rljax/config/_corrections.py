"""Checks of the policy-loss and rollout-correction keys (``actor.policy_loss`` and its options,
``algorithm.rollout_correction.*``, ``algorithm.bypass_mode``). Pure Python: the threshold
strings are parsed by the leaf :mod:`rljax._rollout_thresholds`, as the loss will read them."""

from __future__ import annotations

from rljax._rollout_thresholds import parse_is_threshold, parse_rs_thresholds
from rljax.errors import ConfigError

RC = "algorithm.rollout_correction"


def correction_blockers(config) -> list[str]:
    """:func:`rljax.config.on_policy_blockers` entries of the decoupled rollout correction."""
    rc = config.algorithm.rollout_correction
    if config.algorithm.bypass_mode or not (rc.rollout_is or rc.rollout_rs):
        return []
    return [f"{RC}.rollout_is / rollout_rs (its weights read old_logp before the update)"]


def check_corrections(config) -> None:
    """Threshold syntax, the two spellings of the IS correction, and what bypass mode combines with."""
    al, a, r = config.algorithm, config.actor, config.rollout
    rc = al.rollout_correction
    try:
        if rc.rollout_is:
            parse_is_threshold(rc.rollout_is_threshold)
        if rc.rollout_rs:
            parse_rs_thresholds(rc.rollout_rs, rc.rollout_rs_threshold)
    except ValueError as e:
        raise ConfigError(f"{RC}: {e}") from None
    if a.policy_loss == "dro" and a.dro_beta is None:
        raise ConfigError("actor.policy_loss=dro needs actor.dro_beta (> 0), the coefficient of its quadratic log-ratio "
                          "penalty (verl: actor_rollout_ref.actor.policy_loss.dro_beta)")
    if rc.rollout_is and r.correction != "none":
        raise ConfigError(f"rollout.correction={r.correction} and {RC}.rollout_is={rc.rollout_is} both set the "
                          f"importance weights; keep one ({RC}.rollout_is is verl's spelling)")
    if a.policy_loss == "bypass_mode" and not al.bypass_mode:
        raise ConfigError("actor.policy_loss=bypass_mode needs algorithm.bypass_mode=true (its behaviour log-prob is the "
                          "sampler's; verl's algorithm.rollout_correction.bypass_mode)")
    if al.bypass_mode and bypass_loss(config) and a.policy_loss not in ("vanilla", "bypass_mode"):
        raise ConfigError(f"{RC} in bypass mode runs verl's bypass_mode loss (PPO-clip or REINFORCE, "
                          f"{RC}.loss_type), not actor.policy_loss={a.policy_loss}; accepted: actor.policy_loss=vanilla "
                          f"or bypass_mode, or no {RC}.rollout_is / rollout_rs / loss_type=reinforce")


def bypass_loss(config) -> bool:
    """Whether the actor's loss is verl's ``bypass_mode`` loss: named, or implied in bypass mode by a
    rollout correction (verl's ``apply_bypass_mode`` always switches to it; plain PPO-clip without
    weights or rejection is the same loss as ``vanilla``, which rljax keeps then)."""
    al = config.algorithm
    rc = al.rollout_correction
    if config.actor.policy_loss == "bypass_mode":
        return True
    return bool(al.bypass_mode and (rc.rollout_is or rc.rollout_rs or rc.loss_type != "ppo_clip"))


#: The keys each policy loss reads beyond the common clip / aggregation ones (its options in
#: :func:`rljax.loss.policy_loss_options`, by the same names; a test keeps the two equal).
POLICY_LOSS_KEYS = {
    "sapo": ("actor.tau_pos", "actor.tau_neg"),
    "clip_cov": ("actor.clip_cov_ratio", "actor.clip_cov_lb", "actor.clip_cov_ub"),
    "kl_cov": ("actor.kl_cov_ratio", "actor.ppo_kl_coef"),
    "dro": ("actor.dro_beta",),
    "bypass_mode": tuple(f"{RC}.{k}" for k in ("loss_type", "rollout_is", "rollout_is_threshold",
                                               "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")),
}
