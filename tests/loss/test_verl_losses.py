"""verl's other policy losses (dppo_tv, dppo_kl, sapo, gpg, clip_cov, kl_cov, geo_mean, dro,
bypass_mode) equal verl's formulas (``verl_oracle``, written out in NumPy) on the same inputs,
for every aggregation mode, with the edge cases: every token masked, thresholds at the
boundary, a sequence of length one."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import verl_oracle as V
from rljax import loss as L

MODES = sorted(L.AGGREGATION_MODES)
B, T = 5, 7


def _batch(seed=0, scale=0.4):
    """Random log-probs; row 3 is a sequence of length one; every row has a valid token."""
    rng = np.random.default_rng(seed)
    old = np.log(rng.uniform(0.05, 0.95, (B, T)))
    lp = old + rng.normal(0, scale, (B, T))
    lp = np.minimum(lp, -1e-3)
    adv = rng.normal(0, 1, (B, T))
    adv[1] = 0.0  # A = 0 takes verl's "negative" branch where it matters
    mask = (rng.uniform(size=(B, T)) < 0.75).astype(np.float64)
    mask[:, 0] = 1.0
    mask[3] = 0.0
    mask[3, 2] = 1.0  # a sequence of length one
    return old, lp, adv, mask


def _rl(old, lp, adv, mask, mode, agg, **options):
    """rljax's loss, eager (small arrays: cheaper than a compile per case; test_jit_equals_eager jits each once)."""
    return L.policy_loss(*(jnp.asarray(x, jnp.float32) for x in (lp, old, adv, mask)), mode=mode, loss_agg_mode=agg,
                         **options)


def _close(rl, oracle, keys=None, rtol=2e-5, atol=2e-6):
    loss, metrics = rl
    want_loss, want = oracle[0], oracle[1]
    np.testing.assert_allclose(float(loss), want_loss, rtol=rtol, atol=atol)
    for k in keys if keys is not None else want:
        np.testing.assert_allclose(float(metrics[k]), want[k], rtol=rtol, atol=atol, err_msg=k)


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("name", ["dppo_tv", "dppo_kl"])
def test_dppo_equals_verl(name, agg):
    old, lp, adv, mask = _batch(1)
    oracle = getattr(V, name)
    _close(_rl(old, lp, adv, mask, name, agg, ), oracle(old, lp, adv, mask, agg))
    # verl recommends a large truncation (20) and asymmetric divergence thresholds
    got = L.policy_loss(*(jnp.asarray(x, jnp.float32) for x in (lp, old, adv, mask)), mode=name, loss_agg_mode=agg,
                        clip_ratio_low=0.05, clip_ratio_high=0.1, clip_ratio_c=1.2)
    _close(got, oracle(old, lp, adv, mask, agg, low=0.05, high=0.1, c=1.2))


def test_dppo_threshold_at_the_boundary_keeps_the_token():
    # p - p_old = 0 with both thresholds 0: kept (<= / >=); one ulp more probability: dropped for A > 0 only.
    old = np.log(np.full((1, 3), 0.5))
    adv = np.array([[1.0, -1.0, 0.0]])
    mask = np.ones((1, 3))
    _, m = _rl(old, old, adv, mask, "dppo_tv", "token-mean", clip_ratio_low=0.0, clip_ratio_high=0.0)
    assert float(m["pg_clipfrac"]) == 0.0
    up = old + 1e-3
    _, m = _rl(old, up, adv, mask, "dppo_tv", "token-mean", clip_ratio_low=0.0, clip_ratio_high=0.0)
    np.testing.assert_allclose(float(m["pg_clipfrac"]), 1 / 3, rtol=1e-6)
    _, want = V.dppo_tv(old, up, adv, mask, "token-mean", low=0.0, high=0.0)
    np.testing.assert_allclose(want["pg_clipfrac"], 1 / 3, rtol=1e-6)


