"""Property tests (hypothesis) for rljax.loss: invariances every RL user relies on."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rljax import loss as L

SETTINGS = settings(max_examples=25, deadline=None)


def _jitted(fn):
    """``fn`` under ``jax.jit``, its non-array keywords static: one compile per shape and option,
    where eager calls re-trace (``lax.scan`` in GAE, chex's value checks) on every example.
    ``JitMatchesEagerTest`` below checks jit against eager for every function."""
    cache = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
        arrays = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
        static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
        key = (static, tuple(sorted(arrays)))
        if key not in cache:
            cache[key] = jax.jit(functools.partial(fn, **dict(static)))
        return cache[key](*args, **arrays)

    return call


class J:
    """The rljax.loss functions the property tests call, jitted."""

    grpo_advantages = staticmethod(_jitted(L.grpo_advantages))
    rloo_advantages = staticmethod(_jitted(L.rloo_advantages))
    reinforce_pp_baseline_advantages = staticmethod(_jitted(L.reinforce_pp_baseline_advantages))
    gae_advantages = staticmethod(_jitted(L.gae_advantages))
    kl_penalty = staticmethod(_jitted(L.kl_penalty))
B, T = 6, 5
seeds = st.integers(0, 2**31 - 1)


def _batch(seed, b=B, t=T):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, t + 1, size=b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    return dict(
        logp=jnp.asarray(rng.normal(-1.5, 0.5, (b, t)), jnp.float32),
        old_logp=jnp.asarray(rng.normal(-1.5, 0.5, (b, t)), jnp.float32),
        scores=jnp.asarray(rng.integers(0, 2, b), jnp.float32) + jnp.asarray(rng.normal(0, 0.1, b), jnp.float32),
        group_ids=jnp.asarray(rng.integers(0, 3, b), jnp.int32),
        mask=jnp.asarray(mask),
        values=jnp.asarray(rng.normal(0, 1, (b, t)), jnp.float32),
        rewards=jnp.asarray(rng.normal(0, 1, (b, t)), jnp.float32),
    )


def _with_padding_rows(x, n_pad, rng):
    """Append ``n_pad`` padding rows (mask all zero, garbage everywhere else)."""
    out = {}
    for k, v in x.items():
        if k == "mask":
            pad = np.zeros((n_pad,) + v.shape[1:], np.float32)
        elif k == "group_ids":
            pad = np.full((n_pad,), 2, np.int32)
        else:
            pad = rng.normal(0, 50, (n_pad,) + v.shape[1:]).astype(np.float32)
        out[k] = jnp.concatenate([v, jnp.asarray(pad, v.dtype)])
    return out


@SETTINGS
@given(seed=seeds, n_pad=st.integers(1, 3), mode=st.sampled_from(["vanilla", "gspo", "cispo"]),
       agg=st.sampled_from(sorted(L.AGGREGATION_MODES)))
def test_padding_rows_change_no_loss(seed, n_pad, mode, agg):
    x = _batch(seed)
    y = _with_padding_rows(x, n_pad, np.random.default_rng(seed + 1))
    adv = J.gae_advantages(x["rewards"], x["values"], x["mask"], gamma=1.0, lam=0.95)[0]
    adv_pad = jnp.concatenate([adv, jnp.full((n_pad, T), 7.0)])
    a, ma = L.policy_loss(x["logp"], x["old_logp"], adv, x["mask"], mode=mode, loss_agg_mode=agg)
    b, mb = L.policy_loss(y["logp"], y["old_logp"], adv_pad, y["mask"], mode=mode, loss_agg_mode=agg)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(ma, mb, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(seed=seeds, n_pad=st.integers(1, 3))
def test_padding_rows_change_no_advantage(seed, n_pad):
    x = _batch(seed)
    y = _with_padding_rows(x, n_pad, np.random.default_rng(seed + 1))
    row = jnp.sum(y["mask"], -1) > 0
    # Group estimators: padding rows excluded through the row mask / the token mask.
    a = J.grpo_advantages(x["scores"], x["group_ids"], num_groups=3, row_mask=jnp.sum(x["mask"], -1) > 0)
    b = J.grpo_advantages(y["scores"], y["group_ids"], num_groups=3, row_mask=row)
    np.testing.assert_allclose(a, b[:B], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(b[B:], 0.0)
    a = J.reinforce_pp_baseline_advantages(x["scores"], x["group_ids"], x["mask"], num_groups=3)
    b = J.reinforce_pp_baseline_advantages(y["scores"], y["group_ids"], y["mask"], num_groups=3)
    np.testing.assert_allclose(a, b[:B], rtol=1e-4, atol=1e-5)
    a, ra = J.gae_advantages(x["rewards"], x["values"], x["mask"], gamma=0.99, lam=0.95)
    b, rb = J.gae_advantages(y["rewards"], y["values"], y["mask"], gamma=0.99, lam=0.95)
    np.testing.assert_allclose(a * x["mask"], b[:B] * x["mask"], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ra, rb[:B], rtol=1e-5, atol=1e-6)


@SETTINGS
@given(seed=seeds, estimator=st.sampled_from(["grpo", "rloo", "drgrpo"]))
def test_permuting_the_batch_permutes_advantages(seed, estimator):
    x = _batch(seed)
    perm = np.random.default_rng(seed).permutation(B)
    fn = {
        "grpo": lambda s, g: J.grpo_advantages(s, g, num_groups=3),
        "drgrpo": lambda s, g: J.grpo_advantages(s, g, num_groups=3, scale_by_std=False),
        "rloo": lambda s, g: J.rloo_advantages(s, g, num_groups=3),
    }[estimator]
    a = fn(x["scores"], x["group_ids"])
    b = fn(x["scores"][perm], x["group_ids"][perm])
    # summation order follows the row order: reassociation moves O(1) advantages by a few ulps
    np.testing.assert_allclose(a[perm], b, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(seed=seeds, agg=st.sampled_from(sorted(L.AGGREGATION_MODES)), n_micro=st.sampled_from([2, 3, 6]))
def test_micro_batch_aggregation_with_global_counts_equals_full_batch(seed, agg, n_micro):
    x = _batch(seed)
    adv = x["scores"] - x["scores"].mean()
    num_tokens = jnp.sum(x["mask"])
    num_seqs = jnp.sum(jnp.sum(x["mask"], -1) > 0)
    full, _ = L.policy_loss(x["logp"], x["old_logp"], adv, x["mask"], loss_agg_mode=agg,
                            num_tokens=num_tokens, num_seqs=num_seqs)
    size = B // n_micro
    parts = [
        L.policy_loss(x["logp"][i:i + size], x["old_logp"][i:i + size], adv[i:i + size], x["mask"][i:i + size],
                      loss_agg_mode=agg, num_tokens=num_tokens, num_seqs=num_seqs)[0]
        for i in range(0, B, size)
    ]
    np.testing.assert_allclose(sum(parts), full, rtol=1e-5, atol=1e-6)
    # With default (local) counts the same batch in one piece agrees too.
    local, _ = L.policy_loss(x["logp"], x["old_logp"], adv, x["mask"], loss_agg_mode=agg)
    np.testing.assert_allclose(local, full, rtol=1e-5, atol=1e-6)


@SETTINGS
@given(seed=seeds, scale=st.sampled_from([30.0, 300.0, 3000.0]), mode=st.sampled_from(["vanilla", "gspo", "cispo"]),
       kind=st.sampled_from(["k1", "k2", "k3", "k3+", "abs"]))
def test_gradients_finite_for_extreme_log_ratios(seed, scale, mode, kind):
    rng = np.random.default_rng(seed)
    logp = jnp.asarray(rng.normal(0, scale, (B, T)) - scale, jnp.float32)
    old = jnp.asarray(rng.normal(0, scale, (B, T)) - scale, jnp.float32)
    mask = jnp.ones((B, T))
    adv = jnp.asarray(rng.normal(0, 1, B), jnp.float32)

    def total(lp):
        pg, _ = L.policy_loss(lp, old, adv, mask, mode=mode)
        return pg + jnp.mean(L.kl_penalty(lp, old, kind=kind))

    val, grad = jax.value_and_grad(total)(logp)
    assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(grad)))


class JitMatchesEagerTest(chex.TestCase):
    """Every public function gives the same numbers jitted and un-jitted."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_all_functions(self):
        x = _batch(3)

        def everything(logp, old, scores, gids, mask, values, rewards):
            adv, ret = L.gae_advantages(rewards, values, mask, gamma=0.99, lam=0.95)
            out = {
                "grpo": L.grpo_advantages(scores, gids, num_groups=3),
                "rloo": L.rloo_advantages(scores, gids, num_groups=3),
                "rpp": L.reinforce_pp_baseline_advantages(scores, gids, mask, num_groups=3),
                "gae": adv, "ret": ret,
                "tis": L.rollout_correction_weights(old, logp, mask),
                "kl": L.kl_penalty(logp, old, kind="k3"),
                "ent": L.entropy_from_logits(jnp.stack([logp, old], -1)),
                "vf": L.value_loss(values, values * 0.9, ret, mask)[0],
                "whiten": L.masked_whiten(values, mask),
            }
            for mode in ("vanilla", "gspo", "cispo"):
                out[mode] = L.policy_loss(logp, old, adv, mask, mode=mode)
            return out

        args = (x["logp"], x["old_logp"], x["scores"], x["group_ids"], x["mask"], x["values"], x["rewards"])
        chex.assert_trees_all_close(self.variant(everything)(*args), everything(*args), rtol=1e-5, atol=1e-6)


def test_vmap_over_a_leading_axis():
    xs = [_batch(s) for s in range(3)]
    stack = lambda k: jnp.stack([x[k] for x in xs])  # noqa: E731
    out = jax.jit(jax.vmap(lambda s, g: L.grpo_advantages(s, g, num_groups=3)))(stack("scores"), stack("group_ids"))
    for i, x in enumerate(xs):
        np.testing.assert_allclose(out[i], J.grpo_advantages(x["scores"], x["group_ids"], num_groups=3), rtol=1e-6)
    out = jax.jit(jax.vmap(lambda a, b, m: L.policy_loss(a, b, jnp.ones(B), m)[0]))(stack("logp"), stack("old_logp"),
                                                                           stack("mask"))
    for i, x in enumerate(xs):
        np.testing.assert_allclose(out[i], L.policy_loss(x["logp"], x["old_logp"], jnp.ones(B), x["mask"])[0],
                                   rtol=1e-6)


@pytest.mark.parametrize("explicit", [True, False])
def test_sharded_over_dp8_equals_single_device(devices, explicit):
    """Inputs sharded over an 8-device `dp` mesh give the same numbers as on one device."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    axis_type = AxisType.Explicit if explicit else AxisType.Auto
    mesh = jax.make_mesh((8,), ("dp",), axis_types=(axis_type,))
    x = _batch(11, b=16, t=8)
    x["group_ids"] = jnp.asarray(np.repeat(np.arange(4), 4), jnp.int32)

    def step(logp, old, scores, gids, mask, values, rewards):
        adv = L.grpo_advantages(scores, gids, num_groups=4)
        gae, ret = L.gae_advantages(rewards, values, mask, gamma=0.99, lam=0.95)
        pg, metrics = L.policy_loss(logp, old, adv, mask, is_weights=L.rollout_correction_weights(old, logp, mask))
        kl = L.aggregate(L.kl_penalty(logp, old, kind="low_var_kl"), mask, mode="token-mean")
        vf, _ = L.value_loss(values, values * 0.5, ret, mask)
        grad = jax.grad(lambda lp: L.policy_loss(lp, old, gae, mask)[0])(logp)
        return dict(adv=adv, gae=gae, pg=pg, kl=kl, vf=vf, grad=grad, **metrics)

    args = (x["logp"], x["old_logp"], x["scores"], x["group_ids"], x["mask"], x["values"], x["rewards"])
    single = jax.jit(step)(*args)
    sharded_args = [jax.device_put(a, NamedSharding(mesh, P("dp"))) for a in args]
    with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else jax.set_mesh(mesh):
        sharded = jax.jit(step)(*sharded_args)
    assert sharded_args[0].sharding.num_devices == 8
    chex.assert_trees_all_close(sharded, single, rtol=1e-6, atol=1e-6)
