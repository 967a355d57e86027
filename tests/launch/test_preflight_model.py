"""Model pre-flight and run noise (issue 25, friction 6): positions vs lengths and vocabulary
vs tokenizer are one line, exit 2, nothing written; no absl warning on every run."""

import json
import subprocess
import sys

import pytest

from hf_tiny import tokenizer_dir
from launching import launch_env


def _checkpoint(root, *, vocab_size=320, max_position_embeddings=32):
    """A checkpoint directory as the pre-flight reads it (config.json, a safetensors file, the tokenizer)."""
    tokenizer_dir(root)
    (root / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": vocab_size, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": max_position_embeddings, "eos_token_id": 317}))
    (root / "model.safetensors").write_bytes(b"")
    return root


def _data(root):
    root.mkdir()
    for split in ("train", "test"):
        (root / f"{split}.jsonl").write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    return root


@pytest.mark.parametrize("case,args,message", [
    ("positions", ["data.max_prompt_length=30", "data.max_response_length=8"],
     "data.max_prompt_length=30 + data.max_response_length=8 = 38 tokens exceed model.path's config.json "
     "max_position_embeddings=32"),
    ("preset positions", ["model.path=null", "model.max_position_embeddings=16", "data.max_prompt_length=12",
                          "data.max_response_length=8"],
     "= 20 tokens exceed model.max_position_embeddings=16"),
    ("vocabulary", ["VOCAB"], "has 320 tokens, more than model.path's config.json vocab_size=256"),
])
def test_model_mistakes_exit_2_in_one_line_and_write_nothing(tmp_path, capsys, case, args, message):
    from rljax.launch import main

    ckpt = _checkpoint(tmp_path / "ckpt", vocab_size=256 if args == ["VOCAB"] else 320)
    args = [] if args == ["VOCAB"] else args
    run = tmp_path / "run"
    argv = ["--run-dir", str(run), "data.dataset=gsm8k", f"data.path={_data(tmp_path / 'd')}",
            f"model.path={ckpt}", "data.train_batch_size=1", "actor.ppo_mini_batch_size=1", *args]
    if "model.path=null" in args:
        argv += [f"model.tokenizer={ckpt}", "model.name=tiny"]
    assert main(argv) == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], lines
    assert not run.exists()


def test_no_absl_warning_when_checkpointing_is_set_up():
    """Every run printed 'WARNING:absl:Type handler registry type ... overriding jax.Array'."""
    code = ("import logging; logging.basicConfig(level=logging.INFO)\n"
            "from rljax.trainer import checkpoint\n"
            "assert checkpoint._no_replica_parallel_saves_on_cpu()\n")
    out = subprocess.run([sys.executable, "-c", code], env=launch_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "overriding" not in out.stderr and "absl" not in out.stderr, out.stderr
