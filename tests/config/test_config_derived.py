"""Derived sizes (rljax.config.derive): verl's prompt-counted batch keys to trajectories, and
the learner lengths rounded up to multiples of sp."""

from rljax.config import derive, resolve


def test_derived_sizes_from_the_config_and_sp():
    cfg, _ = resolve("default", ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                                 "actor.ppo_micro_batch_size=8", "actor.ppo_epochs=2", "trainer.total_steps=10",
                                 "data.max_prompt_length=7", "data.max_response_length=3"])
    s = derive(cfg, sp=2)
    assert (s.trajectories_per_step, s.mini_batch_trajectories, s.micro_batch_trajectories) == (32, 16, 8)
    assert (s.mini_batches_per_epoch, s.micro_batches_per_mini_batch, s.optimizer_updates) == (2, 2, 40)
    assert (s.learner_prompt_length, s.learner_response_length) == (8, 4)
    assert derive(cfg).learner_prompt_length == 7
    cfg, _ = resolve("default", ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4",
                                 "actor.ppo_micro_batch_size=null"])
    assert derive(cfg).micro_batch_trajectories == 16  # null: one micro-batch per mini-batch
