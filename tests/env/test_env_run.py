"""A multi-turn run end to end: the launcher with a user's environment file on a dp2,tp2,sp2
mesh, then ``python -m rljax.trace check`` with the observation check PASS (not N/A)."""

import json
import subprocess
import sys
import textwrap

import pytest

from launching import launch
from test_launch import SMALL
from test_trace_run import REPO

ENV_FILE = textwrap.dedent("""
    from rljax.env import Environment, Step

    class AlwaysObserve(Environment):
        '''Answers the first turn with an observation (whatever the model wrote), then ends.'''

        def step(self, turn):
            if turn.index == 0:
                return Step(observation="=" + self.example.answer, tool="reveal")
            return Step()  # reward.function scores the final turn
""")


@pytest.mark.slow
def test_multi_turn_run_passes_the_trace_check_with_observations(tmp_path):
    env_file = tmp_path / "my_env.py"
    env_file.write_text(ENV_FILE)
    run = tmp_path / "run"
    out = launch("--mesh=dp2,tp2,sp2", "--config", "tool_lookup", "--run-dir", str(run), *SMALL,
                 "trainer.total_steps=2", f"env.function={env_file}:AlwaysObserve", "env.max_turn_tokens=2",
                 "data.max_response_length=6")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    check = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], cwd=REPO, capture_output=True,
                           text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    line = next(ln for ln in check.stdout.splitlines() if "response_mask.sum()" in ln)
    assert line.startswith("PASS") and "observation tokens (mask 0, rollout log-prob 0" in line, line
    na = [ln for ln in check.stdout.splitlines() if ln.startswith("N/A")]
    assert " 0 failed" in check.stdout and all("synchronous run" in ln or "filter_groups.enable is false" in ln for ln in na), check.stdout  # async-only N/A
    rows = [json.loads(ln) for ln in open(run / "metrics.jsonl") if ln.strip()]
    last = rows[-1]
    assert last["env/num_turns/mean"] == 2.0 and last["env/obs_tokens/mean"] == 2.0  # "=" + one digit
    assert last["env/tool_calls"] == 32 and last["env/tool_errors"] == 0 and "timing_s/env" in last
    recs = [json.loads(ln) for ln in open(run / "trace.jsonl")]
    roll = next(r for r in recs if r["stage"] == "rollout_sessions")
    t = roll["trajectories"][0]
    assert t["num_turns"] == 2 and t["observation_tokens"] == 2 and t["obs_mask_sum"] == 0
    assert [s[2] for s in t["role_spans"]][1] == 2  # the observation span (Role.TOOL_RESULT)
    assert roll["episode"]["context"].startswith("kv: sessions keep their slot")  # env.continuation=kv (default)
    assert roll["episode"]["prefill_tokens"] > 0 and t["tool_s"] >= 0 and t["env_wait_s"] > 0
    # The check can fail: an observation token recorded with mask 1 is reported.
    for r in recs:
        if r["stage"] == "rollout_sessions":
            for t in r["trajectories"]:
                t["obs_mask_sum"] = 1
    (run / "trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    broken = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], cwd=REPO, capture_output=True,
                            text=True, timeout=300)
    assert broken.returncode == 1 and "observation tokens with mask 1: 1" in broken.stdout, broken.stdout
