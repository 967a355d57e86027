"""The ``qwen2.5-0.5b`` preset end to end, as a new user runs it without downloads (issue 33 item 4):
randomly initialised, a local ``tokenizer.json``, a verl-layout parquet built here; one step with a
checkpoint, ``--resume`` to a second step, ``python -m rljax.export --to hf``; and ``--plan`` for
the same run beside what it used.

The batch and lengths are as small as the run allows (2 prompts x 2 samples, 8 response tokens):
the 24 layers of 896 are the preset's, the vocabulary is the local tokenizer's. Peaks at several
GB of RSS: one slow test, run alone (tests/README.md). Its launches compile as users' runs do
(``compile_as_user``): at LLVM ``-O0`` (the other launched tests' setting) the 0.5B update runs ~2x
slower, and with its programs this test spent more time running them than compiling them
(the first two launches: 218 s at ``-O0`` against 151 s, side by side, 6 Dec 2026, load 3-5).
"""

import json
import os
import re
import resource
import subprocess
import sys

import pytest

from hf_tiny import tokenizer_dir
from launching import REPO, launch, launch_env, metrics
from test_data_local import _parquet, _verl_rows



def _available_gib() -> float:
    try:
        with open("/proc/meminfo") as fh:
            return next(int(l.split()[1]) for l in fh if l.startswith("MemAvailable:")) / 2**20
    except (OSError, StopIteration):
        return float("inf")


#: A launch of this run peaks at ~11.5 GiB RSS (docs/benchmarks/memory.md): on a host with less free the
#: test would push other tests (or itself) out of memory, so it waits for a host that has it.
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_available_gib() < 14, reason="needs 14 GiB of available memory")]

ARGS = ["model.name=qwen2.5-0.5b", "model.param_dtype=float32", "data.dataset=local", "data.max_prompt_length=48",
        "data.max_response_length=8", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=2",
        "data.val_batch_size=2", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=1",
        "--mesh=dp1"]


def test_qwen2_5_0_5b_preset_trains_resumes_exports_and_is_planned(tmp_path):
    tok = tokenizer_dir(tmp_path / "tok")
    data = tmp_path / "gsm8k"
    _parquet(data, "train.parquet", _verl_rows(8))
    _parquet(data, "test.parquet", _verl_rows(2, "test"))
    run = tmp_path / "run"
    args = [*ARGS, f"model.tokenizer={tok / 'tokenizer.json'}", f"data.path={data}", "--run-dir", str(run)]

    first = launch(*args, "trainer.total_steps=1", timeout=900, compile_as_user=True)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the launch's peak (the largest child yet)
    assert sorted(os.listdir(run / "checkpoints")) == ["1"]
    second = launch(*args, "trainer.total_steps=2", "--resume", timeout=900, compile_as_user=True)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from checkpoint   1" in second.stdout
    rows = [r for r in metrics(run) if "actor/pg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    ledger = json.loads((run / "memory_ledger.json").read_text())
    params = next(r for r in ledger["rows"] if r["item"] == "parameters")
    assert params["measured_bytes"] > 1.3e9  # 24 layers x 896 in float32: the preset's body, not a toy

    out = tmp_path / "hf"
    export = subprocess.run([sys.executable, "-m", "rljax.export", str(run), "--to", "hf", str(out)], cwd=REPO,
                            env=launch_env(compile_as_user=True), capture_output=True, text=True, timeout=600)
    assert export.returncode == 0, export.stderr[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 24 and config["hidden_size"] == 896 and config["intermediate_size"] == 4864
    assert "tokenizer.json" in os.listdir(out)

    # the plan of this very run (the compiled update's analysis) against what the run's own ledger measured
    plan = launch(*[a for a in args if not a.startswith("--run-dir") and a != str(run)], "--plan",
                  "--device-memory", "64GiB", timeout=900, compile_as_user=True)
    assert plan.returncode == 0, plan.stdout[-3000:] + plan.stderr[-3000:]
    total = _gib(re.search(r"^  total\s+(.*)$", plan.stdout, re.M).group(1))
    xla = ledger["stages"]["update_actor"]["peak"] + ledger["stages"]["gen"]["peak"]  # the run's own analyses
    print(f"plan {total / 2**30:.2f} GiB, XLA update + sampler {xla / 2**30:.2f} GiB, peak RSS {rss / 2**30:.2f} GiB")
    assert xla / 1.5 < total < 1.5 * xla, (total, xla, plan.stdout)
    assert rss / 1.5 < total < 1.5 * rss, (total, rss, plan.stdout)


def _gib(text: str) -> float:
    number, unit = text.split()[:2]
    return float(number) * (2**30 if unit == "GiB" else 2**20)
