"""model.* shape overrides of a preset from the command line (model.hidden_size=512 ...)."""

import pytest

from rljax.config import ConfigError, apply_model_overrides, model_overrides, resolve
from rljax.models.config import get_config

SIZE_31M = ["model.hidden_size=512", "model.intermediate_size=2048", "model.num_layers=8", "model.num_heads=8",
            "model.num_kv_heads=4"]


def test_overrides_change_the_preset_and_derive_head_dim():
    cfg, _ = resolve("default", SIZE_31M)
    assert model_overrides(cfg.model) == dict(hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8,
                                              num_kv_heads=4)
    m = apply_model_overrides(get_config("tiny").replace(vocab_size=88), cfg.model)
    assert (m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim) == (
        512, 2048, 8, 8, 4, 64)
    assert m.qkv_bias and m.architecture == "qwen2"  # the rest stays the preset's
    assert round(m.num_params() / 1e6, 1) == 31.6


def test_no_override_keeps_the_preset_object():
    cfg, _ = resolve("default", [])
    base = get_config("tiny")
    assert model_overrides(cfg.model) == {} and apply_model_overrides(base, cfg.model) is base


def test_explicit_head_dim_is_kept():
    cfg, _ = resolve("default", ["model.hidden_size=96", "model.num_heads=4", "model.head_dim=32"])
    assert apply_model_overrides(get_config("tiny"), cfg.model).head_dim == 32


@pytest.mark.parametrize("overrides,match", [
    (["model.num_layers=0"], "model.num_layers"),
    (["model.hidden_size=abc"], "model.hidden_size"),
    (["model.num_heads=8", "model.num_kv_heads=3"], "multiple of model.num_kv_heads"),
    (["model.head_dim=15"], "must be even"),
    (["model.hidden_size=100", "model.num_heads=8"], "does not divide into"),
    (["model.path=/tmp/x", "model.num_layers=4"], "model.path is set"),
])
def test_bad_overrides_are_config_errors(overrides, match):
    with pytest.raises(ConfigError, match=match):
        resolve("default", overrides)


def test_inconsistent_with_the_preset_is_a_config_error():
    cfg, _ = resolve("default", ["model.hidden_size=100"])  # tiny has 4 heads
    with pytest.raises(ConfigError, match="model.hidden_size=100"):
        apply_model_overrides(get_config("tiny"), cfg.model)
    cfg, _ = resolve("default", ["model.num_kv_heads=3"])  # tiny has 4 heads
    with pytest.raises(ConfigError, match="num_kv_heads"):
        apply_model_overrides(get_config("tiny"), cfg.model)


def test_trainer_builds_the_overridden_model_and_remat_applies_to_a_checkpoint(tmp_path):
    from rljax.models import functional as F
    from rljax.models.hf import save_hf_checkpoint
    from rljax.models.tokenizer import CharTokenizer
    from rljax.trainer.build import model_for as _model

    tok = CharTokenizer()
    cfg, _ = resolve("default", ["model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1",
                                 "model.num_layers=1", "model.intermediate_size=48"])
    mcfg, _, params = _model(cfg, None, tok)
    assert (mcfg.hidden_size, mcfg.num_heads, mcfg.head_dim, mcfg.num_layers, mcfg.vocab_size) == (32, 2, 16, 1, 88)
    assert params["layers"]["mlp"]["up_proj"].shape == (1, 32, 48)
    save_hf_checkpoint(str(tmp_path), mcfg, params)
    cfg, _ = resolve("default", [f"model.path={tmp_path}", "model.tokenizer=char", "model.remat=true"])
    loaded, _, again = _model(cfg, None, tok)
    assert loaded.remat and loaded.replace(remat=False) == mcfg
    assert F.abstract_params(loaded)[1]["embed"].shape == params["embed"].shape
