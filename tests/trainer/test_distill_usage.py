"""Distillation's usage errors (issue 37 item 4): one line naming the key and what is accepted,
before JAX starts. Distillation without a teacher, an unknown loss_mode (the accepted ones
listed), k1 differentiated directly (verl refuses it: its gradient ignores the teacher), a teacher
whose vocabulary is not the policy's (the preflight), a distillation key set with distillation
off; and through the launcher: exit 2, one line, nothing written."""

import json

import pytest

from launching import launch
from rljax.config import ConfigError, resolve
from rljax.trainer import check

ON = ["distillation.enabled=true"]


def _error(*overrides) -> str:
    with pytest.raises(ConfigError) as e:
        resolve("default", list(overrides))
    return str(e.value)


def test_distillation_needs_a_teacher():
    msg = _error(*ON)
    assert "distillation.enabled=true needs a teacher: set distillation.teacher_model.model_path to ref" in msg


def test_unknown_loss_mode_lists_the_accepted_ones():
    msg = _error(*ON, "distillation.teacher_model.model_path=ref", "distillation.distillation_loss.loss_mode=k4")
    assert msg == ("distillation.distillation_loss.loss_mode='k4' is not accepted; accepted: k1, kl, k2, mse, k3, "
                   "low_var_kl, abs, forward_kl_topk")


def test_k1_is_not_differentiated_directly():
    msg = _error(*ON, "distillation.teacher_model.model_path=ref", "distillation.distillation_loss.loss_mode=k1",
                 "distillation.distillation_loss.use_policy_gradient=false")
    assert "does not depend on the teacher" in msg and "accepted: use_policy_gradient=true" in msg


def test_a_distillation_key_with_distillation_off_is_refused():
    msg = _error("distillation.teacher_model.model_path=ref")
    assert "is set, but distillation.enabled=false turns distillation off, so nothing would read it" in msg


def _teacher_dir(tmp_path, vocab):
    d = tmp_path / "teacher"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu"}))
    (d / "model.safetensors").write_bytes(b"")  # the preflight only looks for the file
    return d


def test_a_teacher_with_another_vocabulary_is_refused_before_jax(tmp_path):
    teacher = _teacher_dir(tmp_path, 32000)
    cfg, _ = resolve("default", [*ON, f"distillation.teacher_model.model_path={teacher}"])
    with pytest.raises(ConfigError) as e:
        check(cfg)
    msg = str(e.value)
    assert "has a vocabulary of 32000 tokens, the policy's" in msg and "needs the policy's tokenizer" in msg
    assert "\n" not in msg
    run = tmp_path / "run"
    out = launch(*ON, f"distillation.teacher_model.model_path={teacher}", "--run-dir", str(run), timeout=120)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-2000:]
    assert "has a vocabulary of 32000 tokens" in out.stderr
    assert not run.exists()


def test_a_teacher_that_is_not_a_checkpoint_is_refused(tmp_path):
    cfg, _ = resolve("default", [*ON, f"distillation.teacher_model.model_path={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match="is not a checkpoint directory with config.json"):
        check(cfg)


def test_forward_kl_topk_resolves():
    cfg, _ = resolve("default", [*ON, "distillation.teacher_model.model_path=ref",
                                 "distillation.distillation_loss.loss_mode=forward_kl_topk",
                                 "distillation.distillation_loss.use_policy_gradient=false"])
    d = cfg.distillation.distillation_loss
    assert (d.loss_mode, d.topk, d.log_prob_min_clamp) == ("forward_kl_topk", 128, -10.0)
    check(cfg)  # topk=128 over the default preset's 88 tokens: the whole vocabulary (rljax/trainer/teacher.py)
