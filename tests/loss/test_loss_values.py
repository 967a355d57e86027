"""Hand-computed values for every function of rljax.loss.

Each expected number below is worked out from the formula in the comment, not taken from
the implementation. Every case runs jitted and un-jitted (chex.variants).
"""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from rljax import loss as L

F32 = np.float32


def _whiten(x):
    """Reference whitening of a 1-D array of the masked entries (unbiased var, +1e-8)."""
    x = np.asarray(x, np.float64)
    return (x - x.mean()) / math.sqrt(x.var(ddof=1) + 1e-8)


class AdvantageTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_two_groups(self):
        # group 0: scores 1, 0 -> mean .5, unbiased std sqrt(.5); group 1: 1, 1 -> std 0.
        fn = self.variant(lambda s, g: L.grpo_advantages(s, g, num_groups=2))
        adv = fn(jnp.array([1.0, 0.0, 1.0, 1.0]), jnp.array([0, 0, 1, 1]))
        a = 0.5 / (math.sqrt(0.5) + 1e-6)
        np.testing.assert_allclose(adv, [a, -a, 0.0, 0.0], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_dr_grpo_does_not_scale(self):
        fn = self.variant(lambda s, g: L.grpo_advantages(s, g, num_groups=2, scale_by_std=False))
        adv = fn(jnp.array([1.0, 0.0, 3.0, 1.0]), jnp.array([0, 0, 1, 1]))
        np.testing.assert_allclose(adv, [0.5, -0.5, 1.0, -1.0], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_group_of_one_and_noncontiguous_ids(self):
        # ids 70, 70, 3, 9: groups {70: [1, 0]}, {3: [1]}, {9: [5]}; singletons: mean 0, std 1.
        fn = self.variant(lambda s, g: L.grpo_advantages(s, g, num_groups=3))
        adv = fn(jnp.array([1.0, 0.0, 1.0, 5.0]), jnp.array([70, 70, 3, 9]))
        a = 0.5 / (math.sqrt(0.5) + 1e-6)
        np.testing.assert_allclose(adv, [a, -a, 1.0 / (1 + 1e-6), 5.0 / (1 + 1e-6)], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_grpo_row_mask_excludes_padding(self):
        # The third row is padding: group 0 statistics come from 2 and 4 only.
        fn = self.variant(lambda s, g, m: L.grpo_advantages(s, g, num_groups=1, row_mask=m))
        adv = fn(jnp.array([2.0, 4.0, 100.0]), jnp.array([0, 0, 0]), jnp.array([True, True, False]))
        a = 1.0 / (math.sqrt(2.0) + 1e-6)
        np.testing.assert_allclose(adv, [-a, a, 0.0], rtol=1e-6)

    @chex.variants(with_jit=True, without_jit=True)
    def test_rloo(self):
        # one group 1, 2, 3: leave-one-out baselines 2.5, 2, 1.5 -> -1.5, 0, 1.5; singleton -> 0.
        fn = self.variant(lambda s, g: L.rloo_advantages(s, g, num_groups=2))
        adv = fn(jnp.array([1.0, 2.0, 3.0, 7.0]), jnp.array([4, 4, 4, 8]))
        np.testing.assert_allclose(adv, [-1.5, 0.0, 1.5, 0.0], rtol=1e-6, atol=1e-7)

    @chex.variants(with_jit=True, without_jit=True)
    def test_reinforce_pp_baseline(self):
        # group mean 2 -> [-1, 1], broadcast over mask [[1,1,0],[1,0,0]] -> masked values -1, -1, 1.
        mask = jnp.array([[1, 1, 0], [1, 0, 0]], jnp.float32)
        fn = self.variant(lambda s, g, m: L.reinforce_pp_baseline_advantages(s, g, m, num_groups=1))
        adv = fn(jnp.array([1.0, 3.0]), jnp.array([0, 0]), mask)
        w = _whiten([-1.0, -1.0, 1.0])
        np.testing.assert_allclose(adv, [[w[0], w[1], 0.0], [w[2], 0.0, 0.0]], rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gae_plain(self):
        # gamma .9, lam .8, rewards [0,0,1], values .5:
        # t2: delta .5, A .5 ; t1: delta -.05, A -.05+.72*.5=.31 ; t0: delta -.05, A -.05+.72*.31=.1732
        fn = self.variant(lambda r, v, m: L.gae_advantages(r, v, m, gamma=0.9, lam=0.8))
        adv, ret = fn(jnp.array([[0.0, 0.0, 1.0]]), jnp.full((1, 3), 0.5), jnp.ones((1, 3)))
        raw = [0.1732, 0.31, 0.5]
        np.testing.assert_allclose(ret, [[0.6732, 0.81, 1.0]], rtol=1e-5)
        np.testing.assert_allclose(adv, [_whiten(raw)], rtol=1e-4)

    @chex.variants(with_jit=True, without_jit=True)
    def test_gae_skips_tool_observation(self):
        # gamma .5, lam 1, values [.1,.2,.3,.4], reward 1 at the end, t1 is a tool result:
        # t3: A .6 ; t2: delta 0+.5*.4-.3=-.1, A -.1+.5*.6=.2 ; t1 carries (V .3, A .2) ;
        # t0: delta 0+.5*.3-.1=.05, A .05+.5*.2=.15. returns = A + V.
        fn = self.variant(lambda r, v, m: L.gae_advantages(r, v, m, gamma=0.5, lam=1.0))
        adv, ret = fn(jnp.array([[0.0, 0.0, 0.0, 1.0]]), jnp.array([[0.1, 0.2, 0.3, 0.4]]),
                      jnp.array([[1, 0, 1, 1]]))
        np.testing.assert_allclose(ret, [[0.25, 0.4, 0.5, 1.0]], rtol=1e-5)
        w = _whiten([0.15, 0.2, 0.6])  # statistics over the three action tokens
        np.testing.assert_allclose(np.asarray(adv)[0, [0, 2, 3]], w, rtol=1e-4)

    def test_estimator_registry(self):
        # Every registered estimator has the one trainer-facing signature; the outcome ones
        # read the score as the sum of the token-level rewards and broadcast over the mask.
        rewards = jnp.array([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.5, 0.0], [0.0, 0.0, 0.0]])
        mask = jnp.array([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
        group, row = jnp.array([0, 0, 1, 1]), jnp.array([True, True, True, False])
        kw = dict(group_id=group, num_groups=2, row_mask=row, values=None)
        adv, ret = L.get_adv_estimator("grpo")(rewards, mask, config={"norm_adv_by_std_in_grpo": False}, **kw)
        expect = L.grpo_advantages(jnp.array([1.0, 0.0, 0.5, 0.0]), group, num_groups=2, row_mask=row,
                                   scale_by_std=False)
        np.testing.assert_allclose(adv, expect[:, None] * mask, rtol=1e-6)
        np.testing.assert_allclose(ret, adv)
        assert {"grpo", "rloo", "reinforce_plus_plus_baseline", "gae"} <= set(L.registered_adv_estimators())
        with pytest.raises(ValueError, match="needs critic values"):
            L.get_adv_estimator("gae")(rewards, mask, config={}, **kw)
        with pytest.raises(ValueError, match="unknown advantage estimator 'nope'; registered: .*grpo"):
            L.get_adv_estimator("nope")

    def test_too_many_groups_is_a_clear_error(self):
        with pytest.raises(ValueError, match="3 distinct groups but num_groups=2"):
            L.grpo_advantages(jnp.zeros(3), jnp.array([0, 1, 2]), num_groups=2)


class MaskedTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_masked_stats(self):
        x = jnp.array([[1.0, 2.0, jnp.nan], [4.0, 100.0, 6.0]])
        m = jnp.array([[1, 1, 0], [1, 0, 1]], jnp.float32)
        # masked entries 1, 2, 4, 6: sum 13, mean 3.25, unbiased var (5.0625+1.5625+.5625+7.5625)/3
        s, mean, var = self.variant(lambda x, m: (L.masked_sum(x, m), L.masked_mean(x, m), L.masked_var(x, m)))(x, m)
        np.testing.assert_allclose(s, 13.0)
        np.testing.assert_allclose(mean, 13.0 / (4 + 1e-8), rtol=1e-6)
        np.testing.assert_allclose(var, 14.75 / 3, rtol=1e-5)
        w = self.variant(L.masked_whiten)(x, m)
        np.testing.assert_allclose(np.asarray(w)[[0, 0, 1, 1], [0, 1, 0, 2]], _whiten([1, 2, 4, 6]), rtol=1e-5)

    def test_masked_mean_along_axis(self):
        x = jnp.array([[1.0, 3.0], [5.0, 7.0]])
        m = jnp.array([[1, 1], [0, 1]])
        np.testing.assert_allclose(L.masked_mean(x, m, axis=-1), [2.0, 7.0], rtol=1e-6)


LOSS = jnp.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [9.0, 9.0, 9.0]])
MASK = jnp.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row is padding


class AggregateTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(
        ("token-mean", 7.0 / 3),  # (1 + 2 + 4) / 3 tokens
        ("token-sum", 7.0),
        ("seq-mean-token-sum", 3.5),  # (3 + 4) / 2 non-empty sequences
        ("seq-mean-token-mean", 2.75),  # (1.5 + 4) / 2
        ("seq-mean-token-sum-norm", 3.5 / 3),  # horizon T = 3
    )
    def test_modes(self, mode, expected):
        out = self.variant(lambda l, m: L.aggregate(l, m, mode=mode))(LOSS, MASK)
        np.testing.assert_allclose(out, expected, rtol=1e-6)

    def test_explicit_counts_and_horizon(self):
        np.testing.assert_allclose(L.aggregate(LOSS, MASK, mode="token-mean", num_tokens=7), 1.0)
        np.testing.assert_allclose(L.aggregate(LOSS, MASK, mode="seq-mean-token-sum", num_seqs=7), 1.0)
        np.testing.assert_allclose(L.aggregate(LOSS, MASK, mode="seq-mean-token-sum-norm", horizon=7.0), 0.5)

    def test_empty_batch_is_zero_not_nan(self):
        for mode in L.AGGREGATION_MODES:
            val, grad = jax.value_and_grad(lambda l: L.aggregate(l, jnp.zeros((2, 3)), mode=mode))(LOSS[:2])
            assert float(val) == 0.0 and np.all(np.asarray(grad) == 0.0), mode

    def test_unknown_mode(self):
        with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'; accepted: token-mean, token-sum"):
            L.aggregate(LOSS, MASK, mode="mean")


def _lp(ratios):
    """old_logp = 0, logp = log(ratio): the ratio is exactly the given number."""
    return jnp.log(jnp.array([ratios], jnp.float32)), jnp.zeros((1, len(ratios)), jnp.float32)


class PolicyLossTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_vanilla_dual_clip(self):
        # (A, r): (1, 1.5) -> max(-1.5, -1.2) = -1.2 [clipped]
        #         (-1, .5) -> max(.5, .8) = .8 [clipped], dual min(3, .8) = .8
        #         (-1, 4)  -> max(4, 1.2) = 4, dual min(3, 4) = 3 [lower clip]
        logp, old = _lp([1.5, 0.5, 4.0])
        adv = jnp.array([[1.0, -1.0, -1.0]])
        fn = self.variant(lambda lp: L.policy_loss(lp, old, adv, jnp.ones((1, 3))))
        loss, metrics = fn(logp)
        np.testing.assert_allclose(loss, (-1.2 + 0.8 + 3.0) / 3, rtol=1e-6)
        np.testing.assert_allclose(metrics["pg_clipfrac"], 2 / 3, rtol=1e-6)
        np.testing.assert_allclose(metrics["pg_clipfrac_lower"], 1 / 3, rtol=1e-6)
        np.testing.assert_allclose(metrics["ppo_kl"], -math.log(1.5 * 0.5 * 4.0) / 3, rtol=1e-5)

    def test_vanilla_gradient(self):
        # Unclipped (A=2, r=1.1): d(-A r)/dlogp = -A r = -2.2, averaged over 2 tokens.
        # Clipped (A=1, r=1.5): constant in logp, gradient 0.
        logp, old = _lp([1.1, 1.5])
        adv = jnp.array([[2.0, 1.0]])
        grad = jax.grad(lambda lp: L.policy_loss(lp, old, adv, jnp.ones((1, 2)))[0])(logp)
        np.testing.assert_allclose(grad, [[-2.2 / 2, 0.0]], rtol=1e-5)

    def test_dual_clip_disabled(self):
        logp, old = _lp([4.0])
        loss, metrics = L.policy_loss(logp, old, jnp.array([-1.0]), jnp.ones((1, 1)), clip_ratio_c=None)
        np.testing.assert_allclose(loss, 4.0, rtol=1e-6)
        assert float(metrics["pg_clipfrac_lower"]) == 0.0

    def test_advantages_per_sequence_broadcast(self):
        logp, old = _lp([1.1, 0.9])
        a, _ = L.policy_loss(logp, old, jnp.array([2.0]), jnp.ones((1, 2)))
        b, _ = L.policy_loss(logp, old, jnp.array([[2.0, 2.0]]), jnp.ones((1, 2)))
        np.testing.assert_allclose(a, b)
        np.testing.assert_allclose(a, -(2 * 1.1 + 2 * 0.9) / 2, rtol=1e-6)

    def test_is_weights_multiply_and_are_detached(self):
        logp, old = _lp([1.1])
        w = jnp.array([[0.5]])
        loss, _ = L.policy_loss(logp, old, jnp.array([1.0]), jnp.ones((1, 1)), is_weights=w)
        np.testing.assert_allclose(loss, -0.55, rtol=1e-6)
        gw = jax.grad(lambda w: L.policy_loss(logp, old, jnp.array([1.0]), jnp.ones((1, 1)), is_weights=w)[0])(w)
        assert float(gw[0, 0]) == 0.0

    @chex.variants(with_jit=True, without_jit=True)
    def test_gspo_sequence_ratio_and_forced_aggregation(self):
        # seq 0: token ratios 1.1, 1.3 -> s = sqrt(1.43) = 1.19583 (inside the clip), loss -s on both.
        # seq 1: one token, ratio 1.5 -> clipped to 1.2 -> -1.2. seq-mean-token-mean: (-s - 1.2) / 2,
        # even when token-mean is asked for (verl forces it).
        logp = jnp.log(jnp.array([[1.1, 1.3], [1.5, 1.0]]))
        old = jnp.zeros((2, 2))
        mask = jnp.array([[1, 1], [1, 0]])
        fn = self.variant(lambda lp: L.policy_loss(lp, old, jnp.array([1.0, 1.0]), mask, mode="gspo",
                                                   loss_agg_mode="token-mean"))
        loss, metrics = fn(logp)
        s = math.sqrt(1.1 * 1.3)
        np.testing.assert_allclose(loss, (-s - 1.2) / 2, rtol=1e-5)
        np.testing.assert_allclose(metrics["pg_clipfrac"], 1 / 3, rtol=1e-5)

    @chex.variants(with_jit=True, without_jit=True)
    def test_cispo(self):
        # logp -1, old -1 - log 2 -> ratio 2 -> sg(clip) = 1.2; loss = -1.2 * A * logp = 1.2 (A = 1).
        logp = jnp.array([[-1.0]])
        old = jnp.array([[-1.0 - math.log(2.0)]])
        fn = self.variant(lambda lp: L.policy_loss(lp, old, jnp.array([1.0]), jnp.ones((1, 1)), mode="cispo"))
        loss, metrics = fn(logp)
        np.testing.assert_allclose(loss, 1.2, rtol=1e-6)
        assert float(metrics["pg_clipfrac"]) == 1.0
        grad = jax.grad(lambda lp: L.policy_loss(lp, old, jnp.array([1.0]), jnp.ones((1, 1)), mode="cispo")[0])(logp)
        np.testing.assert_allclose(grad, [[-1.2]], rtol=1e-6)

    def test_register_policy_loss(self):
        @L.register_policy_loss("test_reinforce")
        def reinforce(logp, old_logp, advantages, mask, **kw):
            return L.aggregate(-advantages * logp, mask, mode=kw["loss_agg_mode"]), {}

        loss, _ = L.policy_loss(jnp.array([[-2.0]]), jnp.array([[-2.0]]), jnp.array([3.0]), jnp.ones((1, 1)),
                                mode="test_reinforce")
        np.testing.assert_allclose(loss, 6.0)
        assert L.get_policy_loss("test_reinforce") is reinforce

    def test_bad_arguments(self):
        lp = jnp.zeros((1, 2))
        with pytest.raises(ValueError, match="unknown policy loss mode 'ppo2'; registered: .*vanilla"):
            L.policy_loss(lp, lp, jnp.ones(1), jnp.ones((1, 2)), mode="ppo2")
        with pytest.raises(ValueError, match="clip_ratio_c must be > 1.0"):
            L.policy_loss(lp, lp, jnp.ones(1), jnp.ones((1, 2)), clip_ratio_c=1.0)
        with pytest.raises(ValueError, match="unknown loss_agg_mode"):
            L.policy_loss(lp, lp, jnp.ones(1), jnp.ones((1, 2)), loss_agg_mode="avg")
        with pytest.raises(AssertionError):
            L.policy_loss(lp, jnp.zeros((1, 3)), jnp.ones(1), jnp.ones((1, 2)))


class KLEntropyValueTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.parameters(
        # logp -1, ref -2: delta = 1
        ("k1", 1.0), ("kl", 1.0), ("abs", 1.0), ("k2", 0.5), ("mse", 0.5),
        ("k3", math.exp(-1.0) + 1.0 - 1.0), ("low_var_kl", math.exp(-1.0)),
        ("k1+", 1.0), ("k3+", math.exp(-1.0)),
    )
    def test_kl_values(self, kind, expected):
        out = self.variant(lambda a, b: L.kl_penalty(a, b, kind=kind))(jnp.array([-1.0]), jnp.array([-2.0]))
        np.testing.assert_allclose(out, [expected], rtol=1e-6)

    def test_straight_through_gradient_is_k2(self):
        # d/dlogp of 0.5 (logp - ref)^2 = logp - ref = 1; plain k3's gradient is 1 - e^{-1}.
        for kind, expected in [("k1+", 1.0), ("k3+", 1.0), ("k3", 1.0 - math.exp(-1.0)), ("k1", 1.0)]:
            g = jax.grad(lambda lp: L.kl_penalty(lp, jnp.array(-2.0), kind=kind))(jnp.array(-1.0))
            np.testing.assert_allclose(g, expected, rtol=1e-6, err_msg=kind)

    def test_k3_clamps(self):
        # delta = -100: log-ratio clamped at 20, value e^20 - 21 clamped at 10.
        np.testing.assert_allclose(L.kl_penalty(jnp.array([-101.0]), jnp.array([-1.0]), kind="k3"), [10.0])

    def test_unknown_kind(self):
        with pytest.raises(ValueError, match="unknown KL estimator 'k4'; accepted: k1, kl, abs"):
            L.kl_penalty(jnp.zeros(1), jnp.zeros(1), kind="k4")

    @chex.variants(with_jit=True, without_jit=True)
    def test_entropy(self):
        # probs (1/4, 3/4): H = -(1/4 log 1/4 + 3/4 log 3/4); a -inf logit changes nothing.
        h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
        out = self.variant(L.entropy_from_logits)(jnp.array([[0.0, math.log(3.0), -jnp.inf]]))
        np.testing.assert_allclose(out, [h], rtol=1e-6)

    def test_entropy_gradient_finite_with_masked_vocab(self):
        g = jax.grad(lambda z: L.entropy_from_logits(z).sum())(jnp.array([[0.0, 1.0, -jnp.inf]]))
        assert np.all(np.isfinite(g))

    @chex.variants(with_jit=True, without_jit=True)
    def test_value_loss(self):
        # row 0: v 1, v_old 0, R 2, c .5: (1-2)^2 = 1 vs (.5-2)^2 = 2.25 -> 2.25 (clipped)
        # row 1: v .2, v_old 0, R 0: .04 both -> .04. 0.5 * mean = .5725; clipfrac 1/2.
        fn = self.variant(lambda v: L.value_loss(v, jnp.zeros((2, 1)), jnp.array([[2.0], [0.0]]), jnp.ones((2, 1))))
        loss, metrics = fn(jnp.array([[1.0], [0.2]]))
        np.testing.assert_allclose(loss, 0.5725, rtol=1e-6)
        np.testing.assert_allclose(metrics["vf_clipfrac"], 0.5, rtol=1e-6)


class CorrectionAndStalenessTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_token_and_sequence_weights(self):
        old = jnp.array([[-1.0, -1.0, -9.0]])
        roll = jnp.array([[-1.5, -0.2, 0.0]])
        mask = jnp.array([[1, 1, 0]])
        tok = self.variant(lambda o, r: L.rollout_correction_weights(o, r, mask, threshold=1.5))(old, roll)
        np.testing.assert_allclose(tok, [[1.5, math.exp(-0.8), 0.0]], rtol=1e-6)  # exp(.5) truncated at 1.5
        seq = self.variant(lambda o, r: L.rollout_correction_weights(o, r, mask, level="sequence"))(old, roll)
        np.testing.assert_allclose(seq, [[math.exp(-0.3), math.exp(-0.3), 0.0]], rtol=1e-6)

    def test_weights_have_no_gradient(self):
        g = jax.grad(lambda o: L.rollout_correction_weights(o, jnp.zeros((1, 2)), jnp.ones((1, 2))).sum())(
            jnp.array([[0.1, -0.1]]))
        assert np.all(np.asarray(g) == 0.0)

    def test_two_ratio_decomposition(self):
        # update_ratio * backend_ratio == pi_current / pi_rollout
        rng = np.random.default_rng(0)
        cur, old, roll = (jnp.asarray(rng.normal(-2.0, 0.3, (3, 5)), jnp.float32) for _ in range(3))
        mask = jnp.ones((3, 5))
        backend = L.rollout_correction_weights(old, roll, mask, threshold=1e30)
        update = jnp.exp(cur - old)
        np.testing.assert_allclose(update * backend, jnp.exp(cur - roll), rtol=1e-5)

    def test_bad_correction_args(self):
        z = jnp.zeros((1, 2))
        with pytest.raises(ValueError, match="unknown rollout correction level 'batch'; accepted: token, sequence"):
            L.rollout_correction_weights(z, z, z, level="batch")
        with pytest.raises(ValueError, match="threshold must be > 0"):
            L.rollout_correction_weights(z, z, z, threshold=0.0)

    def test_policy_staleness(self):
        assert L.policy_staleness(12, 10) == 2
        assert L.policy_staleness(12, 12) == 0
        with pytest.raises(ValueError, match="sample cannot come from a future policy"):
            L.policy_staleness(12, 13)

    @chex.variants(with_jit=True, without_jit=True)
    def test_staleness_filter(self):
        fn = self.variant(lambda v: L.staleness_filter(v, current_version=12, max_staleness=2))
        rep = fn(jnp.array([12, 10, 9, 13, 11]))
        np.testing.assert_array_equal(rep.staleness, [0, 2, 3, -1, 1])
        np.testing.assert_array_equal(rep.keep, [True, True, False, False, True])
        np.testing.assert_array_equal(rep.future, [False, False, False, True, False])
        assert int(rep.num_dropped) == 1 and int(rep.num_future) == 1
        with pytest.raises(ValueError, match="sample cannot come from a future policy"):
            L.raise_on_future(rep)
        L.raise_on_future(fn(jnp.array([12, 11])))  # nothing from the future: no error


def test_roles_give_the_action_mask():
    roles = jnp.array([L.Role.PROMPT, L.Role.AGENT_CALL, L.Role.TOOL_RESULT, L.Role.AGENT_ANSWER, L.Role.PADDING])
    np.testing.assert_array_equal(L.action_mask(roles), [0, 1, 0, 1, 0])


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo"])
def test_tool_result_token_contributes_nothing(mode):
    """A tool-result token changes neither the policy loss nor its gradient, whatever its log-prob."""
    roles = jnp.array([[L.Role.PROMPT, L.Role.AGENT_CALL, L.Role.TOOL_RESULT, L.Role.AGENT_ANSWER, L.Role.PADDING]])
    mask = L.action_mask(roles)
    old = jnp.array([[-1.0, -1.05, -0.7, -0.9, -1.0]])  # ratios inside the clip range
    adv = jnp.array([0.8])

    def f(lp):
        return L.policy_loss(lp, old, adv, mask, mode=mode)[0]

    base = jnp.array([[-1.0, -1.0, -0.5, -1.1, -1.0]])
    wild = base.at[0, 2].set(-jnp.inf).at[0, 0].set(50.0).at[0, 4].set(jnp.nan)
    np.testing.assert_allclose(f(base), f(wild), rtol=1e-6)
    g = jax.grad(f)(wild)
    assert np.all(np.isfinite(g))
    np.testing.assert_array_equal(np.asarray(g)[0, [0, 2, 4]], 0.0)
    assert float(jnp.abs(g[0, 1])) > 0 and float(jnp.abs(g[0, 3])) > 0
