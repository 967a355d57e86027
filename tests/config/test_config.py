"""rljax.config: schema, presets, overrides, provenance, errors, validation."""

import dataclasses
import subprocess
import sys
import textwrap

import pytest
import yaml

from rljax import config as C
from rljax.config import ConfigError, resolve

REPO_CONFIGS = C.preset_dirs()[-1]


def _err(overrides, preset=None):
    with pytest.raises(ConfigError) as e:
        resolve(preset, overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ----------------------------------------------------------------------------- resolve and provenance


def test_defaults_come_from_code_with_default_provenance():
    cfg, prov = resolve()
    assert cfg == C.Config()
    assert set(prov) == set(C.field_specs())
    assert set(prov.values()) == {"default"}
    assert C.non_default_fields(cfg, prov) == []


def test_provenance_default_preset_cli(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("rollout:\n  n: 4\n  temperature: 0.7\nactor:\n  optim:\n    lr: 1e-5\n")
    cfg, prov = resolve(preset, ["rollout.n=2", "trainer.seed=7"])
    assert (cfg.rollout.n, prov["rollout.n"]) == (2, "cli")  # cli wins over the preset
    assert (cfg.rollout.temperature, prov["rollout.temperature"]) == (0.7, str(preset))
    assert (cfg.actor.optim.lr, prov["actor.optim.lr"]) == (1e-5, str(preset))  # YAML '1e-5' is a string
    assert (cfg.trainer.seed, prov["trainer.seed"]) == (7, "cli")
    assert prov["rollout.top_p"] == "default"
    changes = {c.key: c for c in C.non_default_fields(cfg, prov)}
    assert set(changes) == {"rollout.n", "rollout.temperature", "actor.optim.lr", "trainer.seed"}
    assert changes["rollout.n"].default == C.RolloutConfig().n
    assert changes["actor.optim.lr"].source == str(preset)
    assert "rollout.n=2" in str(changes["rollout.n"]) and "from cli" in str(changes["rollout.n"])


def test_provenance_chain_records_every_writer_with_its_value(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("rollout:\n  n: 4\n  top_k: -1\n")
    cfg, prov = resolve(preset, ["rollout.n=2", "trainer.seed=7", "rollout.n=6"])
    default_n = C.RolloutConfig().n
    assert prov.chain("rollout.n") == (("default", default_n), (str(preset), 4), ("cli", 2), ("cli", 6))
    assert prov.chain("rollout.top_k") == (("default", -1), (str(preset), -1))  # set to its default: still recorded
    assert prov.chain("trainer.seed") == (("default", 0), ("cli", 7))
    assert prov.chain("rollout.top_p") == (("default", 1.0),)
    assert isinstance(prov, dict) and prov["rollout.n"] == "cli"  # the last writer, as before
    change = {c.key: c for c in C.non_default_fields(cfg, prov)}["rollout.n"]
    assert str(change) == f"rollout.n=6 (default {default_n}; from cli, over {preset} 4, cli 2)"


def test_format_config_lists_every_key_with_value_source_and_doc(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("rollout:\n  n: 4\n")
    cfg, prov = resolve(preset, ["rollout.n=2"])
    lines = C.format_config(cfg, prov).splitlines()
    assert lines[0].split() == ["key", "value", "source", "doc"]
    assert len(lines) == 1 + len(C.field_specs())
    row = next(l for l in lines if l.startswith("rollout.n "))
    assert row.split()[:3] == ["rollout.n", "2", "cli"]
    assert f"(default {C.RolloutConfig().n} -> {preset} 4)" in row and C.field_specs()["rollout.n"].doc in row
    assert next(l for l in lines if l.startswith("rollout.top_p ")).split()[:3] == ["rollout.top_p", "1.0", "default"]


def test_setting_a_default_value_explicitly_records_the_source_but_is_not_a_change():
    default_n = C.RolloutConfig().n
    cfg, prov = resolve(None, [f"rollout.n={default_n}"])
    assert prov["rollout.n"] == "cli"
    assert C.non_default_fields(cfg, prov) == []


def test_later_override_wins():
    cfg, _ = resolve(None, ["rollout.n=4", "rollout.n=6"])
    assert cfg.rollout.n == 6


def test_yaml_scalar_semantics_of_overrides():
    cfg, prov = resolve(
        None,
        [
            "actor.optim.lr=1e-6",
            "actor.optim.betas=[0.9,0.95]",
            "actor.grad_clip=null",
            "model.remat=true",
            "algorithm.use_kl_in_reward=true",  # kl_ctrl.* are read only with it
            "algorithm.kl_ctrl.kl_coef=0",  # int into a float field
            "model.name=qwen2.5-0.5b",
            "model.tokenizer=char",
            "data.prompt_template=Q: {prompt} # A:",  # ':' and '#' kept verbatim in a string field
            "reward.function=my rewards/r.py:score",
        ],
    )
    assert cfg.actor.optim.lr == 1e-6 and isinstance(cfg.actor.optim.lr, float)
    assert cfg.actor.optim.betas == (0.9, 0.95)
    assert cfg.actor.grad_clip is None
    assert cfg.model.remat == "true"  # auto | true | false (YAML true -> "true")
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.0 and isinstance(cfg.algorithm.kl_ctrl.kl_coef, float)
    assert cfg.model.name == "qwen2.5-0.5b"
    assert cfg.data.prompt_template == "Q: {prompt} # A:"
    assert cfg.reward.function == "my rewards/r.py:score"
    assert C.parse_override("trainer.mesh=dp2,tp2") == ("trainer.mesh", "dp2,tp2")
    assert C.parse_override("data.path='null'") == ("data.path", "null")  # quoted: the string
    assert C.parse_override("data.path=null") == ("data.path", None)


def test_config_is_frozen_and_hashable():
    cfg, _ = resolve("default")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.n = 3
    assert hash(cfg) == hash(resolve("default")[0])


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("actor.optim.lr=abc", ["actor.optim.lr", "'abc'", "float"]),
        ("rollout.n=two", ["rollout.n", "'two'", "int"]),
        ("trainer.total_steps=1.5", ["trainer.total_steps", "1.5", "int"]),
        ("model.remat=2", ["model.remat", "accepted: auto, true, false"]),
        ("actor.optim.betas=0.9", ["actor.optim.betas", "list of 2 numbers"]),
        ("actor.optim.betas=[0.9,0.9,0.9]", ["actor.optim.betas", "list of 2 numbers"]),
        ("rollout.n=null", ["rollout.n=null", "int"]),
        ("rollout.n=0", ["rollout.n=0", "out of range", ">= 1"]),
        ("actor.clip_ratio_low=-0.1", ["actor.clip_ratio_low", "out of range", ">= 0.0"]),
        ("rollout.temperature=0", ["rollout.temperature", "> 0.0"]),
        ("rollout.top_p=1.5", ["rollout.top_p", "<= 1"]),
        ("actor.clip_ratio_c=1.0", ["actor.clip_ratio_c", "> 1.0"]),
        ("reward.max_error_fraction=2", ["reward.max_error_fraction", "<= 1.0"]),
        ("actor.optim.lr=.inf", ["actor.optim.lr", "finite"]),
        ("actor.kl_loss_type=k5", ["actor.kl_loss_type", "'k5'", "low_var_kl", "k3+"]),
        ("actor.loss_agg_mode=mean", ["actor.loss_agg_mode", "token-mean", "seq-mean-token-sum-norm"]),
        ("algorithm.adv_estimator=ppo", ["algorithm.adv_estimator", "grpo", "reinforce_plus_plus_baseline", "gae"]),
        ("data.truncation=middle", ["data.truncation", "error, left, right"]),
        ("rollout.correction=seq", ["rollout.correction", "none, token, sequence"]),
        ("actor.logprob_impl=fast", ["actor.logprob_impl", "auto, chunked, naive, pallas"]),
    ],
)
def test_type_range_and_enum_errors_name_key_value_and_accepted(override, fragments):
    msg = _err([override])
    for frag in fragments:
        assert frag in msg, (frag, msg)


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("rollout.nn=3", "rollout.n"),
        ("actor.optm.lr=1", "actor.optim.lr"),
        ("algorithm.adv_estimater=grpo", "algorithm.adv_estimator"),
        ("data.train_batchsize=8", "data.train_batch_size"),
        ("rollout.temprature=0.5", "rollout.temperature"),
    ],
)
def test_unknown_keys_suggest_the_closest(override, suggestion):
    msg = _err([override])
    assert "unknown config key" in msg and f"did you mean {suggestion}?" in msg


