"""The pure actor update: micro-batch invariance, padding exclusion, non-finite skip, mesh invariance."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.sharding import make_mesh
from rljax.trainer import StepConfig, init_state, make_logprob_fn, make_optimizer, make_train_step

S, T = 8, 8
CFG = get_config("tiny")


def _batch(seed: int, b: int, graphdef, params):
    """A realistic batch: left-padded prompts, ragged responses, a tool observation, old log-probs."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(2, S + 1, b)
    rlen = rng.integers(1, T + 1, b)
    prompt_mask = np.arange(S)[None, :] >= (S - plen)[:, None]
    resp_mask = np.arange(T)[None, :] < rlen[:, None]
    ids = rng.integers(3, CFG.vocab_size, (b, S + T)).astype(np.int32)
    attn = np.concatenate([prompt_mask, resp_mask], axis=1)
    ids = np.where(attn, ids, 0)
    loss_mask = resp_mask.copy()
    loss_mask[:, 1] &= rng.random(b) > 0.5  # some rows have a tool-observation token at t=1
    batch = {
        "input_ids": jnp.asarray(ids),
        "attention_mask": jnp.asarray(attn),
        "positions": F.default_positions(jnp.asarray(attn)),
        "loss_mask": jnp.asarray(loss_mask, jnp.float32),
        "advantages": jnp.asarray(np.repeat(rng.normal(0, 1, (b, 1)), T, 1), jnp.float32),
    }
    logp, _ = make_logprob_fn(graphdef, response_len=T, temperature=1.0, impl="naive")(params, batch)
    batch["old_logp"] = logp + jnp.asarray(rng.normal(0, 0.05, (b, T)), jnp.float32)
    return batch


@pytest.fixture(scope="module")
def model():
    return F.init_params(CFG, seed=0)


#: Compiled steps shared by the tests of this module (compiling the update is most of their
#: time): one per (step config, optimizer, mesh); batches of equal shapes reuse it.
_STEPS: dict = {}


def _run(graphdef, params, batch, *, mesh=None, adam=False, **kw):
    # Plain SGD for the invariance checks: Adam divides by sqrt(v), which turns float noise
    # in a near-zero gradient into an lr-sized step and would hide what is being compared.
    opt = make_optimizer(lr=1e-2, grad_clip=1.0) if adam else optax.sgd(1.0)
    cfg = StepConfig(**{"ppo_mini_batch_size": 8, "ppo_micro_batch_size": 8, "logprob_impl": "chunked", **kw})
    key = (cfg, adam, None if mesh is None else tuple(dict(mesh.shape).items()))
    if key not in _STEPS:
        _STEPS[key] = make_train_step(graphdef, opt, cfg, mesh=mesh)
    state = init_state(jax.tree.map(jnp.copy, params), opt)
    return _STEPS[key](state, batch, jax.random.key(0))


