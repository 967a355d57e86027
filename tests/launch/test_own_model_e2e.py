"""Issue 25's 'done when': a local Hugging Face Qwen2 directory with its tokenizer and a
verl-layout parquet dataset, GRPO with the tokenizer's chat template, sample completions in
the run directory and in an offline wandb run, one export command, and transformers loading
the result with the run's logits."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.hf]
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("wandb")

from hf_tiny import qwen2_dir  # noqa: E402
from launching import REPO, launch, launch_env, metrics  # noqa: E402
from test_data_local import _parquet, _verl_rows  # noqa: E402
from wandb_offline import offline_run  # noqa: E402

REWARD = '''
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["E2E_SEEN"], "a") as fh:  # what verl's signature received
        fh.write(json.dumps([data_source, ground_truth, extra_info]) + "\\n")
    return float(len(solution_str) % 3) / 2.0  # varies across a group: the policy moves
'''


def test_own_model_and_verl_data_end_to_end(tmp_path):
    model = qwen2_dir(tmp_path / "qwen2", max_position_embeddings=128)
    data = tmp_path / "gsm8k"
    _parquet(data, "train.parquet", _verl_rows(16))
    _parquet(data, "test.parquet", _verl_rows(4, "test"))
    (tmp_path / "reward.py").write_text(REWARD)
    run = tmp_path / "run"
    env_extra = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "E2E_SEEN": str(tmp_path / "seen.jsonl")}
    os.environ.update(env_extra)
    try:
        out = launch("--run-dir", str(run), "data.dataset=local", f"data.path={data}", f"model.path={model}",
                     f"reward.function={tmp_path / 'reward.py'}:compute_score", "reward.num_workers=0",
                     "data.max_prompt_length=64", "data.max_response_length=8", "data.train_batch_size=4",
                     "actor.ppo_mini_batch_size=4", "rollout.n=4", "rollout.temperature=1.0", "actor.optim.lr=1e-2",
                     "trainer.total_steps=2", "trainer.test_freq=2", "trainer.log_val_generations=3",
                     "trace.log_train_generations=2", "trainer.logger=[console,tensorboard,wandb]")
    finally:
        for k in env_extra:
            os.environ.pop(k)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "WARNING:absl" not in out.stderr

    # the tokenizer's chat template made the prompts; verl's fields reached compute_score
    rows = [json.loads(l) for l in open(run / "generations.jsonl")]
    val = [r for r in rows if r["split"] == "val" and r["step"] == 2]
    assert len(val) == 3 and {r["step"] for r in rows if r["split"] == "val"} == {0, 2}  # before training, step 2
    assert len([r for r in rows if r["split"] == "train"]) == 4  # 2 a step
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    assert val[0]["prompt"] == tok.apply_chat_template([{"role": "user", "content": "Tom has 0 apples and buys 1. "
                                                                                   "How many?"}],
                                                       tokenize=False, add_generation_prompt=True)
    assert val[0]["ground_truth"] == "1" and val[0]["data_source"] == "openai/gsm8k"
    seen = [json.loads(l) for l in open(tmp_path / "seen.jsonl")]
    assert ["openai/gsm8k", "1", {"split": "test", "index": 0, "question": "Tom has 0 apples and buys 1. How many?"}] \
        in seen
    printed = subprocess.run([sys.executable, "-m", "rljax.trace", "samples", str(run)], cwd=REPO, env=launch_env(),
                             capture_output=True, text=True, timeout=120)
    assert printed.returncode == 0 and "step 2 val uid val-0-0 session 0" in printed.stdout

    # the offline wandb run: the metrics.jsonl names and the sample tables
    names = {k for r in metrics(str(run)) for k in r if k != "step"}
    got = offline_run(str(run))
    logged = {k for h in got["history"] for k in h}
    assert names <= logged, names - logged
    assert any("/val/" in t for t in got["tables"]) and any("/train/" in t for t in got["tables"])

    # one export command; transformers loads it with the run's logits
    exported = tmp_path / "exported"
    ex = subprocess.run([sys.executable, "-m", "rljax.export", str(run), "--to", "hf", str(exported)], cwd=REPO,
                        env=launch_env(), capture_output=True, text=True, timeout=600)
    assert ex.returncode == 0, ex.stderr[-2000:]
    from rljax import models
    from rljax.export import load_run_policy

    _, config, params, step = load_run_policy(str(run))
    assert step == 2
    toks = np.array([tok.encode(val[0]["prompt"] + val[0]["response"])[:24]], np.int32)
    mask = np.ones_like(toks, bool)
    graphdef = models.abstract_params(config)[0]
    ours = np.asarray(models.compute_logits(params, models.forward(graphdef, params, toks, mask=mask)))[0]
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
        theirs = hf(input_ids=torch.tensor(toks, dtype=torch.long)).logits[0].numpy()
        base = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        before = base(input_ids=torch.tensor(toks, dtype=torch.long)).logits[0].numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4)
    assert np.abs(theirs - before).max() > 1e-3  # GRPO moved the policy
    reloaded = transformers.AutoTokenizer.from_pretrained(str(exported))
    assert reloaded.chat_template == tok.chat_template
