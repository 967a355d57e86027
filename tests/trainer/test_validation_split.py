"""The held-out split is read, filtered and its lengths measured once a run, not at every
evaluation (issue 25: each evaluation every ``trainer.test_freq`` steps loaded the split and ran
the whole filter pass again). A prompt is still tokenized when its batch is read: the prepared
split holds positions only, so a split larger than memory iterates in constant memory."""

import jax


def test_each_evaluation_reuses_the_split_tokenized_at_the_first(tmp_path):
    from rljax.config import resolve
    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    cfg, _ = resolve("default", ["data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                                 "data.embedded.num_train=16", "data.embedded.num_test=6", "data.val_batch_size=4",
                                 "trainer.total_steps=1", "trace.ledgers=false"])
    trainer = Trainer(cfg, make_mesh("dp1", jax.devices()[:1]), str(tmp_path), echo=lambda *a: None)
    rollout = trainer.services.rollout
    tokenizer = rollout.tokenizer
    calls = []
    encode = tokenizer.encode
    tokenizer.encode = lambda *a, **k: calls.append(a) or encode(*a, **k)  # counts the run's tokenizations

    def one_pass():
        return [[(p.prompt, tuple(p.ids)) for p in batch] for batch in rollout.val_prompts()]

    first = one_pass()
    assert [len(b) for b in first] == [4, 2] and len(calls) == 12  # the filter pass, then each batch's reads
    assert one_pass() == first and len(calls) == 12 + 6  # the second evaluation reads the 6 prompts, no filter pass