def test_unknown_key_without_a_close_match_points_to_print_config():
    msg = _err(["zzzz.qqqq=1"])
    assert "unknown config key 'zzzz.qqqq'" in msg and "--print-config" in msg


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("actor.lr=1e-6", "did you mean actor.optim.lr?"),
        ("critic.warmup_steps=3", "did you mean critic.optim.warmup_steps?"),
        ("kl_ctrl.type=adaptive", "did you mean algorithm.kl_ctrl.type?"),
        ("algorithm.target_kl=0.2", "did you mean algorithm.kl_ctrl.target_kl?"),
        ("val_kwargs.n=2", "did you mean rollout.val_kwargs.n?"),
        ("lr=1e-6", "did you mean actor.optim.lr? (or critic.optim.lr)"),
    ],
)
def test_unknown_keys_suggest_the_nested_key_with_that_leaf(override, suggestion):
    assert suggestion in _err([override])


@pytest.mark.parametrize("override, says", [
    ("data.gen_batch_size=64", "as data.train_batch_size prompts"),
])
def test_verl_keys_rljax_does_differently_say_what_it_does(override, says):
    """verl's spelling of a key rljax names or does otherwise: one line saying what rljax does
    (the closest-name guess would mislead: reward_model.enable -> reward.model.label)."""
    msg = _err([override])
    key = override.split("=")[0]
    assert msg.startswith(f"config key {key!r} (command line) is verl's: ") and says in msg, msg
    assert "\n" not in msg and "did you mean" not in msg