@pytest.mark.parametrize("agg", ["token-mean", pytest.param("seq-mean-token-mean", marks=pytest.mark.slow)])
def test_micro_batch_size_does_not_change_the_update(model, agg):
    graphdef, params = model
    batch = _batch(0, 8, graphdef, params)
    s8, m8 = _run(graphdef, params, batch, ppo_micro_batch_size=8, loss_agg_mode=agg)
    s2, m2 = _run(graphdef, params, batch, ppo_micro_batch_size=4, loss_agg_mode=agg)
    chex.assert_trees_all_close(s2.params, s8.params, rtol=1e-5, atol=1e-6)
    for k in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm"):
        np.testing.assert_allclose(m2[k], m8[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert int(s8.step) == 1 and int(s8.skipped) == 0


def test_padding_rows_carry_zero_weight(model):
    graphdef, params = model
    batch = _batch(1, 6, graphdef, params)
    pad = {k: jnp.concatenate([v, v[:2]]) for k, v in batch.items()}
    pad["loss_mask"] = pad["loss_mask"].at[6:].set(0.0)
    pad["advantages"] = pad["advantages"].at[6:].set(1e4)
    ref, mref = _run(graphdef, params, batch, ppo_mini_batch_size=6, ppo_micro_batch_size=6)
    out, mout = _run(graphdef, params, pad, ppo_mini_batch_size=8, ppo_micro_batch_size=4)
    chex.assert_trees_all_close(out.params, ref.params, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mout["pg_loss"], mref["pg_loss"], rtol=1e-5)


def test_non_finite_gradient_skips_the_update(model):
    graphdef, params = model
    batch = _batch(2, 8, graphdef, params)
    batch["advantages"] = batch["advantages"].at[0, 0].set(jnp.nan)
    batch["loss_mask"] = batch["loss_mask"].at[0, 0].set(1.0)
    state, metrics = _run(graphdef, params, batch, adam=True)
    assert int(state.skipped) == 1 and int(state.step) == 0
    chex.assert_trees_all_equal(state.params, params)
    assert int(metrics["skipped_updates"]) == 1
    assert float(metrics["nonfinite_grad/layers.attn"]) > 0 and float(metrics["nonfinite_grad/lm_head"]) > 0


def test_update_moves_towards_higher_advantage(model):
    """After a step, log-probs of positive-advantage tokens rise and negative ones fall (on average)."""
    graphdef, params = model
    batch = _batch(3, 8, graphdef, params)
    batch["old_logp"] = make_logprob_fn(graphdef, response_len=T, temperature=1.0, impl="naive")(params, batch)[0]
    state, _ = _run(graphdef, params, batch, adam=True)
    new, _ = make_logprob_fn(graphdef, response_len=T, temperature=1.0, impl="naive")(state.params, batch)
    delta = jnp.sum((new - batch["old_logp"]) * batch["advantages"] * batch["loss_mask"])
    assert float(delta) > 0


# dp2,tp2,sp2 (every axis sharded) in the default run; dp8 with the slow tests (the default run
# still runs the dp8 model forward and gradient against one device, test_models.py
# test_mesh_invariance[dp8], and the whole dp8 step in test_launch.py test_smoke_dp8's run).
@pytest.mark.parametrize("spec,micro", [("dp2,tp2,sp2", 4), pytest.param("dp8", 8, marks=pytest.mark.slow)])
def test_mesh_gives_the_same_update(model, devices, spec, micro):
    graphdef, params = model
    batch = _batch(4, 8, graphdef, params)
    ref, mref = _run(graphdef, params, batch, ppo_micro_batch_size=micro)
    mesh = make_mesh(spec)
    shardings = F.param_shardings(CFG, mesh)
    sharded_params = jax.device_put(params, shardings)
    out, mout = _run(graphdef, sharded_params, batch, mesh=mesh, ppo_micro_batch_size=micro)
    chex.assert_trees_all_close(out.params, ref.params, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mout["loss"], mref["loss"], rtol=1e-4, atol=1e-6)


def test_on_policy_step_equals_a_separate_old_log_prob_pass(model):
    """One epoch over one mini-batch: detached current log-probs give the update (and the
    metrics) of a step whose old_logp came from a separate pass with the same parameters."""
    graphdef, params = model
    batch = _batch(5, 8, graphdef, params)
    batch["old_logp"] = make_logprob_fn(graphdef, response_len=T, temperature=1.0, impl="chunked")(params, batch)[0]
    ref, mref = _run(graphdef, params, batch, ppo_micro_batch_size=4)  # SGD: see _run
    no_old = {k: v for k, v in batch.items() if k != "old_logp"}
    out, mout = _run(graphdef, params, no_old, ppo_micro_batch_size=4, on_policy=True)
    chex.assert_trees_all_close(out.params, ref.params, rtol=1e-5, atol=1e-6)
    for k in ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm"):
        np.testing.assert_allclose(mout[k], mref[k], rtol=1e-4, atol=1e-6, err_msg=k)
    # the update hands back the old_logp it used, in the batch's row order (the shuffle undone)
    assert "old_logp" not in mref and mout["old_logp"].shape == batch["old_logp"].shape
    np.testing.assert_allclose(mout["old_logp"], batch["old_logp"], rtol=1e-5, atol=1e-5)


def test_on_policy_rejects_more_than_one_update(model):
    graphdef, params = model
    batch = _batch(6, 8, graphdef, params)
    with pytest.raises(ValueError, match="one epoch over one mini-batch"):
        _run(graphdef, params, batch, ppo_mini_batch_size=4, ppo_micro_batch_size=4, on_policy=True)
    with pytest.raises(ValueError, match="one epoch over one mini-batch"):
        _run(graphdef, params, batch, ppo_epochs=2, on_policy=True)
