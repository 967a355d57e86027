"""Every schema key does something: it is read by the code that runs.

How the check works, and why it cannot be satisfied by accident: inside
``record_reads()`` (tests/config_reads.py) the configs that ``resolve`` builds are recording subclasses
of the schema's dataclasses; a field read counts only when the reading frame's code lives
in ``rljax/`` outside ``rljax/config`` and ``rljax/trainer/_check.py`` (validation, the
trainer's input checks and serialisation read every key and do nothing with it) and outside
``rljax/trace`` (observers, which count only for ``trace.*``). The slow test runs the launcher in this process on two small real runs
that together take every branch that reads a key (GRPO and GAE, the embedded task and local
GSM8K files, KL in the reward and as a loss, rollout correction, validation, checkpoints),
and fails on any key that nothing read. A grep for ``.<leaf>`` would be fooled by a leaf
name shared between sections (``data.shuffle`` / ``actor.shuffle``) or by dead code; this
records what ran.
"""

import json

import pytest

from config_reads import record_reads
from rljax.config import field_specs, resolve, validate_for_mesh

#: Keys the stage work of issue 10 wires into the step loop (rljax/trainer/loop.py); remove
#: a key from here when the loop reads it (the test fails while a listed key is read).
PENDING: set = set()


def _call_from(filename: str, fn, *args):
    """Calls ``fn(*args)`` from a frame whose code is attributed to ``filename``."""
    return eval(compile("fn(*args)", filename, "eval"), {"fn": fn, "args": args})


def _defined_in(filename: str, fn):
    """A function attributed to ``filename`` that calls ``fn`` (no test frame between)."""
    ns = {"fn": fn}
    exec(compile("def wrapper(*args):\n    return fn(*args)\n", filename, "exec"), ns)
    return ns["wrapper"]


def test_record_reads_counts_rljax_code_only():
    from rljax.data import data_seed

    with record_reads() as reads:
        cfg, _ = resolve("default")  # validation reads many keys: they do not count
        assert reads == set()
        assert cfg.rollout.n == 16 and reads == set()  # nor do reads from outside rljax/
        data_seed(cfg)  # rljax/data reads data.seed, then trainer.seed (data.seed is null in the preset)
    assert reads == {"data.seed", "trainer.seed"}
    import rljax.config._validate as validation
    import rljax.trainer.loop as trainer
    from rljax.config import derive

    with record_reads() as reads:
        cfg, _ = resolve("default")
        validate_for_mesh(cfg, {"dp": 8})
        derive(cfg)  # called from a test: not rljax code
        # rljax/config code (validation) calling the consumer helper from the run's code: no
        _call_from(trainer.__file__, _defined_in(validation.__file__, derive), cfg)
        assert reads == set()
        _call_from(trainer.__file__, derive, cfg)  # the run's code calling it: yes
    assert {"actor.ppo_mini_batch_size", "actor.ppo_micro_batch_size", "data.train_batch_size"} <= reads
    cfg, _ = resolve("default")  # outside the block: plain dataclasses again
    assert type(cfg.rollout) is type(resolve()[0].rollout) and cfg == resolve("default")[0]


def _gsm8k_dir(root):
    root.mkdir()
    for split, n in (("train", 8), ("test", 4)):
        with open(root / f"{split}.jsonl", "w") as fh:
            for i in range(n):
                fh.write(json.dumps({"question": f"{i}+1=", "answer": f"#### {i + 1}"}) + "\n")
    return root


@pytest.mark.slow
def test_every_schema_key_is_read_by_a_real_run(tmp_path, monkeypatch):
    from rljax.launch import main

    monkeypatch.chdir(tmp_path)  # the first run goes to the default runs/<project_name>/<experiment_name>

    small = ["data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.val_batch_size=8"]
    grpo = ["trainer.project_name=p", "trainer.experiment_name=grpo", *small, "data.embedded.num_train=16", "data.embedded.num_test=8",
            "trainer.total_steps=2", "trainer.test_freq=1", "trainer.save_freq=1", "trainer.val_before_train=true",
            "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "actor.use_kl_loss=true",
            "rollout.correction=token", "rollout.max_slots=8"]
    gae = ["--run-dir", str(tmp_path / "gae"), *small, "data.dataset=gsm8k", f"data.path={_gsm8k_dir(tmp_path / 'd')}",
           "data.prompt_template={prompt}", "data.max_prompt_length=8", "algorithm.adv_estimator=gae",
           "actor.lora.rank=4", "actor.lora.dropout=0.1",
           "trainer.total_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false"]
    # A multi-turn run (rljax.env) reads env.*.
    env = ["--config", "tool_lookup", "--run-dir", str(tmp_path / "env"), *small, "data.embedded.num_train=16",
           "data.embedded.num_test=8", "trainer.total_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false"]
    # An asynchronous, disaggregated run reads async_training.* and rollout.num_devices; a
    # model shape override goes through the trainer's apply_model_overrides.
    asy = ["--mesh=dp4", "--run-dir", str(tmp_path / "async"), *small, "data.embedded.num_train=16",
           "data.embedded.num_test=8", "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "trainer.mode=async", "rollout.placement=disaggregated", "rollout.num_devices=4",
           "async_training.max_staleness=1", "model.intermediate_size=48"]
    with record_reads() as reads:
        for args in (grpo, gae, env, asy):
            assert main(args) == 0, args
    assert (tmp_path / "runs" / "p" / "grpo" / "config.resolved.yaml").is_file()
    unread = set(field_specs()) - reads
    assert unread - PENDING == set(), f"schema keys nothing read: {sorted(unread - PENDING)}"
    assert PENDING & reads == set(), f"read now, remove from PENDING: {sorted(PENDING & reads)}"
