"""Issue 38's 'done when': verl's GSM8K GRPO example command line runs unchanged but for the entry
point, the paths and the sizes -- verl's keys (tests/config/test_verl_keys.py's VERL_GSM8K), a
parquet as verl's examples/data_preprocess/gsm8k.py writes it, a tiny random Qwen2 directory with
its tokenizer, and a reward file whose ``compute_score`` returns a dict as verl's may. The dict's
numbers are logged as ``reward/extra/<key>``, validation per data source under verl's names, and
the run passes ``python -m rljax.trace check``."""

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.hf]
pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_tiny import qwen2_dir  # noqa: E402
from launching import REPO, launch, launch_env, metrics  # noqa: E402
from test_data_local import _parquet, _verl_rows  # noqa: E402
from test_verl_keys import VERL_GSM8K  # noqa: E402

#: A custom_reward_function file as a verl user writes one: verl's signature, a dict back
#: (``score`` the reward; ``acc`` and ``pred`` as verl's math rewards return them).
REWARD = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    found = re.findall(r"-?[0-9]+", solution_str)
    pred = found[-1] if found else ""
    acc = pred == ground_truth
    return {"score": 1.0 if acc else (len(solution_str) % 3) / 4.0, "acc": acc, "pred": pred,
            "length": float(len(solution_str))}
'''

#: VERL_GSM8K's sizes scaled down to a 2-step CPU run (verl's keys, new values).
SCALED = {"data.train_batch_size": 4, "data.max_prompt_length": 64, "data.max_response_length": 8,
          "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
          "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 2,
          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 2, "actor_rollout_ref.rollout.n": 4,
          "trainer.total_training_steps": 2}


def _scaled(command: list[str]) -> list[str]:
    out = []
    for item in command:
        key = item.split("=", 1)[0]
        out.append(f"{key}={SCALED[key]}" if key in SCALED else item)
    assert len({o.split("=", 1)[0] for o in out} & set(SCALED)) == len(SCALED)  # each size found
    return out


def test_verl_gsm8k_example_runs_with_verl_keys(tmp_path):
    model = qwen2_dir(tmp_path / "qwen2", max_position_embeddings=256)
    data = tmp_path / "gsm8k"
    _parquet(data, "train.parquet", _verl_rows(16))
    _parquet(data, "test.parquet", _verl_rows(4, "test"))
    (tmp_path / "gsm8k_reward.py").write_text(REWARD)
    run = tmp_path / "run"
    paths = [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
             f"actor_rollout_ref.model.path={model}", f"custom_reward_function.path={tmp_path / 'gsm8k_reward.py'}",
             "custom_reward_function.name=compute_score"]
    out = launch("--run-dir", str(run), *paths, *_scaled(VERL_GSM8K))
    assert out.returncode == 0, out.stderr[-3000:]

    rows = metrics(str(run))
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 2
    for r in train:  # the dict's numbers (a bool counts; the string pred does not), verl's names
        assert 0.0 <= r["reward/extra/acc"] <= 1.0 and r["reward/extra/length"] > 0, r
        assert not any(k.startswith("reward/extra/pred") for k in r)
    val = [r for r in rows if any(k.startswith("val-core/") for k in r)]
    assert [r["step"] for r in val] == [0, 2]  # before training (val_before_train) and at the end
    for r in val:  # verl's trainer: the core variable is acc when the reward gives one; N = val_kwargs.n = 1
        assert 0.0 <= r["val-core/openai/gsm8k/acc/mean@1"] <= 1.0
        assert "val-aux/openai/gsm8k/reward/mean@1" in r and "val-aux/openai/gsm8k/length/mean@1" in r
    resolved = (run / "config.resolved.yaml").read_text()
    assert "# verl actor_rollout_ref.rollout.name=vllm: no rljax key" in resolved

    check = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], cwd=REPO, env=launch_env(),
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and "0 failed" in check.stdout, check.stdout[-3000:] + check.stderr[-2000:]
    assert json.loads((run / "trace_summary.json").read_text())
