"""verl's rollout correction on a real run (in process, one step of the embedded task): the
decoupled weights and the bypass_mode loss train, verl's ``rollout_corr/*`` metrics reach the
step's metrics, and ``python -m rljax.trace check`` passes."""

import jax
import numpy as np
import pytest

RC = "algorithm.rollout_correction"
SMALL = ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.embedded.num_train=32",
         "data.embedded.num_test=8", "trainer.test_freq=-1", "trainer.val_before_train=false",
         "trainer.total_steps=1"]
CASES = {
    # decoupled Geo-RS + token IcePop (old_logp from the learner's pass)
    "decoupled": [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=0.5_2.0", f"{RC}.rollout_rs=seq_mean_k1",
                  f"{RC}.rollout_rs_threshold=0.999_1.001"],
    # bypass REINFORCE + sequence TIS + K3-RS (verl's bypass_pg_is with a rejection)
    "bypass": ["algorithm.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=sequence",
               f"{RC}.rollout_rs=seq_mean_k3", f"{RC}.rollout_rs_threshold=0.01"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_correction_trains_and_logs_verl_metrics(tmp_path, case):
    from rljax.config import resolve, write_resolved
    from rljax.sharding import make_mesh
    from rljax.trace.check import run_checks
    from rljax.trainer.loop import Trainer

    cfg, prov = resolve("default", [*SMALL, *CASES[case]])
    write_resolved(cfg, prov, tmp_path / "config.resolved.yaml")
    trainer = Trainer(cfg, make_mesh("dp1", jax.devices()[:1]), str(tmp_path), echo=lambda *a: None)
    metrics = trainer.train_one_step()
    trainer.tracer.close()
    assert np.isfinite(metrics["actor/pg_loss"]) and metrics["actor/grad_norm"] > 0
    for k in ("rollout_corr/rollout_rs_masked_fraction", "rollout_corr/rollout_is_mean", "rollout_corr/kl",
              "rollout_corr/chi2_token"):
        assert k in metrics and np.isfinite(metrics[k]), (k, sorted(m for m in metrics if m.startswith("rollout_corr")))
    if case == "decoupled":  # same weights, learner vs sampler: a ratio ~1 within float noise, nothing rejected
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0
        assert abs(metrics["rollout_corr/rollout_is_mean"] - 1.0) < 1e-4
    # (topology.json is the launcher's: a Trainer made in process writes none)
    failed = [(name, detail) for status, name, detail in run_checks(str(tmp_path))
              if status == "FAIL" and detail != "topology.json missing"]
    assert not failed, failed