@pytest.mark.parametrize("bad", ["foo", "rollout.n", "=3", "a b=3"])
def test_malformed_overrides(bad):
    assert "malformed override" in _err([bad])


def test_section_as_override_key():
    assert "names the section 'rollout'" in _err(["rollout=3"])


def test_single_string_instead_of_a_list_of_overrides():
    msg = _err("rollout.n=4")
    assert "list of key=value" in msg


def test_unknown_key_in_preset_names_the_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("rollout:\n  temprature: 0.5\n")
    msg = _err([], p)
    assert "rollout.temprature" in msg and str(p) in msg and "did you mean rollout.temperature?" in msg


def test_preset_errors(tmp_path):
    scalar_section = tmp_path / "s.yaml"
    scalar_section.write_text("rollout: 3\n")
    assert "is a section" in _err([], scalar_section)
    broken = tmp_path / "broken.yaml"
    broken.write_text("rollout:\n  n: [1,\n")
    assert "not valid YAML" in _err([], broken)
    listing = tmp_path / "list.yaml"
    listing.write_text("- 1\n- 2\n")
    assert "must be a mapping" in _err([], listing)
    wrong_type = tmp_path / "w.yaml"
    wrong_type.write_text("rollout:\n  n: many\n")
    assert "rollout.n='many'" in _err([], wrong_type)
    missing = _err([], "no_such_preset_anywhere")
    assert "not found" in missing and "default" in missing  # lists the available presets


