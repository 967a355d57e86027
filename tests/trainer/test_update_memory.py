"""What the synchronous step holds while the learner runs: the sampler's copy of the weights is
released once generation ends (``stages._release_after``) and installed again by the weight
sync; the decode KV cache and the other generation buffers are gone by then (a local of
``Sampler.generate``). Checked on a real one-step run (in process, dp1) with a step-runner
observer reading ``jax.live_arrays()`` after every stage."""

import jax
import pytest

ONE_STEP = ["data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.embedded.num_train=32",
            "data.embedded.num_test=8", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "trainer.total_steps=1", "trace.ledgers=false"]


class _Live:
    def __init__(self, sampler):
        self.sampler, self.rows = sampler, {}

    def step_start(self, step, t):
        pass

    def stage(self, ev):
        self.rows[ev.stage] = (self.sampler.params is None, sum(x.nbytes for x in jax.live_arrays()))

    def step_end(self, step, metrics):
        pass

    def cleanup(self, report):
        pass


@pytest.mark.slow
def test_the_update_runs_without_the_samplers_weights(tmp_path):
    from rljax.config import resolve
    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    cfg, _ = resolve("default", ONE_STEP)
    trainer = Trainer(cfg, make_mesh("dp1", jax.devices()[:1]), str(tmp_path), echo=lambda *a: None)
    sampler = trainer.services.rollout.sampler
    weights = sum(x.nbytes for x in jax.tree.leaves(sampler.params))
    obs = _Live(sampler)
    trainer.runner.observers.append(obs)
    before = sum(x.nbytes for x in jax.live_arrays())
    trainer.train_one_step()
    trainer.tracer.close()
    released = {stage: r[0] for stage, r in obs.rows.items()}
    assert released["rollout_sessions"] and released["actor_minibatch"], released
    assert not released["weight_sync"] and sampler.version == 1 and sampler.params is not None
    # after generation the live arrays are the learner's state and the step's batch (small here):
    # not the sampler's copy of the weights, no KV cache
    assert obs.rows["advantages"][1] < before - weights / 2, (obs.rows, before, weights)
