"""Your own model or data starts from sensible settings, in a run directory of its own (issue 38 item 2)."""

import json

from rljax.config import resolve_run


def _ckpt(tmp_path, ctx=128):
    d = tmp_path / "my-qwen"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": ctx}))
    return d


def test_the_default_run_is_the_embedded_preset():
    cfg, prov = resolve_run(None, [])
    assert cfg.trainer.experiment_name == "embedded-add" and cfg.data.max_prompt_length == 8
    assert prov["data.max_prompt_length"].endswith("configs/default.yaml")


def test_own_model_and_data_leave_the_embedded_tasks_sizes(tmp_path):
    """Before: model.path + data.path kept max_prompt_length=8 / response 3 / rollout.n=16 / lr=3e-4."""
    ckpt = _ckpt(tmp_path, ctx=4096)
    cfg, prov = resolve_run(None, [f"model.path={ckpt}", "data.path=/data/gsm8k/"])
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length, cfg.rollout.n) == (256, 256, 8)
    assert cfg.actor.optim.lr == 1e-6 and cfg.data.dataset == "local"
    assert prov["data.dataset"] == "derived: your own data (data.path / data.train_files)"
    assert cfg.trainer.experiment_name == "my-qwen-gsm8k"


def test_lengths_fit_the_models_context_and_a_given_key_is_kept(tmp_path):
    ckpt = _ckpt(tmp_path, ctx=128)
    cfg, prov = resolve_run(None, [f"model.path={ckpt}"])
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (64, 64)
    assert prov["data.max_response_length"] == "derived: model.path's max_position_embeddings=128"
    cfg, prov = resolve_run(None, [f"model.path={ckpt}", "data.max_response_length=100"])
    assert (cfg.data.max_prompt_length, cfg.data.max_response_length) == (28, 100) and prov["data.max_response_length"] == "cli"
    cfg, _ = resolve_run(None, [f"model.path={ckpt}", "trainer.experiment_name=mine", "data.dataset=gsm8k",
                                "data.path=/d"])
    assert cfg.trainer.experiment_name == "mine" and cfg.data.dataset == "gsm8k"


def test_the_readmes_commands_never_share_a_run_directory(tmp_path):
    ckpt = _ckpt(tmp_path, ctx=4096)
    commands = [[], ["trainer.mode=async", "rollout.placement=disaggregated", "rollout.num_devices=4"],
                ["reward.function=my_reward.py:compute_score"],
                [f"model.path={ckpt}", "data.dataset=local", "data.path=/data/my-task", "data.prompt_key=problem",
                 "data.answer_key=solution", "reward.function=exact_match"],
                ["data.train_files=/data/train.parquet"]]
    names = [resolve_run(None, c, validate=False)[0].trainer.experiment_name for c in commands]
    assert len(set(names)) == len(names), names
    assert names[:3] == ["embedded-add", "embedded-add-async", "embedded-add-compute_score"], names
    assert resolve_run("tool_lookup", [])[0].trainer.experiment_name == "tool-lookup"  # a preset's own name stays


def test_print_config_shows_the_derivation(tmp_path, capsys):
    from rljax.launch import main

    assert main(["--print-config", f"model.path={_ckpt(tmp_path, ctx=128)}"]) == 0
    out = capsys.readouterr().out
    assert "derived: model.path's max_position_embeddings=128" in out and "my-qwen-embedded-add" in out