def test_dppo_gradient_flows_through_log_prob_only():
    # L = -A sg(min(r, c)) logp v: dL/dlogp = -A min(r, c) v / N (token-mean); r = e^0.5 > c = 1.2
    old = np.log(np.array([[0.3, 0.3]]))
    lp = old + np.array([[0.5, 0.0]])
    adv = np.array([[-1.0, 2.0]])
    f = lambda x: L.policy_loss(x, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32), jnp.ones((1, 2)),  # noqa: E731
                                mode="dppo_tv", clip_ratio_c=1.2, clip_ratio_low=1.0, clip_ratio_high=1.0)[0]
    g = jax.grad(f)(jnp.asarray(lp, jnp.float32))
    np.testing.assert_allclose(g, [[1.2 / 2, -2.0 / 2]], rtol=1e-5)


#: (loss, rljax options, the oracle's names for them): verl's defaults first, then other values.
OPTION_CASES = [("sapo", {}, {}), ("sapo", dict(tau_pos=2.0, tau_neg=3.0), dict(tau_pos=2.0, tau_neg=3.0)),
                ("kl_cov", {}, {}), ("kl_cov", dict(kl_cov_ratio=0.2, ppo_kl_coef=1.0), dict(ratio_=0.2, coef=1.0))]


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("mode,options,oracle_options", OPTION_CASES)
def test_losses_with_options_equal_verl(mode, options, oracle_options, agg):
    # sapo aggregates seq-mean-token-mean whatever the mode (as verl); kl_cov follows the mode
    old, lp, adv, mask = _batch(5)
    _close(_rl(old, lp, adv, mask, mode, agg, **options), getattr(V, mode)(old, lp, adv, mask, agg, **oracle_options))


def test_sapo_gradient_is_the_gate_derivative():
    # d/dlogp of -(4/tau) sigmoid(tau (r - 1)) A = -4 A r sigmoid'(.) ; at r = 1: -4 A * 1/4 = -A (one token)
    g = jax.grad(lambda x: L.policy_loss(x, jnp.zeros((1, 1)), jnp.array([3.0]), jnp.ones((1, 1)), mode="sapo")[0])(
        jnp.zeros((1, 1)))
    np.testing.assert_allclose(g, [[-3.0]], rtol=1e-6)


@pytest.mark.parametrize("agg", MODES)
def test_gpg_and_dro_equal_verl(agg):
    old, lp, adv, mask = _batch(3)
    _close(_rl(old, lp, adv, mask, "gpg", agg), V.gpg(old, lp, adv, mask, agg))
    _close(_rl(old, lp, adv, mask, "dro", agg, dro_beta=0.5), V.dro(old, lp, adv, mask, agg, beta=0.5))


@pytest.mark.parametrize("agg", MODES)
def test_geo_mean_equals_verl_whatever_the_mode(agg):
    old, lp, adv, mask = _batch(4, scale=0.3)
    adv = np.broadcast_to(adv[:, :1], adv.shape).copy()  # GMPO: one advantage per sequence
    _close(_rl(old, lp, adv, mask, "geo_mean", agg), V.geo_mean(old, lp, adv, mask, agg))
    w = np.random.default_rng(0).uniform(0.5, 2.0, (B, T)) * mask
    got = L.policy_loss(*(jnp.asarray(x, jnp.float32) for x in (lp, old, adv, mask)), mode="geo_mean",
                        loss_agg_mode=agg, is_weights=jnp.asarray(w, jnp.float32), clip_ratio_low=0.1)
    _close(got, V.geo_mean(old, lp, adv, mask, agg, w=w, low=0.1))


def test_geo_mean_padding_row_is_not_a_sequence():
    # rljax averages over sequences with a valid token (verl's torch.mean would count the padding row)
    old, lp, adv, mask = _batch(4, scale=0.3)
    base, _ = _rl(old, lp, adv, mask, "geo_mean", "token-mean")
    pad = lambda x, v: np.concatenate([x, np.full((1, T), v)])  # noqa: E731
    padded, _ = _rl(pad(old, -3.0), pad(lp, -1.0), pad(adv, 5.0), pad(mask, 0.0), "geo_mean", "token-mean")
    np.testing.assert_allclose(padded, base, rtol=1e-6)


