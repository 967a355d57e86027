"""The config's distillation loss modes are the loss package's (the schema lists them so that
validating a config does not import JAX)."""

from rljax import loss as L
from rljax.config._schema import DISTILLATION_LOSS_MODES


def test_config_lists_the_loss_modes():
    assert DISTILLATION_LOSS_MODES == L.DISTILLATION_LOSS_MODES
