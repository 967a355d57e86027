"""What the learner's loss reads from the run's configuration: the policy loss with its own options,
and whether the prepare stage computes the decoupled rollout correction. The trainer reads these
keys here, at build (not :mod:`rljax.config`, which only checks them): each loss mode's options
(:data:`rljax.config.POLICY_LOSS_KEYS`) are read by a run in that mode and by no other."""

from __future__ import annotations

from rljax.config import POLICY_LOSS_KEYS, bypass_loss


def policy_loss_config(cfg) -> tuple[str, dict]:
    """``(loss mode, {option: value})`` of the actor's policy loss (see :func:`bypass_loss`)."""
    mode = "bypass_mode" if bypass_loss(cfg) else cfg.actor.policy_loss
    options = {}
    for key in POLICY_LOSS_KEYS.get(mode, ()):
        section, name = key.rsplit(".", 1)
        node = cfg
        for part in section.split("."):
            node = getattr(node, part)
        options[name] = getattr(node, name)
    return mode, options


def decoupled_correction(cfg) -> bool:
    """Whether the prepare stage computes verl's decoupled rollout correction (weights / rejection
    from ``old_logp`` and ``rollout_logp``, applied as ``rollout_is_weights``)."""
    rc = cfg.algorithm.rollout_correction
    return not cfg.algorithm.bypass_mode and bool(rc.rollout_is or rc.rollout_rs)


#: The ``algorithm.rollout_correction`` keys the decoupled correction reads (``loss_type`` is bypass mode's).
DECOUPLED_KEYS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs", "rollout_rs_threshold")


def decoupled_correction_options(cfg) -> tuple:
    """``((key, value), ...)`` of the decoupled rollout correction for the prepare stage; ``()`` when off."""
    if not decoupled_correction(cfg):
        return ()
    rc = cfg.algorithm.rollout_correction
    return tuple((key, getattr(rc, key)) for key in DECOUPLED_KEYS)
