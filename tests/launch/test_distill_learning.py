"""Issue 37's learning criterion for on-policy distillation, end to end as a user runs it: the
default run's trained policy (tests/conftest.py's ``default_run``, shared with
tests/launch/test_learning.py) is exported as a Hugging Face directory (``python -m rljax.export
--to hf``) and is the teacher of an untrained student of the same preset, trained with the task
reward switched off (``distillation.distillation_loss.use_task_rewards=false``): the student's
held-out reward, which only the teacher can raise, goes up and ``distillation/loss`` falls.

Seen failing (the report of the commit that added it): the teacher's log-probs taken one position
late, and the distillation term's weight 0.

And the top-k forward KL (``loss_mode=forward_kl_topk``) launched as a user runs it on dp2: the
teacher stage's ``teacher_topk_ids`` / ``teacher_topk_logp`` ``[B, T, K]`` reach the update and
``python -m rljax.trace check`` passes on the run."""

import json
import subprocess
import sys

import pytest

from launching import launch, train_rows

#: The student's run: the default preset (an untrained tiny policy), 120 steps, the teacher's
#: per-token reverse-KL estimate k1 as the advantage of a PPO-clip loss (verl's on-policy
#: distillation as a reward), alone.
STUDENT = ("--mesh=dp1", "trainer.total_steps=120", "trainer.test_freq=40", "trainer.save_freq=-1",
           "actor.optim.lr=1e-3", "distillation.enabled=true", "distillation.distillation_loss.loss_mode=k1",
           "distillation.distillation_loss.use_task_rewards=false")


@pytest.mark.slow
def test_distillation_from_a_trained_teacher_raises_an_untrained_students_held_out_reward(default_run, tmp_path):
    from rljax.export import main as export

    teacher_run, _ = default_run
    teacher_val = [r["val/score/mean"] for r in map(json.loads, open(teacher_run / "metrics.jsonl"))
                   if "val/score/mean" in r]
    assert teacher_val[-1] >= 0.8, teacher_val  # a trained teacher (README: 0.965)
    assert export([str(teacher_run), str(tmp_path / "teacher"), "--to", "hf"]) == 0

    run = tmp_path / "student"
    out = launch(*STUDENT, f"distillation.teacher_model.model_path={tmp_path / 'teacher'}", "--run-dir", str(run),
                 timeout=900, compile_as_user=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    val = [r["val/score/mean"] for r in rows if "val/score/mean" in r]
    assert val[0] < 0.05 and val[-1] >= 0.5, val  # measured (steps 0, 40, 80, 120): 0.005, 0.000, 0.520, 0.902

    loss = [r["distillation/loss"] for r in train_rows(run)]
    first, last = sum(loss[:10]) / 10, sum(loss[-10:]) / 10
    assert len(loss) == 120 and last < 0.25 * first, (first, last)  # measured: 4.01 -> 0.149
    check = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stdout


@pytest.mark.slow
def test_forward_kl_topk_runs_and_its_trace_checks(tmp_path):
    run = tmp_path / "topk"
    out = launch("--mesh=dp2", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
                 "data.embedded.num_train=16", "data.embedded.num_test=4", "trainer.test_freq=-1",
                 "trainer.val_before_train=false", "trainer.total_steps=2", "trainer.save_freq=-1",
                 "distillation.enabled=true", "distillation.teacher_model.model_path=ref",
                 "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=8",
                 "--run-dir", str(run), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = train_rows(run)
    assert len(rows) == 2
    first = rows[0]  # the teacher is the policy before its first update: the same top-k mass, a zero loss
    assert abs(first["distillation/loss"]) < 1e-6 and 0 < first["distillation/teacher_mass"] < 1, first
    assert abs(first["distillation/student_mass"] - first["distillation/teacher_mass"]) < 1e-6, first
    fields = {(f["name"], tuple(f["shape"])) for r in map(json.loads, open(run / "trace.jsonl"))
              for f in r.get("fields", []) if f["name"].startswith("teacher")}
    assert {name for name, _ in fields} == {"teacher_topk_ids", "teacher_topk_logp"}, fields
    assert all(len(shape) == 3 and shape[0] == 8 and shape[2] == 8 for _, shape in fields), fields
    check = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], capture_output=True, text=True,
                           timeout=300)
    assert check.returncode == 0, check.stdout
    assert "reward / old,ref log-prob / advantage producers and consumers" in check.stdout
