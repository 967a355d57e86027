"""bench/accelerator.py --smoke: every part of the accelerator report runs on this CPU (tiny
shapes, the same code paths) and both reports carry each part's numbers."""

import json
import math
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# part -> result keys that must be finite numbers on any backend (MFU and peak memory are
# absent on CPU: no published peak, no allocator statistics)
NUMBERS = {
    "default_run": ("wall_s", "time_to_first_step_s", "step_s_median", "val_reward_before", "val_reward_after"),
    "qwen": ("step_s", "gen_s", "old_log_prob_s", "update_actor_s", "weight_sync_s", "decode_tokens_per_s",
             "rollout_tokens_per_s", "learner_s"),
    "async_model": ("t_step", "learner_s", "sync_s"),
}


def _finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.slow
def test_smoke_writes_every_part(tmp_path):
    from launching import TEST_XLA_FLAGS

    # one CPU device, as a user's run, compiling as the launched tests' runs do (tests/launching.py):
    # its parts' tiny programs cost more to compile than to run
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "XLA_FLAGS": TEST_XLA_FLAGS}
    env["JAX_PLATFORMS"] = "cpu"
    out = tmp_path / "report"
    p = subprocess.run([sys.executable, "bench/accelerator.py", "--smoke", "--out", str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-2000:]
    doc = json.loads((out / "accelerator.json").read_text())
    md = (out / "accelerator.md").read_text()
    assert list(doc["parts"]) == ["default_run", "qwen", "logprob", "losses", "async_model"]
    for name, part in doc["parts"].items():
        assert part["status"] == "ok", (name, part.get("error"))
        assert f"## {name}\n" in md
        for key in NUMBERS.get(name, ()):
            assert _finite(part["result"][key]), (name, key, part["result"][key])
    qwen = doc["parts"]["qwen"]["result"]
    assert qwen["steps"] == 2 and qwen["trajectories"] == 8
    rows = doc["parts"]["logprob"]["result"]["rows"]
    assert {r["impl"] for r in rows} == {"naive", "chunked", "pal-gpu"}
    for r in rows:  # every path ran and matches the float64 reference
        assert "error" not in r, r
        assert r["diff_values"] < 1e-4 and r["diff_grads"] < 0.05 * r["grad_scale"], r
    losses = doc["parts"]["losses"]["result"]["rows"]
    assert len(losses) >= 20
    for r in losses:
        assert "error" not in r and r["default"] < 1e-4 and r["highest"] < 1e-4, r
    # a float64 reference where the function keeps its inputs' dtype (x64 on in that process)
    assert {r["reference"] for r in losses if r["function"].startswith(("policy_loss", "kl_penalty"))} == {"float64"}
    assert doc["parts"]["async_model"]["result"]["speedups"], "no prediction parsed"
    assert "TIMEOUT" not in md and "FAILED" not in md and "| - |" not in md.split("## qwen")[0]