def test_empty_preset_is_defaults(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("# nothing\n")
    cfg, prov = resolve(p)
    assert cfg == C.Config() and set(prov.values()) == {"default"}


def test_preset_integer_for_a_string_field_is_its_text(tmp_path):
    p = tmp_path / "names.yaml"
    p.write_text("trainer:\n  experiment_name: 2024\n  project_name: [a]\n")
    assert "trainer.project_name=[a] has the wrong type; expected str" in _err([], p)
    p.write_text("trainer:\n  experiment_name: 2024\n")
    assert resolve(p)[0].trainer.experiment_name == "2024"


def test_dotted_keys_in_presets(tmp_path):
    p = tmp_path / "dotted.yaml"
    p.write_text("rollout.n: 4\nactor:\n  optim.lr: 2.0e-5\n")
    cfg, prov = resolve(p)
    assert cfg.rollout.n == 4 and cfg.actor.optim.lr == 2e-5 and prov["actor.optim.lr"] == str(p)


# ----------------------------------------------------------------------------- contradictions


def test_mini_batch_must_divide_train_batch():
    msg = _err(["data.train_batch_size=32", "actor.ppo_mini_batch_size=12"])
    assert "actor.ppo_mini_batch_size=12" in msg and "data.train_batch_size=32" in msg and "prompts" in msg


def test_micro_batch_must_divide_mini_times_n():
    msg = _err(["data.train_batch_size=32", "actor.ppo_mini_batch_size=16", "rollout.n=8", "actor.ppo_micro_batch_size=48"])
    assert "actor.ppo_micro_batch_size=48" in msg and "16*8=128" in msg and "trajectories" in msg
    cfg, _ = resolve(None, ["actor.ppo_mini_batch_size=16", "rollout.n=8", "actor.ppo_micro_batch_size=32"])
    assert cfg.actor.ppo_micro_batch_size == 32


@pytest.mark.parametrize("est", ["grpo", "rloo"])
def test_group_estimators_need_two_samples(est):
    msg = _err([f"algorithm.adv_estimator={est}", "rollout.n=1"])
    assert "rollout.n=1" in msg and est in msg
    resolve(None, ["algorithm.adv_estimator=gae", "rollout.n=1"])  # gae does not need a group


@pytest.mark.parametrize("key", ["rollout.calculate_log_probs", "rollout.max_staleness"])
def test_removed_keys_say_why(key):
    msg = _err([f"{key}=1"])
    assert f"{key!r} (command line) was removed" in msg and "delete it" in msg


def test_gsm8k_needs_a_path():
    assert "data.path is required" in _err(["data.dataset=gsm8k"])


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("data.prompt_template=no field", "{prompt}"),
        ("data.prompt_template={prompt} {other}", "no other"),
        ("data.prompt_template={prompt", "not a valid format string"),
        ("reward.function=nonsense", "path/to/file.py:function_name"),
        ("reward.function=file.py:not-an-identifier", "identifier"),
        ("trainer.mesh=dp8x", "trainer.mesh: mesh spec 'dp8x': size of 'dp' is '8x', not a number"),
        ("trainer.mesh=dp2,dp4", "axis 'dp' is repeated"),
        ("model.name=gpt5", "accepted: tiny"),
        ("model.name=qwen2.5-0.5b", "tokenizer"),
    ],
)
def test_other_cross_field_errors(override, fragment):
    assert fragment in _err([override])


ONE_MINI = ["actor.ppo_mini_batch_size=32"]  # default preset: 32 prompts per step, one update


@pytest.mark.parametrize("overrides, blocker", [
    ([], "2 mini-batches per step (data.train_batch_size=32 / actor.ppo_mini_batch_size=16"),
    ([*ONE_MINI, "actor.ppo_epochs=2"], "actor.ppo_epochs=2"),
    ([*ONE_MINI, "rollout.correction=token"], "rollout.correction=token"),
    ([*ONE_MINI, "algorithm.use_kl_in_reward=true"], "algorithm.use_kl_in_reward=true"),
    ([*ONE_MINI, "algorithm.bypass_mode=true"], "algorithm.bypass_mode=true"),
    ([*ONE_MINI, "actor.lora.rank=4", "actor.lora.dropout=0.1"], "actor.lora.dropout=0.1"),
])
def test_skip_old_log_prob_true_needs_an_exactly_on_policy_update(overrides, blocker):
    assert C.on_policy_blockers(resolve("default", overrides)[0])[0].startswith(blocker)
    assert not C.on_policy_blockers(resolve("default", ONE_MINI)[0])
    msg = _err([*overrides, "actor.skip_old_log_prob=true"], "default")
    assert msg.startswith(f"actor.skip_old_log_prob=true needs an exactly on-policy update, but {blocker}"), msg
    assert "use auto" in msg
    for mode in ("auto", "false"):  # auto skips only when on-policy; false never: both always valid
        assert resolve("default", [*overrides, f"actor.skip_old_log_prob={mode}"])[0].actor.skip_old_log_prob == mode


def test_skip_old_log_prob_values(tmp_path):
    assert resolve("default", [*ONE_MINI, "actor.skip_old_log_prob=true"])[0].actor.skip_old_log_prob == "true"
    p = tmp_path / "p.yaml"
    p.write_text("actor:\n  ppo_mini_batch_size: 32\n  skip_old_log_prob: false\n")  # YAML booleans mean the words
    assert resolve(p)[0].actor.skip_old_log_prob == "false"
    assert "actor.skip_old_log_prob='yes please' is not accepted; accepted: auto, true, false" in _err(
        ["actor.skip_old_log_prob=yes please"])


def test_bypass_mode_needs_no_correction():
    assert "would all be 1" in _err(["algorithm.bypass_mode=true", "rollout.correction=token"])


@pytest.mark.parametrize("name", ["", "a/b", "..", "x\\y"])
def test_run_directory_names_are_one_path_component(name):
    msg = _err([f"trainer.experiment_name={name}"])
    assert "trainer.experiment_name" in msg and "without '/'" in msg


