"""Every schema key does something: it is read by the code that runs.

How the check works, and why it cannot be satisfied by accident: inside
``record_reads()`` (tests/config_reads.py) the configs that ``resolve`` builds are recording subclasses
of the schema's dataclasses; a field read counts only when the reading frame's code lives
in ``rljax/`` outside ``rljax/config`` and ``rljax/trainer/_check.py`` (validation, the
trainer's input checks and serialisation read every key and do nothing with it) and outside
``rljax/trace`` (observers, which count only for ``trace.*``, except the experiment loggers'
set-up, which starts the loggers ``trainer.logger`` names). The slow test runs the launcher in
this process on four small real runs that together take every branch that reads a key (GRPO
with DAPO dynamic sampling and overlong shaping, GAE with a reward model and a generative judge, a multi-turn run
with the python tool's sandbox, an asynchronous run on local conversation files scored by a
reward plugin in workers; KL in the reward and as a loss, rollout correction, validation,
checkpoints), and fails on any key that nothing read. A grep for ``.<leaf>`` would be fooled by a leaf
name shared between sections (``data.shuffle`` / ``actor.shuffle``) or by dead code; this
records what ran.
"""

import json

import pytest

from config_reads import record_reads
from hf_tiny import tiny_reward_model, tokenizer_dir
from rljax.config import POLICY_LOSS_KEYS, field_specs, resolve, validate_for_mesh
from rljax.trainer.loss_config import DECOUPLED_KEYS

#: Keys only a run in their own policy loss mode reads (``rljax.config.POLICY_LOSS_KEYS``: ``sapo``'s
#: ``tau_pos`` / ``tau_neg``, ``clip_cov``'s, ``kl_cov``'s, ``dro``'s). The trainer's build reads them
#: (rljax/trainer/loss_config.py) and tests/loss/test_losses_train.py checks, mode by mode, that
#: a run in that mode reads its own keys and no other mode's, then trains with them; the four runs
#: here stay on the default loss; the gae run's decoupled rollout correction reads the correction keys
#: that ``bypass_mode`` shares, all but ``loss_type`` (bypass mode's only).
PER_MODE: set = set().union(*POLICY_LOSS_KEYS.values()) - {f"algorithm.rollout_correction.{k}" for k in DECOUPLED_KEYS}


def _call_from(filename: str, fn, *args):
    """Calls ``fn(*args)`` from a frame whose code is attributed to ``filename``."""
    return eval(compile("fn(*args)", filename, "eval"), {"fn": fn, "args": args})


def _defined_in(filename: str, fn):
    """A function attributed to ``filename`` that calls ``fn`` (no test frame between)."""
    ns = {"fn": fn}
    exec(compile("def wrapper(*args):\n    return fn(*args)\n", filename, "exec"), ns)
    return ns["wrapper"]


def test_record_reads_counts_rljax_code_only(tmp_path):
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
    import rljax.trace.tracer as tracer
    from rljax.trace.loggers import open_run_logs

    with record_reads() as reads:
        cfg, _ = resolve("default")
        # an observer reading a key to record it: no (only trace.* counts there)
        assert eval(compile("cfg.trainer.logger, cfg.trace.groups", tracer.__file__, "eval"), {"cfg": cfg})
        assert reads == {"trace.groups"}
        metrics, _ = open_run_logs(cfg, str(tmp_path), enabled=False)  # the loggers' set-up acting on trainer.logger: yes
        metrics.close()
    assert "trainer.logger" in reads
    cfg, _ = resolve("default")  # outside the block: plain dataclasses again
    assert type(cfg.rollout) is type(resolve()[0].rollout) and cfg == resolve("default")[0]


def _gsm8k_dir(root):
    root.mkdir()
    for split, n in (("train", 8), ("test", 4)):
        with open(root / f"{split}.jsonl", "w") as fh:
            for i in range(n):
                fh.write(json.dumps({"question": f"{i}+1=", "answer": f"#### {i + 1}"}) + "\n")
    return root


def _conversations(path, n):
    """A jsonl file of TRL-style conversations (data.messages_key): the answer is the last assistant turn."""
    with open(path, "w") as fh:
        for i in range(n):
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"{i}+1="},
                                              {"role": "assistant", "content": str(i + 1)}]}) + "\n")
    return path


#: A reward plugin (reward.function=path:function) the async run scores through reward workers.
PLUGIN = """def reward(response, answer, **extra):
    return float(response.strip() == answer) + 0.1 * float(answer in response)


def brevity(response, answer, **extra):
    return -0.01 * len(response)
"""


def _judge_parse(path):
    """A judge parser that scores every verdict (its length): a random judge's text rarely holds a number."""
    path.write_text("def length(text):\n    return float(len(text))\n")
    return path


