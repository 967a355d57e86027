"""A checkpoint or tokenizer slightly off is one usage-error line, exit 2, nothing written (issue 38).

Each case runs ``python -m rljax.launch`` as a user does: the refusal comes from the preflight,
before the run directory exists. Before the fix each printed a ~50-line traceback and exited 1
(after writing a partial run directory) or, for the tokenizer, failed in the sampler.
"""

import json
import os

import pytest

from hf_tiny import tokenizer_dir
from launching import launch

pytestmark = pytest.mark.hf


def _refused(out, run, *needles):
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert not os.path.exists(run), os.listdir(run)
    return lines[0]


def test_tokenizer_without_eos(tmp_path):
    tok = tokenizer_dir(tmp_path / "tok")
    (tok / "tokenizer_config.json").unlink()  # a bare tokenizer.json: no EOS named anywhere
    run = tmp_path / "run"
    out = launch("--run-dir", str(run), f"model.tokenizer={tok / 'tokenizer.json'}", timeout=120)
    _refused(out, run, "defines no EOS token", str(tok / "tokenizer_config.json"), str(tok / "config.json"),
             "model.eos_token_id=ID")


def test_eos_from_tokenizer_config_or_key(tmp_path):
    """tokenizer_config.json's eos_token (text) gives the id without config.json; the key overrides both."""
    from rljax.config import resolve
    from rljax.tokenizer import checked_tokenizer, tokenizer_for

    tok = tokenizer_dir(tmp_path / "tok")
    cfg, _ = resolve(None, [f"model.tokenizer={tok / 'tokenizer.json'}"])
    tokenizer, _ = checked_tokenizer(cfg.model)
    assert tokenizer.eos_id == tokenizer._tok.token_to_id("<|endoftext|>") is not None
    cfg, _ = resolve(None, [f"model.tokenizer={tok / 'tokenizer.json'}", "model.eos_token_id=5"])
    assert checked_tokenizer(cfg.model)[0].eos_id == tokenizer_for(cfg.model).eos_id == 5
    cfg, _ = resolve(None, [f"model.tokenizer={tok / 'tokenizer.json'}", "model.eos_token_id=100000"])
    with pytest.raises(Exception, match="model.eos_token_id=100000 is not a token id"):
        checked_tokenizer(cfg.model)


def test_unsupported_architecture_is_refused_before_anything_is_written(tmp_path):
    ckpt = tokenizer_dir(tmp_path / "gpt2")
    (ckpt / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                 "vocab_size": 320, "n_embd": 16, "n_layer": 1, "n_head": 2}))
    (ckpt / "model.safetensors").write_bytes(b"")  # preflight refuses on config.json alone
    run = tmp_path / "run"
    out = launch("--run-dir", str(run), f"model.path={ckpt}", timeout=120)
    _refused(out, run, "unsupported architecture 'GPT2LMHeadModel'", "LlamaForCausalLM", "Qwen3ForCausalLM",
             "MistralForCausalLM")


def test_sliding_window_shorter_than_the_run_is_refused(tmp_path):
    from rljax.config import resolve
    from rljax.errors import ConfigError
    from rljax.preflight import check_architecture

    ckpt = tmp_path / "mistral"
    ckpt.mkdir()
    hf = {"architectures": ["MistralForCausalLM"], "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 1, "num_attention_heads": 4, "sliding_window": 16, "max_position_embeddings": 128}
    (ckpt / "config.json").write_text(json.dumps(hf))
    ok, _ = resolve(None, [f"model.path={ckpt}", "data.max_prompt_length=8", "data.max_response_length=8"])
    check_architecture(ok)
    long, _ = resolve(None, [f"model.path={ckpt}", "data.max_prompt_length=8", "data.max_response_length=9"])
    with pytest.raises(ConfigError, match="= 17 is longer than model.path's sliding_window=16"):
        check_architecture(long)


def test_resume_on_a_directory_with_no_run(tmp_path):
    """A mistyped --run-dir with --resume silently started a fresh 300-step run (exit 0)."""
    run = tmp_path / "typo"
    out = launch("--run-dir", str(run), "--resume", timeout=120)
    _refused(out, run, "--resume: run directory", "holds no run", "trainer.resume_mode=auto")
    (tmp_path / "empty").mkdir()  # an existing directory with no run: refused too, and left as it was
    out = launch("--run-dir", str(tmp_path / "empty"), "--resume", timeout=120)
    assert out.returncode == 2 and os.listdir(tmp_path / "empty") == []


def test_model_eos_token_id_reaches_the_runs_tokenizer(tmp_path):
    from rljax.config import resolve
    from rljax.trainer.build import tokenizer_for

    tok = tokenizer_dir(tmp_path / "tok")
    (tok / "tokenizer_config.json").unlink()
    cfg, _ = resolve(None, [f"model.tokenizer={tok / 'tokenizer.json'}", "model.eos_token_id=7"])
    assert tokenizer_for(cfg).eos_id == 7
