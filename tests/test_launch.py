"""`python -m rljax.launch`: usage errors, end-to-end smoke runs, resume equivalence.

Every run is a real subprocess (a fresh JAX: the launcher sets the device count itself).
"""

import json
import math
import os
import subprocess
import sys

import pytest

from rljax.trace import read_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A small, fast configuration of the embedded default.
SMALL = ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.embedded.num_train=64",
         "data.embedded.num_test=16", "trainer.test_freq=-1", "trainer.val_before_train=false"]


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the launcher must create the devices itself
    env.pop("JAX_PLATFORMS", None)
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    return env


def launch(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "rljax.launch", *args], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _train_rows(run_dir):
    """The per-step training records (not the data counts at step 0 nor the final validation)."""
    return [r for r in _metrics(run_dir) if "actor/pg_loss" in r]


@pytest.mark.parametrize("args,message", [
    (["actor.optim.lr=abc"], "actor.optim.lr"),
    (["rollout.nn=4"], "did you mean"),
    (["rollout.n=0"], "rollout.n"),
    (["actor.policy_loss=ppo2"], "vanilla"),
    (["data.train_batch_size=6", "actor.ppo_mini_batch_size=4"], "ppo_mini_batch_size"),
    (["--mesh=dp8", "data.train_batch_size=3", "rollout.n=2", "actor.ppo_mini_batch_size=1"], "dp=8"),
    (["--mesh=xp2"], "unknown axis 'xp'"),
    (["--mesh=dp0"], "positive"),
    (["overridewithoutequals"], "key=value"),
])
def test_usage_errors_exit_2_in_one_line_and_write_nothing(tmp_path, args, message):
    run_dir = tmp_path / "run"
    out = launch("--run-dir", str(run_dir), *args, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [l for l in out.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert not run_dir.exists()


def test_existing_checkpoints_need_resume(tmp_path):
    (tmp_path / "checkpoints" / "3").mkdir(parents=True)
    out = launch("--run-dir", str(tmp_path), timeout=120)
    assert out.returncode == 2 and "--resume" in out.stderr


def _smoke(tmp_path, mesh):
    run_dir = tmp_path / "run"
    out = launch(f"--mesh={mesh}", "--run-dir", str(run_dir), *SMALL, "trainer.total_steps=2", "trainer.save_freq=1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 2]  # data counts at 0; the final validation adds to step 2
    assert rows[0]["data/prompts_total"] == 64 and rows[0]["data/prompts_filtered"] == 0
    rows = rows[1:]
    for r in rows[:2]:
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "critic/score/mean",
                    "response_length/mean", "timing_s/gen", "timing_s/update_actor", "timing_s/step",
                    "perf/throughput"):
            assert r[key] is not None and math.isfinite(r[key]), key
    assert rows[1]["training/weight_version"] == 2
    topo = json.loads((run_dir / "topology.json").read_text())
    assert topo["world_size"] == 8 and topo["actor_dp"] == 8 // (topo["mesh"]["tp"] * topo["mesh"]["sp"])
    assert "rollout_tp" in topo and "actor_dp_derivation" in topo
    resolved = (run_dir / "config.resolved.yaml").read_text()
    assert "# from: cli" in resolved
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["1", "2"]
    assert (run_dir / "report.png").stat().st_size > 1000
    assert "held-out reward after" in out.stdout
    return rows


def test_smoke_dp8(tmp_path):
    _smoke(tmp_path, "dp8")


@pytest.mark.slow
def test_smoke_dp2_tp2_sp2(tmp_path):
    _smoke(tmp_path, "dp2,tp2,sp2")


@pytest.mark.slow
def test_resume_gives_the_uninterrupted_metrics(tmp_path):
    base = ["--mesh=dp2", *SMALL, "trainer.save_freq=2"]
    full = launch("--run-dir", str(tmp_path / "full"), *base, "trainer.total_steps=4")
    assert full.returncode == 0, full.stderr[-3000:]
    half = launch("--run-dir", str(tmp_path / "half"), *base, "trainer.total_steps=2")
    assert half.returncode == 0, half.stderr[-3000:]
    resumed = launch("--run-dir", str(tmp_path / "half"), "--resume", *base, "trainer.total_steps=4")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restored step 2" in resumed.stdout
    a = {r["step"]: r for r in read_metrics(str(tmp_path / "full"))}  # records of a step merged
    b = {r["step"]: r for r in read_metrics(str(tmp_path / "half"))}
    for step in (3, 4):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "response_length/mean"):
            assert math.isclose(a[step][key], b[step][key], rel_tol=1e-5, abs_tol=1e-6), (step, key)


@pytest.mark.slow
def test_two_local_processes_match_one_process(tmp_path):
    """launch/local_multiprocess.sh: 2 processes x 2 CPU devices, --mesh=dp4, CPU collectives;
    the same metrics as one process with 4 devices."""
    args = ["--mesh=dp4", *SMALL, "trainer.total_steps=2"]
    one = launch("--run-dir", str(tmp_path / "one"), *args)
    assert one.returncode == 0, one.stderr[-3000:]
    two = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2",
                          "--run-dir", str(tmp_path / "two"), *args],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    topo = json.loads((tmp_path / "two" / "topology.json").read_text())
    assert topo["process_count"] == 2 and topo["world_size"] == 4 and topo["devices_per_process"] == 2
    a, b = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "val/score/mean"):
            if key in ra:
                assert math.isclose(ra[key], rb[key], rel_tol=1e-5, abs_tol=1e-6), (ra["step"], key)


