"""model.matmul_precision: validated in one line, recorded in the resolved config, and baked into
the learner and sampler programs. The suite runs with jax_default_matmul_precision=highest
(tests/conftest.py) and CPU computes float32 fully either way, so the programs' lowered
StableHLO (each dot's precision_config) is what tells the values apart here."""

import re
import types

import jax
import jax.numpy as jnp
import optax
import pytest

from rljax.config import ConfigError, resolve
from rljax.config._schema import MATMUL_PRECISIONS as SCHEMA_PRECISIONS
from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.models.precision import MATMUL_PRECISIONS, traced_at
from rljax.rollout import RljaxEngine
from rljax.trainer.build import step_config_for
from rljax.trainer.step import StepConfig, init_state, make_logprob_fn, make_train_step

CFG = get_config("tiny")
B, S, T = 4, 6, 5


def dot_precisions(text: str) -> set:
    """The precision of every dot_general in a StableHLO text (DEFAULT when unset)."""
    found = set()
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            m = re.search(r"precision = \[(\w+), (\w+)\]", line)
            found.update(m.groups() if m else ("DEFAULT",))
    return found


@pytest.fixture(scope="module")
def model():
    return F.init_params(CFG, seed=0)


def _batch(b=B):
    ids = jnp.ones((b, S + T), jnp.int32)
    mask = jnp.ones((b, S + T), jnp.int32)
    return {"input_ids": ids, "attention_mask": mask, "positions": F.default_positions(mask),
            "loss_mask": jnp.ones((b, T), jnp.float32), "advantages": jnp.zeros((b, T), jnp.float32),
            "old_logp": jnp.zeros((b, T), jnp.float32)}


def learner_texts(model, precision):
    graphdef, params = model
    cfg = StepConfig(ppo_mini_batch_size=B, ppo_micro_batch_size=B, logprob_impl="chunked",
                     matmul_precision=precision)
    opt = optax.sgd(1.0)
    abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    state = jax.tree.map(abstract, init_state(params, opt))
    batch = jax.tree.map(abstract, _batch())
    update = make_train_step(graphdef, opt, cfg).lower(state, batch, jax.random.key(0)).as_text()
    forward = make_logprob_fn(graphdef, response_len=T, temperature=1.0, impl="chunked",
                              matmul_precision=precision)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "positions")}
    return update, forward.lower(jax.tree.map(abstract, params), inputs).as_text()


def sampler_text(model, precision):
    _, params = model
    engine = RljaxEngine(CFG, num_slots=2, max_prefill_length=8, max_decode_length=4,
                         matmul_precision=precision)
    return engine._prefill_fn.lower(params, jnp.ones((2, 8), jnp.int32), jnp.full((2,), 8)).as_text()


@pytest.mark.parametrize("precision,expected", [
    ("default", {"DEFAULT"}),
    pytest.param("highest", {"HIGHEST"}, marks=pytest.mark.slow),
    pytest.param("high", {"HIGH"}, marks=pytest.mark.slow)])
def test_learner_and_sampler_programs_carry_the_precision(model, precision, expected):
    # under the suite's global "highest": "default" must still come out DEFAULT
    assert jax.config.jax_default_matmul_precision == "highest"
    texts = (*learner_texts(model, precision), sampler_text(model, precision))
    assert [dot_precisions(t) for t in texts] == [expected] * 3


def test_no_precision_leaves_jax_setting(model):
    """A library caller that sets nothing keeps JAX's own setting (here the suite's highest)."""
    graphdef, params = model
    fn = make_logprob_fn(graphdef, response_len=T, temperature=1.0, impl="chunked")
    batch = _batch()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "positions")}
    assert dot_precisions(fn.lower(params, inputs).as_text()) == {"HIGHEST"}


def test_the_key_is_validated_and_resolved():
    assert SCHEMA_PRECISIONS == MATMUL_PRECISIONS
    cfg, _ = resolve(None, ["model.matmul_precision=highest"])
    assert cfg.model.matmul_precision == "highest"
    sizes = types.SimpleNamespace(mini_batch_trajectories=8, micro_batch_trajectories=8)
    assert step_config_for(cfg, sizes, on_policy=False).matmul_precision == "highest"
    assert resolve(None, [])[0].model.matmul_precision == "default"
    with pytest.raises(ConfigError) as err:
        resolve(None, ["model.matmul_precision=tf32"])
    msg = str(err.value)
    assert "\n" not in msg and "model.matmul_precision" in msg and "default, high, highest" in msg
    with pytest.raises(ValueError, match="matmul_precision='tf32'; accepted: default, high, highest"):
        traced_at(lambda: None, "tf32")
