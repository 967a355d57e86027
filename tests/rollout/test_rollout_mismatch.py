"""Rollout/learner mismatch metrics (verl's ``training/rollout_probs_diff_*`` and
``training/rollout_actor_probs_pearson_corr``): the pure reduction against torch on the
formulas of verl's ``calculate_debug_metrics``, and a real one-step run whose sampler and
learner hold the same float32 weights (a float-rounding residual only) or whose sampler
weights were perturbed on purpose (large, and the ``rollout_mismatch`` alert fires)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax import loss as rl


def _verl(old_logp, rollout_logp, mask):
    """verl/utils/debug/metrics.py's statistics, in torch (the reference)."""
    torch = pytest.importorskip("torch")
    old, roll, m = torch.tensor(old_logp), torch.tensor(rollout_logp), torch.tensor(mask).bool()
    p_old, p_roll = torch.exp(old), torch.exp(roll)
    probs = torch.masked_select(torch.abs(p_old - p_roll), m)
    logprobs = torch.masked_select(torch.abs(old - roll), m)
    corr = torch.corrcoef(torch.stack([torch.masked_select(p_old, m), torch.masked_select(p_roll, m)]))[0, 1]
    return {"probs_diff_max": probs.max().item(), "probs_diff_mean": probs.mean().item(),
            "probs_diff_std": probs.std().item(), "logprobs_diff_max": logprobs.max().item(),
            "logprobs_diff_mean": logprobs.mean().item(), "logprobs_diff_std": logprobs.std().item(),
            "pearson_corr": corr.item(), "tokens": float(m.sum())}


@pytest.mark.parametrize("jit", [False, True])
def test_mismatch_statistics_equal_verls(jit):
    rng = np.random.default_rng(0)
    old = np.log(rng.uniform(0.01, 1.0, (4, 7))).astype(np.float32)
    roll = (old + rng.normal(0, 0.3, old.shape)).clip(max=0).astype(np.float32)
    mask = rng.uniform(size=old.shape) < 0.6
    mask[0] = False  # a row with no response token
    roll[~mask] = 5.0  # values outside the mask (padding, observations) must not count
    fn = jax.jit(rl.rollout_mismatch) if jit else rl.rollout_mismatch
    got = {k: float(v) for k, v in fn(jnp.asarray(old), jnp.asarray(roll), jnp.asarray(mask)).items()}
    want = _verl(old, roll, mask)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=2e-5, atol=1e-7, err_msg=k)


def test_mismatch_of_identical_log_probs_is_zero_and_of_no_tokens_is_zero():
    old = jnp.log(jnp.linspace(0.1, 0.9, 12).reshape(3, 4))
    same = rl.rollout_mismatch(old, old, jnp.ones((3, 4), bool))
    assert all(float(same[k]) == 0.0 for k in same if "diff" in k)
    np.testing.assert_allclose(float(same["pearson_corr"]), 1.0, rtol=1e-6)
    empty = rl.rollout_mismatch(old, old + 1.0, jnp.zeros((3, 4), bool))
    assert float(empty["tokens"]) == 0 and float(empty["probs_diff_max"]) == 0 and float(empty["probs_diff_std"]) == 0


def test_mismatch_alert_threshold():
    from rljax.trace import alerts as A

    assert A.mismatch_alert({"training/rollout_probs_diff_max": 0.1}, 0.5) is None
    assert A.mismatch_alert({}, 0.5) is None
    name, msg = A.mismatch_alert({"training/rollout_probs_diff_max": 0.7, "training/rollout_probs_diff_mean": 0.01}, 0.5)
    assert name == "rollout_mismatch" and "0.7 " in msg and A.SEVERITY[name] == "warning"
    assert A.mismatch_alert({"training/rollout_probs_diff_max": float("nan")}, 0.5) is not None


ONE_STEP = ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.embedded.num_train=32",
            "data.embedded.num_test=8", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "trainer.total_steps=1", "trace.ledgers=false"]
KEYS = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std",
        "training/rollout_logprobs_diff_max", "training/rollout_actor_probs_pearson_corr")


def _one_step(tmp_path, name, *overrides, perturb=0.0):
    from rljax.config import resolve, write_resolved
    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    cfg, prov = resolve("default", [*ONE_STEP, *overrides])
    run = tmp_path / name
    run.mkdir()
    write_resolved(cfg, prov, run / "config.resolved.yaml")
    trainer = Trainer(cfg, make_mesh("dp2", jax.devices()[:2]), str(run), echo=lambda *a: None)
    if perturb:  # the sampler gets other weights than the learner (a sync that went wrong), at a new version
        params, r = trainer.state.actor.params, trainer.services.rollout
        keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
        noisy = jax.tree.map(lambda p: p + perturb * jax.random.normal(next(keys), p.shape, p.dtype), params)
        trainer.state = trainer.state.replace(version=trainer.state.version + 1)
        r.sampler.update_weights(r.to_sampler(noisy), trainer.state.version)
    metrics = trainer.train_one_step()
    trainer.tracer.close()
    return trainer, metrics, run


@pytest.mark.slow
def test_run_mismatch_is_float_rounding_with_the_same_weights_and_large_when_perturbed(tmp_path):
    same, m_same, _ = _one_step(tmp_path, "same", "actor.skip_old_log_prob=false")
    assert "old_log_prob" in same.runner.names
    assert m_same["training/rollout_probs_diff_valid"] == 1
    # Same float32 weights and tokens: only the reduction order differs (KV-cache decode vs. the
    # learner's full forward and fused log-prob kernel).
    assert 0.0 <= m_same["training/rollout_probs_diff_max"] < 1e-5, m_same
    assert m_same["training/rollout_actor_probs_pearson_corr"] > 1 - 1e-6
    assert "alerts/rollout_mismatch" not in m_same

    # Perturbed sampler weights; old_logp out of the update itself (actor.skip_old_log_prob=auto, on-policy).
    off, m_off, run = _one_step(tmp_path, "perturbed", "trace.alert_rollout_probs_diff_max=0.05", perturb=0.5)
    assert off.services.learner.old_logp_in_update and "old_log_prob" not in off.runner.names
    assert m_off["training/rollout_probs_diff_max"] > 0.05, m_off
    assert m_off["training/rollout_logprobs_diff_mean"] > 100 * m_same["training/rollout_logprobs_diff_mean"]
    assert m_off["alerts/rollout_mismatch"] == 1
    summary = json.loads((run / "trace_summary.json").read_text())
    assert "rollout_mismatch" in json.dumps(summary.get("alerts", summary))


@pytest.mark.slow
def test_bypass_mode_has_no_mismatch_metrics(tmp_path):
    _, m, _ = _one_step(tmp_path, "bypass", "algorithm.bypass_mode=true", "actor.skip_old_log_prob=false")
    assert not any(k.startswith("training/rollout_") for k in m)
