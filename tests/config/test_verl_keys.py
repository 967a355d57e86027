"""verl's key paths resolve as the rljax keys they mean, with their provenance (issue 38 item 3)."""

import json

import pytest
import yaml

import rljax.data  # noqa: F401 -- installs the train-row counter trainer.total_epochs reads the data with
from rljax.config import ConfigError, non_default_fields, resolve, set_train_row_counter, write_resolved
from rljax.config._verl import ALIASES, NO_COUNTERPART
from rljax.config._resolve import field_specs

#: verl's GSM8K GRPO example (examples/grpo_trainer/run_qwen2-7b.sh), its paths ours.
VERL_GSM8K = [
    "algorithm.adv_estimator=grpo", "data.train_batch_size=16", "data.max_prompt_length=64",
    "data.max_response_length=32", "data.filter_overlong_prompts=True", "data.truncation=error",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.ref.fsdp_config.param_offload=True",
    "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.logger=['console']",
    "trainer.project_name=verl_grpo_example_gsm8k", "trainer.experiment_name=qwen2_7b_function_rm",
    "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=5",
    "trainer.total_epochs=15", "trainer.total_training_steps=3",
]


def test_every_alias_names_a_key_of_the_schema():
    assert set(ALIASES.values()) <= set(field_specs())
    assert not set(ALIASES) & set(field_specs()) and not set(NO_COUNTERPART) & set(field_specs())


def test_verl_gsm8k_command_line_resolves_with_provenance(tmp_path):
    cfg, prov = resolve("default", VERL_GSM8K)
    assert (cfg.rollout.n, cfg.actor.optim.lr, cfg.actor.ppo_mini_batch_size, cfg.trainer.total_steps) == (5, 1e-6, 8, 3)
    assert cfg.model.remat == "true" and cfg.actor.kl_loss_type == "low_var_kl"
    assert prov["rollout.n"] == "cli (verl actor_rollout_ref.rollout.n)"
    assert prov.chain("actor.optim.lr")[-1] == ("cli (verl actor_rollout_ref.actor.optim.lr)", 1e-6)
    assert prov.verl["actor_rollout_ref.rollout.name"][0] == "vllm"
    path = write_resolved(cfg, prov, tmp_path)
    text = path.read_text()
    assert "n: 5  # from: cli (verl actor_rollout_ref.rollout.n)" in text
    assert "# verl actor_rollout_ref.rollout.gpu_memory_utilization=0.6: no rljax key" in text
    assert "# verl actor_rollout_ref.ref.fsdp_config.param_offload=true: no rljax key" in text  # same numbers
    assert "# verl trainer.total_epochs=15: no rljax key" in text
    assert resolve(str(path))[0] == cfg  # the record reruns as a preset


def test_a_verl_value_rljax_cannot_honour_is_one_line():
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref.ref.fsdp_config.param_offload='cpu' \(verl's\) is not "
                                          r"supported: rljax keeps parameters .* on the devices"):
        resolve("default", ["actor_rollout_ref.ref.fsdp_config.param_offload=cpu"])
    with pytest.raises(ConfigError, match="reward_model.reward_manager='batch' .* not supported"):
        resolve(None, ["reward_model.reward_manager=batch"])
    with pytest.raises(ConfigError, match="reward_model.enable=true .* reward.model.path is null"):
        resolve(None, ["reward_model.enable=true"])


def test_total_training_steps_wins_over_total_epochs(tmp_path):
    """verl's example says trainer.total_epochs=15; total_training_steps wins over it in verl. Before:
    'config key trainer.total_epochs is verl's' refused the example command line even with both."""
    cfg, prov = resolve("default", ["trainer.total_epochs=15", "trainer.total_training_steps=2"])
    assert cfg.trainer.total_steps == 2 and prov.verl["trainer.total_epochs"][0] == 15
    assert prov["trainer.total_steps"] == "cli (verl trainer.total_training_steps)"
    preset = tmp_path / "verl.yaml"
    preset.write_text(yaml.safe_dump({"trainer": {"total_epochs": 2, "total_training_steps": 5}}))
    assert resolve(str(preset))[0].trainer.total_steps == 5
    with pytest.raises(ConfigError, match=r"^trainer.total_epochs=0 \(verl's\) is not supported: .*; accepted: a "
                                          r"positive integer or null$"):
        resolve("default", ["trainer.total_epochs=0", "trainer.total_training_steps=2"])


