"""``actor.skip_old_log_prob`` on a real run (in process, dp2): one epoch over one mini-batch,
the update's own detached log-probs as ``old_logp`` (auto) give the step of a run with the
separate ``old_log_prob`` pass (false): same rollouts, losses, metrics and parameters; the
stage is gone from the stage list and the timings, and the trace says who produced
``old_logp`` and passes ``python -m rljax.trace check`` for that reason."""

import jax
import numpy as np
import pytest

# One mini-batch (4 prompts x 4), one epoch: exactly on-policy. Adam with eps=1 acts like SGD on
# these small gradients (plain Adam turns float noise in near-zero gradients into lr-sized steps).
ON_POLICY = ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=8",
             "data.embedded.num_train=32", "data.embedded.num_test=8", "trainer.test_freq=-1",
             "trainer.val_before_train=false", "actor.optim.warmup_steps=0", "actor.optim.lr=0.5",
             "actor.optim.eps=1.0", "trainer.total_steps=1"]
KEYS = ("actor/pg_loss", "actor/loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac",
        "critic/score/mean", "critic/advantages/mean", "response_length/mean")


def _one_step(tmp_path, mode):
    from rljax.config import resolve, write_resolved
    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    cfg, prov = resolve("default", [*ON_POLICY, f"actor.skip_old_log_prob={mode}"])
    run = tmp_path / mode
    run.mkdir()
    write_resolved(cfg, prov, run / "config.resolved.yaml")
    trainer = Trainer(cfg, make_mesh("dp2", jax.devices()[:2]), str(run), echo=lambda *a: None)
    start = jax.device_get(trainer.state.actor.params)
    metrics = trainer.train_one_step()
    trainer.tracer.close()
    return trainer, start, metrics, run


@pytest.mark.slow
def test_update_without_the_old_log_prob_pass_equals_the_run_with_it(tmp_path):
    import chex

    from rljax.trace.check import run_checks

    skip, start, m_skip, run_skip = _one_step(tmp_path, "auto")
    full, _, m_full, run_full = _one_step(tmp_path, "false")
    assert skip.services.learner.old_logp_in_update and not full.services.learner.old_logp_in_update
    assert "old_log_prob" not in skip.runner.names and "old_log_prob" in full.runner.names
    assert "timing_s/old_log_prob" not in m_skip and m_full["timing_s/old_log_prob"] > 0
    for k in KEYS:
        np.testing.assert_allclose(m_skip[k], m_full[k], rtol=1e-4, atol=1e-6, err_msg=k)
    # On-policy the loss VALUE is minus the token-weighted mean advantage: 0 when every response has the same
    # length (a group's advantages sum to 0), as at this seed. Its gradient is not: scores differ within the
    # batch, the gradient norm is > 0 and the parameters move (below).
    assert m_full["critic/score/max"] > m_full["critic/score/min"] and m_full["actor/grad_norm"] > 0
    p_skip, p_full = jax.device_get(skip.state.actor.params), jax.device_get(full.state.actor.params)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(p_full), jax.tree.leaves(start)))
    assert moved > 1e-4, moved  # the update changed the parameters ...
    chex.assert_trees_all_close(p_skip, p_full, rtol=1e-4, atol=1e-6)  # ... the same way in both runs

    behaviour = "behaviour log-prob from the right producer (bypass_mode)"
    checks = {name: (status, detail) for status, name, detail in run_checks(str(run_skip))}
    for name in (behaviour, "prompt group uid/sessions/keys consistent across every stage",
                 "reward / old,ref log-prob / advantage producers and consumers", "nothing left in the buffer after cleanup"):
        assert checks[name][0] == "PASS", (name, checks[name])
    assert "own log-probs, detached" in checks[behaviour][1]
    import json

    row = next(r for r in json.loads((run_skip / "shape_ledger.json").read_text()) if r["tensor"] == "old_logp")
    assert row["stage"] == row["produced_at"] == "actor_minibatch", row
    # the memory ledger compiles no log-prob pass the run does not have
    assert set(json.loads((run_skip / "memory_ledger.json").read_text())["stages"]) == {"update_actor", "gen"}
    assert "old_log_prob" in json.loads((run_full / "memory_ledger.json").read_text())["stages"]
    checks = {name: (status, detail) for status, name, detail in run_checks(str(run_full))}
    assert checks[behaviour][0] == "PASS" and "old_log_prob stage" in checks[behaviour][1], checks[behaviour]