def test_embedded_reward_only_for_the_embedded_dataset():
    assert "embedded task only" in _err(["reward.function=embedded", "data.dataset=gsm8k", "data.path=/d"])


# ----------------------------------------------------------------------------- mesh


def test_validate_for_mesh_accepts_and_derives_sizes():
    cfg, _ = resolve(None, ["data.train_batch_size=32", "actor.ppo_mini_batch_size=16", "rollout.n=8",
                            "actor.ppo_micro_batch_size=32", "rollout.tp=2"])
    out = C.validate_for_mesh(cfg, {"dp": 4, "tp": 2}, num_devices=8)
    assert out["dp"] == 4 and out["devices"] == 8 and out["sp"] == 1
    assert out["trajectories_per_step"] == 256 and out["trajectories_per_minibatch"] == 128
    assert out["grad_accum"] == 4 and out["rollout_replicas"] == 4


def test_validate_for_mesh_batch_not_divisible_by_dp():
    cfg, _ = resolve(None, ["data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "rollout.n=2"])
    with pytest.raises(ConfigError, match=r"data.train_batch_size\*rollout.n=3\*2=6 trajectories must be divisible by the mesh's dp=4"):
        C.validate_for_mesh(cfg, {"dp": 4})
    cfg, _ = resolve(None, ["data.train_batch_size=4", "actor.ppo_mini_batch_size=1", "rollout.n=2"])
    with pytest.raises(ConfigError, match="actor.ppo_mini_batch_size"):
        C.validate_for_mesh(cfg, {"dp": 4})
    cfg, _ = resolve(None, ["data.train_batch_size=8", "actor.ppo_mini_batch_size=8", "rollout.n=2",
                            "actor.ppo_micro_batch_size=2"])
    with pytest.raises(ConfigError, match="actor.ppo_micro_batch_size"):
        C.validate_for_mesh(cfg, {"dp": 4})


def test_validate_for_mesh_rollout_tp_and_device_count():
    cfg, _ = resolve(None, ["rollout.tp=3"])
    with pytest.raises(ConfigError, match="rollout.tp=3 must divide the device count 8"):
        C.validate_for_mesh(cfg, {"dp": 8})
    cfg, _ = resolve()
    with pytest.raises(ConfigError, match="needs 8 devices, found 4"):
        C.validate_for_mesh(cfg, {"dp": 8}, num_devices=4)
    with pytest.raises(ConfigError, match="accepted: dp, fsdp, tp, sp"):
        C.validate_for_mesh(cfg, {"xp": 8})
    with pytest.raises(ConfigError, match=r"divisible by the mesh's dp\*fsdp=2\*3=6"):
        C.validate_for_mesh(cfg, {"dp": 2, "fsdp": 3})


def test_parse_mesh_spec():
    assert C.parse_mesh_spec("dp8") == {"dp": 8, "fsdp": 1, "tp": 1, "sp": 1}
    assert C.parse_mesh_spec("sp2,dp2,tp2") == {"dp": 2, "fsdp": 1, "tp": 2, "sp": 2}
    assert C.parse_mesh_spec("fsdp4,tp2") == {"dp": 1, "fsdp": 4, "tp": 2, "sp": 1}
    assert C.parse_mesh_spec(None) is None
    with pytest.raises(ConfigError):
        C.parse_mesh_spec("dp0")


# ----------------------------------------------------------------------------- config.resolved.yaml


def test_resolved_yaml_round_trip_values_and_provenance(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("rollout:\n  n: 4\ndata:\n  prompt_template: \"<s>\\n{prompt} #: 'x'\\n\"\n")
    cfg, prov = resolve(preset, ["actor.optim.lr=3e-7", "actor.optim.betas=[0.8,0.9]", "actor.grad_clip=null",
                                 "trainer.experiment_name=a # b: c"])
    path = C.write_resolved(cfg, prov, tmp_path)
    assert path.name == "config.resolved.yaml"
    text = path.read_text()
    assert "  lr: 3.0e-07  # from: cli" in text
    assert f"  n: 4  # from: {preset}" in text
    assert "  top_p: 1.0  # from: default" in text
    # Plain YAML: loads without rljax and gives the values.
    plain = yaml.safe_load(text)
    assert plain["actor"]["optim"]["lr"] == 3e-7 and plain["data"]["prompt_template"] == cfg.data.prompt_template
    assert plain["trainer"]["experiment_name"] == "a # b: c"
    assert f'# chain: [["default", 1e-06], ["cli", 3e-07]]' in text
    # load_resolved recovers both, chains included.
    cfg2, prov2 = C.load_resolved(path)
    assert cfg2 == cfg and prov2 == prov and prov2.chains == prov.chains
    # And the file is a preset that reproduces the run.
    cfg3, prov3 = resolve(path)
    assert cfg3 == cfg and set(prov3.values()) == {str(path)}


def test_every_field_is_written_once(tmp_path):
    cfg, prov = resolve("default")
    text = C.write_resolved(cfg, prov, tmp_path / "r.yaml").read_text()
    assert text.count("# from: ") == len(C.field_specs())


# ----------------------------------------------------------------------------- presets


def test_default_preset_resolves_and_fits_dp8():
    cfg, prov = resolve("default")
    assert cfg.data.dataset == "embedded" and cfg.model.name == "tiny"
    assert any(v.endswith("default.yaml") for v in prov.values())
    C.validate_for_mesh(cfg, {"dp": 8})
    C.validate_for_mesh(cfg, {"dp": 1})


def test_qwen_preset_needs_paths_then_resolves_for_dp8():
    assert "data.path" in _err([], "qwen2_5_0_5b_gsm8k")
    cfg, prov = resolve("qwen2_5_0_5b_gsm8k", ["model.path=/ckpt/qwen", "data.path=/data/gsm8k"])
    assert prov["model.path"] == "cli" and cfg.actor.kl_loss_type == "low_var_kl" and cfg.actor.use_kl_loss
    assert cfg.data.prompt_template is None and cfg.data.apply_chat_template == "true"  # the tokenizer's own template
    out = C.validate_for_mesh(cfg, C.parse_mesh_spec(cfg.trainer.mesh))
    assert out["trajectories_per_step"] == cfg.data.train_batch_size * cfg.rollout.n


def test_preset_files_name_only_known_keys():
    for f in sorted(REPO_CONFIGS.glob("*.yaml")):
        C.load_preset(f)  # raises on unknown keys


def test_describe_lists_every_key():
    text = C.describe()
    for key in C.field_specs():
        assert f"\n{key} (" in "\n" + text


def test_model_presets_match_rljax_models():
    models = pytest.importorskip("rljax.models.config")
    assert set(C._schema.MODEL_PRESETS) == set(models.PRESETS)
    assert C.PRESET_POSITIONS == {k: v.max_position_embeddings for k, v in models.PRESETS.items()}


def test_loss_names_are_accepted_by_config():
    loss = pytest.importorskip("rljax.loss")
    from rljax.loss import _kl, _policy

    assert set(C._schema.LOSS_AGG_MODES) == set(loss.AGGREGATION_MODES)
    for name in C._schema.ADV_ESTIMATORS:
        loss.get_adv_estimator(name)
    for name in C._schema.POLICY_LOSSES:
        _policy.get_policy_loss(name)
    implemented = set(_kl.KL_KINDS)
    assert implemented <= set(C._schema.KL_LOSS_TYPES)


def test_import_and_resolve_without_jax_or_tensorflow():
    code = textwrap.dedent(
        """
        import sys
        from rljax.config import resolve, validate_for_mesh
        cfg, _ = resolve("default", ["rollout.n=4"])
        validate_for_mesh(cfg, {"dp": 8})
        heavy = [m for m in ("jax", "numpy", "tensorflow", "tensorflow_datasets") if m in sys.modules]
        assert not heavy, heavy
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_CONFIGS.parent)


def test_a_list_type_error_shows_the_keys_own_example():
    """Every list key's type error showed betas' [0.9,0.999] (issue 38); now the key's default, or an accepted element."""
    with pytest.raises(ConfigError, match=r"trainer.logger='console' .* expected a list, e\.g\. \[console,tensorboard\]$"):
        resolve(None, ["trainer.logger=console"])
    with pytest.raises(ConfigError, match=r"e\.g\. \[lm_head\]$"):
        resolve(None, ["actor.lora.modules_to_save=lm_head"])
    with pytest.raises(ConfigError, match=r"e\.g\. \[0\.9,0\.999\]$"):
        resolve(None, ["actor.optim.betas=0.9"])