@pytest.mark.parametrize("agg", MODES)
def test_clip_cov_equals_verl_when_every_candidate_is_drawn(agg):
    old, lp, adv, mask = _batch(6, scale=0.05)
    adv = adv * 6.0  # covariances of a few units, inside (lb, ub) = (0.2, 5)
    want = V.clip_cov(old, lp, adv, mask, agg, ratio_=1.0, lb=0.2)
    assert len(want[2]) >= 2, "the batch must have candidates for the check to mean anything"
    _close(_rl(old, lp, adv, mask, "clip_cov", agg, clip_cov_ratio=1.0, clip_cov_lb=0.2), want[:2])


def test_clip_cov_draws_clip_num_of_the_candidates():
    old, lp, adv, mask = _batch(6, scale=0.05)
    adv = adv * 6.0
    _, _, idx, _ = V.clip_cov(old, lp, adv, mask, "token-mean", ratio_=1.0, lb=0.2)
    ratio = 2.5 / mask.sum()  # int(ratio * N) = 2 tokens
    _, m = _rl(old, lp, adv, mask, "clip_cov", "token-mean", clip_cov_ratio=ratio, clip_cov_lb=0.2)
    assert len(idx) > 2
    np.testing.assert_allclose(float(m["pg_clipfrac"]), 2 / mask.sum(), rtol=1e-5)
    # whichever two are drawn, the loss is verl's for that draw
    losses = {round(V.clip_cov(old, lp, adv, mask, "token-mean", ratio_=ratio, lb=0.2,
                               pick=lambda i, k, a=a, b=b: i[[a, b]])[0], 5)
              for a in range(len(idx)) for b in range(a + 1, len(idx))}
    got, _ = _rl(old, lp, adv, mask, "clip_cov", "token-mean", clip_cov_ratio=ratio, clip_cov_lb=0.2)
    assert round(float(got), 5) in losses


@pytest.mark.parametrize("agg", MODES)
@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_mode_equals_verl(loss_type, agg):
    roll, lp, adv, mask = _batch(7, scale=0.2)
    options = dict(loss_type=loss_type, rollout_is="token", rollout_is_threshold=1.5, rollout_rs="seq_mean_k3",
                   rollout_rs_threshold=0.01)
    got = _rl(roll, lp, adv, mask, "bypass_mode", agg, **options)
    w, _ = V.is_weights(lp - roll, mask, "token", 1.5)
    kept, rs = V.rejection(lp - roll, mask, ["seq_mean_k3"], {"seq_mean_k3": (None, 0.01)})
    assert 0 < kept.sum() < mask.sum(), "some sequences rejected, some kept"
    if loss_type == "ppo_clip":
        want = V.vanilla(roll, lp, adv, kept, agg)
    else:
        want = (V.agg_loss(-adv * lp * w, kept, agg), {"ppo_kl": V.masked_mean(roll - lp, kept)})
    _close(got, want)
    for k in ("rollout_rs_masked_fraction", "rollout_rs_seq_masked_fraction"):
        np.testing.assert_allclose(float(got[1][f"rollout_corr/{k}"]), rs[k], rtol=1e-5)


def test_bypass_mode_reinforce_gradient_uses_detached_weights():
    # w = min(pi/pi_roll, 2) = 2 at r = e: dL/dlogp = -A w (one token) and no gradient through w
    g = jax.grad(lambda x: L.policy_loss(x, jnp.full((1, 1), -2.0), jnp.array([1.0]), jnp.ones((1, 1)),
                                         mode="bypass_mode", loss_type="reinforce", rollout_is="token")[0])(
        jnp.full((1, 1), -1.0))
    np.testing.assert_allclose(g, [[-2.0]], rtol=1e-6)