@pytest.mark.slow
def test_every_schema_key_is_read_by_a_real_run(tmp_path, monkeypatch):
    from tokenizers import Tokenizer

    from rljax.launch import main

    monkeypatch.chdir(tmp_path)  # the first run goes to the default runs/<project_name>/<experiment_name>

    small = ["data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "data.val_batch_size=8"]
    grpo = ["trainer.project_name=p", "trainer.experiment_name=grpo", *small, "data.embedded.num_train=16", "data.embedded.num_test=8",
            "trainer.total_steps=2", "trainer.test_freq=1", "trainer.save_freq=1", "trainer.val_before_train=true",
            "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "actor.use_kl_loss=true",
            "rollout.correction=token", "rollout.max_slots=8",
            # DAPO: dynamic sampling on the score after the soft overlong penalty.
            "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
            "algorithm.filter_groups.max_num_gen_batches=8", "reward.reward_kwargs.max_resp_len=8",
            "reward.reward_kwargs.overlong_buffer_cfg.enable=true", "reward.reward_kwargs.overlong_buffer_cfg.len=6",
            "reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=0.5",
            # on-policy distillation from the policy's initial weights (verl's distillation.*)
            "distillation.enabled=true", "distillation.teacher_model.model_path=ref"]
    # GAE with a reward model (a tiny sequence-classification checkpoint) combined with the rule reward.
    gae = ["--run-dir", str(tmp_path / "gae"), *small, "data.dataset=gsm8k", f"data.path={_gsm8k_dir(tmp_path / 'd')}",
           "data.prompt_template={prompt}", "data.max_prompt_length=8", "algorithm.adv_estimator=gae",
           "actor.lora.rank=4", "actor.lora.dropout=0.1",
           f"reward.model.path={tiny_reward_model(tmp_path / 'rm')}", "reward.model.label=0",
           "reward.combine.function_weight=1.0", "reward.combine.model_weight=0.5",
           # ... and a generative judge: the policy's initial weights (a LoRA base, rebuilt: no KL keeps no reference)
           "reward.judge.path=ref", f"reward.judge.parse={_judge_parse(tmp_path / 'judge.py')}:length",
           "reward.judge.prompt_template={prompt}|{response}|{answer}>", "reward.judge.temperature=0.5",
           "reward.judge.response_length=3", "reward.judge.prompt_length=40", "reward.combine.judge_weight=0.1",
           # verl's decoupled rollout correction: IcePop bounds and rejection by divergence
           "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=0.5_2.0",
           "algorithm.rollout_correction.rollout_is_batch_normalize=true",
           "algorithm.rollout_correction.rollout_rs=token_k1", "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
           "trainer.total_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false"]
    # A multi-turn run (rljax.env) reads env.*; the tools environment's python tool probes its
    # sandbox (non_root only: the others need user namespaces or CAP_SYS_ADMIN, which CI may lack).
    env = ["--config", "tool_lookup", "--run-dir", str(tmp_path / "env"), *small, "data.embedded.num_train=16",
           "data.embedded.num_test=8", "trainer.total_steps=1", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "env.function=tools", "env.sandbox.require=[non_root]", "env.sandbox.tmp_mb=16", "env.timeout_s=10",
           "env.memory_mb=512"]
    # An asynchronous, disaggregated run reads async_training.* and rollout.num_devices; a
    # model shape override goes through the trainer's apply_model_overrides. Its data are local
    # conversation files (verl's train_files / val_files, TRL's messages) scored by a reward
    # plugin in a worker process.
    (tmp_path / "plugin.py").write_text(PLUGIN)
    tok = tokenizer_dir(tmp_path / "tok")
    eos = Tokenizer.from_file(str(tok / "tokenizer.json")).token_to_id("<|endoftext|>")
    asy = ["--mesh=dp4", "--run-dir", str(tmp_path / "async"), *small, "data.dataset=local",
           f"data.train_files={_conversations(tmp_path / 'train.jsonl', 16)}",
           f"data.val_files={_conversations(tmp_path / 'val.jsonl', 8)}", "data.messages_key=messages",
           "data.apply_chat_template=false",
           f"reward.functions=[{tmp_path / 'plugin.py'}:reward,{tmp_path / 'plugin.py'}:brevity]", "reward.weights=[1,0.5]",
           f"model.tokenizer={tok / 'tokenizer.json'}", f"model.eos_token_id={eos}",
           "reward.num_workers=1", "reward.import_timeout_s=30", "reward.memory_mb=1024",
           "trainer.total_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "trainer.mode=async", "rollout.placement=disaggregated", "rollout.num_devices=4",
           "async_training.max_staleness=1", "model.intermediate_size=48"]
    with record_reads() as reads:
        for args in (grpo, gae, env, asy):
            assert main(args) == 0, args
    assert (tmp_path / "runs" / "p" / "grpo" / "config.resolved.yaml").is_file()
    unread = set(field_specs()) - reads
    assert unread - PER_MODE == set(), f"schema keys nothing read: {sorted(unread - PER_MODE)}"
    assert PER_MODE & reads == set(), f"read by a run in another loss mode: {sorted(PER_MODE & reads)}"
    # the features ran, not only their keys: dynamic sampling and the overlong penalty, the
    # reward model's stage, the python tool's sandbox probe
    from launching import metrics

    logged = lambda run: set().union(*metrics(run))  # noqa: E731
    assert {"train/num_gen_batches", "reward/overlong_penalty/mean", "distillation/loss"} <= logged(
        tmp_path / "runs" / "p" / "grpo")
    assert {"reward/model/mean", "timing_s/reward_model", "reward/judge/mean", "timing_s/reward_judge"} <= logged(
        tmp_path / "gae")
    assert any(k.startswith("rollout_corr/") for k in logged(tmp_path / "gae"))  # the decoupled correction ran
    assert {"reward/fn/reward/mean", "reward/fn/brevity/mean"} <= logged(tmp_path / "async")  # both functions
    assert json.loads((tmp_path / "env" / "trace_summary.json").read_text())["sandbox"]["non_root"]
