"""Each policy loss and rollout correction trains through the real update: the run's
configuration (verl's keys) -> ``StepConfig`` (the loss and its options) -> two optimizer steps of
the tiny model over two micro-batches, finite, moving the parameters, with verl's metric names.
And the prepare stage's decoupled correction: the weights it hands the update."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from config_reads import record_reads
from rljax import loss as L
from rljax.config import POLICY_LOSS_KEYS, resolve
from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.trainer import init_state, make_logprob_fn, make_optimizer, make_train_step
from rljax.trainer.build import step_config_for
from rljax.trainer.prepare import PrepareConfig, make_prepare_fn

S, T, B = 6, 6, 8
CFG = get_config("tiny")
SIZES = types.SimpleNamespace(mini_batch_trajectories=B, micro_batch_trajectories=B // 2)
RC = "algorithm.rollout_correction"

#: (policy loss, extra overrides); the first runs by default, the others in the slow pass (pytest -m slow).
CASES = [
    ("sapo", ["actor.tau_pos=2.0", "actor.tau_neg=3.0"]),
    pytest.param("bypass_mode", ["algorithm.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=sequence",
                     f"{RC}.rollout_is_threshold=0.5_2.0", f"{RC}.rollout_rs=token_k1,seq_max_k3",
                     f"{RC}.rollout_rs_threshold=0.8_1.25,0.5"], marks=pytest.mark.slow),
    *[pytest.param(mode, extra, marks=pytest.mark.slow) for mode, extra in [
        ("dppo_tv", ["actor.clip_ratio_c=20.0"]), ("dppo_kl", []), ("gpg", []),
        ("clip_cov", ["actor.clip_cov_ratio=0.2", "actor.clip_cov_lb=-10.0"]),
        ("kl_cov", ["actor.kl_cov_ratio=0.2"]), ("geo_mean", []), ("dro", ["actor.dro_beta=0.5"]),
        ("vanilla", ["algorithm.bypass_mode=true", f"{RC}.rollout_rs=seq_mean_k1", f"{RC}.rollout_rs_threshold=0.9_1.1"]),
    ]],
]


@pytest.fixture(scope="module")
def model():
    return F.init_params(CFG, seed=0)


def _batch(graphdef, params, seed=0):
    rng = np.random.default_rng(seed)
    rlen = rng.integers(1, T + 1, B)
    resp = np.arange(T)[None, :] < rlen[:, None]
    attn = np.concatenate([np.ones((B, S), bool), resp], axis=1)
    ids = np.where(attn, rng.integers(3, CFG.vocab_size, (B, S + T)), 0).astype(np.int32)
    batch = {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(attn),
             "positions": F.default_positions(jnp.asarray(attn)), "loss_mask": jnp.asarray(resp, jnp.float32),
             "advantages": jnp.asarray(np.repeat(rng.normal(0, 1, (B, 1)), T, 1), jnp.float32)}
    logp, _ = make_logprob_fn(graphdef, response_len=T, temperature=1.0, impl="naive")(params, batch)
    batch["old_logp"] = logp + jnp.asarray(rng.normal(0, 0.05, (B, T)), jnp.float32)
    return batch


@pytest.mark.parametrize("mode,extra", CASES)
def test_the_loss_trains_from_its_config(model, mode, extra):
    with record_reads() as reads:  # the trainer's build reads this mode's keys, and no other mode's
        cfg, _ = resolve("default", [f"actor.policy_loss={mode}", "actor.ppo_epochs=2", *extra])
        step_cfg = step_config_for(cfg, SIZES, on_policy=False)
    expected = "bypass_mode" if cfg.algorithm.bypass_mode and cfg.algorithm.rollout_correction.rollout_rs else mode
    # (every run reads whether a rollout correction is on: rollout_is / rollout_rs)
    others = set().union(*POLICY_LOSS_KEYS.values()) - set(POLICY_LOSS_KEYS.get(expected, ())) - {
        f"{RC}.rollout_is", f"{RC}.rollout_rs"}
    assert set(POLICY_LOSS_KEYS.get(expected, ())) <= reads and not reads & others, (expected, sorted(reads))
    assert step_cfg.policy_loss == expected
    assert set(dict(step_cfg.policy_loss_options)) == set(L.policy_loss_options(expected))
    graphdef, params = model
    opt = make_optimizer(lr=1e-2, grad_clip=1.0)
    state = init_state(jax.tree.map(jnp.copy, params), opt)
    out, metrics = make_train_step(graphdef, opt, step_cfg)(state, _batch(graphdef, params), jax.random.key(0))
    assert int(out.step) == 2 and int(out.skipped) == 0
    for k in ("loss", "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "grad_norm"):
        assert np.isfinite(float(metrics[k])), k
    moved = max(float(jnp.abs(a - b).max()) for a, b in zip(jax.tree.leaves(out.params), jax.tree.leaves(params)))
    assert moved > 1e-4
    if expected == "bypass_mode":
        assert 0.0 <= float(metrics["rollout_corr/rollout_rs_masked_fraction"]) <= 1.0
        assert np.isfinite(float(metrics["rollout_corr/chi2_token"]))


def test_config_keys_are_the_losses_options():
    # each mode with keys of its own has a case above (tests/config/test_config_honest.py counts on it)
    assert set(POLICY_LOSS_KEYS) <= {(c.values if hasattr(c, "values") else c)[0] for c in CASES}
    for mode in L.registered_policy_losses():
        keys = {k.rsplit(".", 1)[1] for k in POLICY_LOSS_KEYS.get(mode, ())}
        assert keys == set(L.policy_loss_options(mode)), mode


def test_prepare_applies_the_decoupled_correction():
    # token IS truncated at 1.5 times a token_k2 rejection at 0.02: |log r| > 0.2 -> weight 0
    rng = np.random.default_rng(0)
    mask = (rng.uniform(size=(4, 5)) < 0.8).astype(np.float32)
    mask[:, 0] = 1
    old = np.log(rng.uniform(0.1, 0.9, (4, 5))).astype(np.float32)
    roll = (old + rng.normal(0, 0.3, (4, 5))).astype(np.float32)
    rc = dict(rollout_is="token", rollout_is_threshold="1.5", rollout_is_batch_normalize=False,
              rollout_rs="token_k2", rollout_rs_threshold="0.02", loss_type="ppo_clip")
    cfg = PrepareConfig(estimator="grpo", num_groups=2, rollout_correction=tuple(rc.items()))
    fields = {"scores": jnp.arange(4.0), "loss_mask": jnp.asarray(mask), "group_id": jnp.array([0, 0, 1, 1]),
              "row_mask": jnp.ones(4, bool), "old_logp": jnp.asarray(old), "rollout_logp": jnp.asarray(roll)}
    assert set(cfg.inputs(critic=False)) == set(fields)
    out = make_prepare_fn(cfg)(fields, jnp.float32(0.0))
    lr = old - roll
    want = np.minimum(np.exp(lr), 1.5) * (0.5 * lr ** 2 <= 0.02) * mask
    assert 0 < (want > 0).sum() < mask.sum()
    np.testing.assert_allclose(out["rollout_is_weights"], want, rtol=1e-5, atol=1e-7)