NEW_LOSSES = ["dppo_tv", "dppo_kl", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro", "bypass_mode"]
#: token-mean by default, the other modes in the slow pass (the default budget)
MODES_DEFAULT_FIRST = [m if m == "token-mean" else pytest.param(m, marks=pytest.mark.slow) for m in MODES]


@pytest.mark.parametrize("mode", NEW_LOSSES)
@pytest.mark.parametrize("agg", MODES_DEFAULT_FIRST)
def test_every_token_masked_gives_zero_and_finite_gradients(mode, agg):
    options = {"dro_beta": 1.0} if mode == "dro" else {}
    old, lp, adv, _ = _batch(8)
    mask = jnp.zeros((B, T))
    f = lambda x: L.policy_loss(x, jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32), mask, mode=mode,  # noqa: E731
                                loss_agg_mode=agg, **options)
    (loss, metrics), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(lp, jnp.float32))
    assert float(loss) == 0.0
    assert np.all(np.asarray(g) == 0.0)
    chex.assert_tree_all_finite(metrics)


@pytest.mark.parametrize("mode", [m if m in ("clip_cov", "bypass_mode") else pytest.param(m, marks=pytest.mark.slow)
                                  for m in NEW_LOSSES])
def test_jit_equals_eager(mode):
    options = {"dro_beta": 1.0} if mode == "dro" else {"rollout_rs": "token_k2", "rollout_rs_threshold": 0.02,
                                                       "rollout_is": "sequence"} if mode == "bypass_mode" else {}
    old, lp, adv, mask = _batch(9)
    eager = _rl(old, lp, adv, mask, mode, "seq-mean-token-sum", **options)
    jitted = jax.jit(lambda *a: _rl(*a, mode, "seq-mean-token-sum", **options))(old, lp, adv, mask)
    chex.assert_trees_all_close(jitted, eager, rtol=1e-5, atol=1e-6)


def test_options_and_registry():
    assert set(L.registered_policy_losses()) >= {"vanilla", "gspo", "cispo", "dppo_tv", "dppo_kl", "sapo", "gpg",
                                                 "clip_cov", "kl_cov", "geo_mean", "dro", "bypass_mode"}
    assert L.policy_loss_options("sapo") == {"tau_pos": 1.0, "tau_neg": 1.05}  # verl's defaults
    assert L.policy_loss_options("clip_cov") == {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}
    assert L.policy_loss_options("kl_cov") == {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}
    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="policy loss 'vanilla' takes no option tau_pos; its options: none"):
        L.policy_loss(z, z, jnp.ones(1), jnp.ones((1, 2)), tau_pos=2.0)
    with pytest.raises(ValueError, match="'dro' needs dro_beta > 0"):
        L.policy_loss(z, z, jnp.ones(1), jnp.ones((1, 2)), mode="dro")
    with pytest.raises(ValueError, match="unknown bypass_mode loss_type 'pg'; accepted: ppo_clip, reinforce"):
        L.policy_loss(z, z, jnp.ones(1), jnp.ones((1, 2)), mode="bypass_mode", loss_type="pg")


def test_length_one_sequence_alone():
    # one token: dppo_tv with A > 0 and p - p_old = 0.1 > 0.05 drops it; sapo at r = 1 gives -A.
    old, lp = np.log([[0.4]]), np.log([[0.5]])
    _, m = _rl(old, lp, np.ones((1, 1)), np.ones((1, 1)), "dppo_tv", "token-mean", clip_ratio_high=0.05)
    assert float(m["pg_clipfrac"]) == 1.0
    loss, _ = _rl(old, old, np.full((1, 1), 2.0), np.ones((1, 1)), "sapo", "seq-mean-token-sum")
    np.testing.assert_allclose(float(loss), -2.0 * 4 / 1.0 * 0.5, rtol=1e-6)
    assert math.isfinite(float(loss))