def _local_data(root, short: int, long: int):
    """A local dataset of ``short`` prompts that fit data.max_prompt_length=64 (char tokenizer) and
    ``long`` that do not, interleaved."""
    root.mkdir()
    kinds = [True] * long + [False] * short
    rows = [{"prompt": "x" * 300 if overlong else f"{i}+1?", "answer": "1", "data_source": "mine"}
            for i, overlong in enumerate(kinds[::2] + kinds[1::2])]
    assert sum(len(r["prompt"]) > 64 for r in rows) == long
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "test.jsonl").write_text(json.dumps(rows[0]) + "\n")
    return ["data.dataset=local", f"data.path={root}", "data.max_prompt_length=64", "data.filter_overlong_prompts=true",
            "reward.function=gsm8k", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4"]


def test_total_epochs_alone_counts_the_rows_left_after_filtering(tmp_path):
    """Before: 'trainer.total_epochs=3 (verl's) needs trainer.total_training_steps beside it'. Now verl's
    len(train_dataloader) * total_epochs: 23 rows, 5 overlong filtered, 18 // batch 4 = 4 steps an epoch."""
    data = _local_data(tmp_path / "d", short=18, long=5)
    for preset in ("default", None):  # the preset's own total_steps is not the user's step count
        cfg, prov = resolve(preset, [*data, "trainer.total_epochs=3"])
        assert cfg.trainer.total_steps == 12, prov["trainer.total_steps"]
        assert prov["trainer.total_steps"].startswith("derived: trainer.total_epochs=3 x 4 steps an epoch: 18 of 23 "
                                                      "train rows kept (") and "5 filtered as overlong" in \
            prov["trainer.total_steps"]
    assert "trainer.total_steps=12 (default 200; from derived: trainer.total_epochs=3 x 4 steps" in \
        "\n".join(map(str, non_default_fields(cfg, prov)))  # the launch's start-up summary lists it
    text = write_resolved(cfg, prov, tmp_path).read_text()
    assert "total_steps: 12  # from: derived: trainer.total_epochs=3 x 4 steps an epoch: 18 of 23" in text
    assert resolve(str(tmp_path / "config.resolved.yaml"))[0] == cfg  # the record reruns as it ran
    assert resolve("default", [*data, "trainer.total_epochs=3", "trainer.total_training_steps=7"])[0] \
        .trainer.total_steps == 7
    assert resolve("default", [*data, "trainer.total_epochs=3", "data.train_batch_size=8",
                               "actor.ppo_mini_batch_size=8"])[0].trainer.total_steps == 6


def test_total_epochs_with_no_full_batch_is_one_line(tmp_path):
    data = _local_data(tmp_path / "d", short=3, long=4)
    with pytest.raises(ConfigError, match=r"^trainer.total_epochs=2 \(verl's\): 3 of 7 train rows kept \(data.path="
                                          r".*4 filtered as overlong\) make no full batch of data.train_batch_size=4, "
                                          r"so an epoch has no step; [^\n]*$"):
        resolve("default", [*data, "trainer.total_epochs=2", "+trainer.total_epochs=2"])
    previous = set_train_row_counter(None)
    try:  # rljax.config alone (a layer below rljax.data) cannot read the rows
        with pytest.raises(ConfigError, match=r"^trainer.total_epochs=2 \(verl's\) without trainer.total_training_steps "
                                              r"counts the train rows, which needs rljax.data imported"):
            resolve("default", [*data, "trainer.total_epochs=2"])
    finally:
        set_train_row_counter(previous)


def test_custom_reward_function_and_hydra_plus(tmp_path):
    cfg, prov = resolve(None, ["custom_reward_function.path=/r/gsm8k.py", "+reward_model.reward_manager=dapo",
                               "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                               "reward_model.reward_kwargs.max_resp_len=8"], validate=False)
    assert cfg.reward.function == "/r/gsm8k.py:compute_score"
    assert prov["reward.function"] == "cli (verl custom_reward_function.path + custom_reward_function.name)"
    assert cfg.reward.reward_kwargs.overlong_buffer_cfg.enable and cfg.reward.reward_kwargs.max_resp_len == 8
    cfg, _ = resolve(None, ["custom_reward_function.path=/r/x.py", "custom_reward_function.name=score"],
                     validate=False)
    assert cfg.reward.function == "/r/x.py:score"


def test_a_nested_verl_yaml_preset(tmp_path):
    preset = tmp_path / "verl.yaml"
    preset.write_text(yaml.safe_dump({
        "actor_rollout_ref": {"rollout": {"n": 4, "name": "sglang", "val_kwargs": {"n": 2}},
                              "actor": {"optim": {"lr": 2e-6}, "strategy": "fsdp2"}},
        "reward_model": {"reward_manager": "naive"}, "trainer": {"total_training_steps": 7}}))
    cfg, prov = resolve(str(preset))
    assert (cfg.rollout.n, cfg.rollout.val_kwargs.n, cfg.actor.optim.lr, cfg.trainer.total_steps) == (4, 2, 2e-6, 7)
    assert prov["rollout.n"] == f"{preset} (verl actor_rollout_ref.rollout.n)"
    assert set(prov.verl) == {"actor_rollout_ref.rollout.name", "actor_rollout_ref.actor.strategy",
                              "reward_model.reward_manager"}