PLUGIN = '''
def reward(response, answer, **extra):
    if answer == "4":
        raise RuntimeError("this reward function cannot score a 4")
    return float(response.strip() == answer)
'''


def _plugin(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(PLUGIN)
    return f"reward.function={path}:reward"


@pytest.mark.slow
def test_reward_errors_over_the_limit_stop_the_run(tmp_path):
    out = launch("--mesh=dp2", "--run-dir", str(tmp_path / "run"), *SMALL, _plugin(tmp_path),
                 "reward.max_error_fraction=0.0", "trainer.total_steps=2")
    assert out.returncode == 1
    assert "RewardError" in out.stderr and "cannot score a 4" in out.stderr


@pytest.mark.slow
def test_reward_errors_under_the_limit_score_zero_and_are_counted(tmp_path):
    run_dir = tmp_path / "run"
    out = launch("--mesh=dp2", "--run-dir", str(run_dir), *SMALL, _plugin(tmp_path),
                 "reward.max_error_fraction=1.0", "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    rows = _train_rows(run_dir)
    assert sum(r["reward/errors"] for r in rows) > 0
    assert all(0 <= r["reward/error_fraction"] < 1 for r in rows)
    assert "cannot score a 4" in out.stderr  # the failing uid is logged


@pytest.mark.slow
def test_ppo_with_gae_and_kl(tmp_path):
    run_dir = tmp_path / "run"
    out = launch("--mesh=dp2,sp2", "--run-dir", str(run_dir), *SMALL, "algorithm.adv_estimator=gae",
                 "algorithm.lam=0.95", "actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true",
                 "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    for r in _train_rows(run_dir):
        for key in ("critic/vf_loss", "critic/values/mean", "critic/returns/mean", "actor/kl_loss", "critic/kl"):
            assert r[key] is not None and math.isfinite(r[key]), key


@pytest.mark.slow
def test_sigkill_during_training_resumes_from_the_last_complete_checkpoint(tmp_path):
    """Kill -9 the run while it saves every step; --resume restarts from a complete checkpoint."""
    import signal
    import time

    run_dir = tmp_path / "run"
    args = ["--mesh=dp2", "--run-dir", str(run_dir), *SMALL, "trainer.save_freq=1"]
    proc = subprocess.Popen([sys.executable, "-m", "rljax.launch", *args, "trainer.total_steps=200"], cwd=REPO,
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ckpt = run_dir / "checkpoints"
    deadline = time.time() + 400
    while time.time() < deadline and not (ckpt.exists() and len([p for p in ckpt.iterdir() if p.name.isdigit()]) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    complete = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())
    assert complete, "no checkpoint was written before the kill"
    resumed = launch("--resume", *args, f"trainer.total_steps={complete[-1] + 1}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"restored step {complete[-1]}" in resumed.stdout or f"restored step {complete[-2]}" in resumed.stdout
    assert _metrics(run_dir)[-1]["step"] == complete[-1] + 1


@pytest.mark.slow
def test_bypass_mode_trains_on_rollout_log_probs(tmp_path):
    run_dir = tmp_path / "run"
    out = launch("--mesh=dp2", "--run-dir", str(run_dir), *SMALL, "algorithm.bypass_mode=true", "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    for r in _train_rows(run_dir):
        assert "timing_s/old_log_prob" not in r  # no learner pass for old_logp
        assert math.isfinite(r["actor/ppo_kl"]) and math.isfinite(r["actor/pg_loss"])
