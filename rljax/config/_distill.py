"""Checks of the on-policy distillation keys (``distillation.*``, verl's names). Pure Python; the
teacher's files and vocabulary are the trainer's preflight (:mod:`rljax.trainer._check`)."""

from __future__ import annotations

from rljax.errors import ConfigError
from rljax.hf_config import SUPPORTED_ARCHITECTURES

TEACHER = "distillation.teacher_model.model_path"
#: The estimators whose gradient does not depend on the teacher when differentiated directly.
_TEACHERLESS_GRADIENT = ("k1", "kl")


def check_distillation(config) -> None:
    """A teacher is named, and a loss that is not differentiated directly when its gradient ignores it."""
    d = config.distillation
    if not d.enabled:
        return
    if not d.teacher_model.model_path:
        raise ConfigError(f"distillation.enabled=true needs a teacher: set {TEACHER} to ref (the policy's initial "
                          f"weights) or a local Hugging Face directory of {' / '.join(SUPPORTED_ARCHITECTURES)}")
    dl = d.distillation_loss
    if dl.loss_mode in _TEACHERLESS_GRADIENT and not dl.use_policy_gradient:
        raise ConfigError(f"distillation.distillation_loss.loss_mode={dl.loss_mode} with use_policy_gradient=false: "
                          "the gradient of the k1 estimate does not depend on the teacher's log-probs (verl refuses "
                          "it too); accepted: use_policy_gradient=true, or loss_mode=k3 / forward_kl_topk")
