"""On-policy distillation (``distillation.*``, issue 37) with ``trainer.mode=async`` and with several
processes, through ``python -m rljax.launch``.

The teacher stage runs on the learner after ``dequeue`` (rljax/trainer/async_loop.py: the learner's
stages are the synchronous list minus the producer's), so the teacher scores the very tokens the
update trains, whatever their staleness, and its ``[B, T, K]`` fields never travel through the
trajectory queue. The teacher is a real one: a random tiny model of another seed than the policy's,
saved as a Hugging Face directory once for the module, so ``distillation/loss`` is not 0 at step 1
(``ref`` would be the policy itself there).

* tau=0 gives the synchronous run's metrics step for step, ``distillation/*`` and the losses included;
* tau=1 (weights pushed every second update, so the second batch is trained one version stale) passes
  the checks of ``python -m rljax.trace check``, logs ``distillation/*`` every step, and each step's
  ``distillation/teacher_mass`` (mean / min / max over the response tokens: a function of the teacher
  and the tokens alone) equals the teacher's top-k mass recomputed here, with full logits, on the
  tokens that step trained (``trace.rollout_dump``);
* two local processes (``launch/local_multiprocess.sh 2``, one CPU device each, async tau=0) give the
  one-process synchronous run's metrics.

All slow (real runs), kept small: 2 steps of 4 prompts x 2 samples, dp2, top-k 8."""

import json
import os
import subprocess

import numpy as np
import pytest

from launching import REPO, assert_same_metrics, launch, launch_env, metrics, train_rows

#: The distillation run at its smallest: dp2, 4 prompts x 2 samples a step, one mini-batch, the top-k
#: forward KL over the teacher's 8 most likely tokens (the teacher's path is added by each test).
#: The shapes of tests/launch/test_distill_learning.py's top-k run (its teacher is ``ref``): a slow pass that ran it
#: first loads most of these runs' programs from the shared compilation cache.
BASE = ["--mesh=dp2", "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4",
        "data.embedded.num_train=16", "data.embedded.num_test=4", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.save_freq=-1", "distillation.enabled=true",
        "distillation.distillation_loss.loss_mode=forward_kl_topk", "distillation.distillation_loss.topk=8"]
ASYNC_TAU0 = ["trainer.mode=async", "async_training.max_staleness=0"]
TOPK = 8

#: Not compared: wall clocks, throughput, memory, per-process facts, the queue's counts (a sync run has none).
_SKIP = ("timing_s/", "comm_s/", "perf/", "trace/", "memory/", "async/", "alerts/", "invariants/")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """``(path, graphdef, params)``: the default preset's tiny model initialised with seed 7 (the
    policy's is 0), saved as a Hugging Face directory: the policy's vocabulary, other weights."""
    from rljax.config import resolve
    from rljax.models.hf import save_hf_checkpoint
    from rljax.models.tokenizer import CharTokenizer
    from rljax.trainer.build import model_for

    cfg, _ = resolve("default", ["trainer.seed=7"])
    mcfg, graphdef, params = model_for(cfg, None, CharTokenizer())
    path = tmp_path_factory.mktemp("distill") / "teacher"
    save_hf_checkpoint(str(path), mcfg, params)
    return str(path), graphdef, params


@pytest.fixture(scope="module")
def sync_run(teacher, tmp_path_factory):
    """The one-process synchronous run, 2 steps: what the tau=0 and the two-process runs must equal."""
    run = tmp_path_factory.mktemp("distill") / "sync"
    out = launch(*BASE, "trainer.total_steps=2", f"distillation.teacher_model.model_path={teacher[0]}",
                 "--run-dir", str(run))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = train_rows(run)
    assert len(rows) == 2 and all(r["distillation/loss"] > 1e-3 for r in rows), rows  # a teacher unlike the policy
    return run


def _distill_keys(row) -> set:
    return {k for k in row if k.startswith("distillation/")}


@pytest.mark.slow
def test_async_tau0_distillation_equals_sync(teacher, sync_run, tmp_path):
    run = tmp_path / "async"
    out = launch(*BASE, *ASYNC_TAU0, "trainer.total_steps=2", f"distillation.teacher_model.model_path={teacher[0]}",
                 "--run-dir", str(run))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    s, a = metrics(sync_run), metrics(run)
    assert_same_metrics(s, a, skip=_SKIP)
    rows = train_rows(run)
    assert all(r["async/staleness_max"] == 0 for r in rows)
    expected = {"distillation/loss", "distillation/loss_min", "distillation/loss_max", "distillation/teacher_mass",
                "distillation/student_mass"}
    assert all(expected <= _distill_keys(r) for r in rows), [sorted(_distill_keys(r)) for r in rows]


def _teacher_topk_mass(graphdef, params, prompt, response, temperature=1.0):
    """The teacher's top-``TOPK`` probability mass at each response position of one row (hidden
    ``len(prompt) - 1 + t`` predicts response token ``t``), from its full logits."""
    import jax
    import jax.numpy as jnp

    from rljax.models import functional as F

    ids = jnp.asarray([list(prompt) + list(response)], jnp.int32)
    hidden = F.forward(graphdef, params, ids)
    logits = jnp.einsum("bld,dv->blv", hidden.astype(jnp.float32), F.unembedding(params).astype(jnp.float32))
    p = len(prompt)
    logp = jax.nn.log_softmax(logits[0, p - 1: p - 1 + len(response)] / temperature, -1)
    return np.asarray(jnp.sum(jnp.exp(jax.lax.top_k(logp, TOPK)[0]), -1))


def _dumped_rows(run_dir, step, pad_id):
    """The (prompt, response) token lists process 0 trained at ``step`` (``trace.rollout_dump``)."""
    z = np.load(os.path.join(str(run_dir), "rollouts", "process0", f"step{step}.npz"))
    out = []
    for i in range(len(z["uid"])):
        if z["is_padding"][i]:
            continue
        prompt = [int(t) for t in z["prompt_ids"][i] if t != pad_id]  # prompts are left-padded
        out.append((prompt, [int(t) for t in z["response_ids"][i][:int(z["response_length"][i])]]))
    return out


@pytest.mark.slow
def test_async_tau1_distillation_scores_the_trained_tokens_and_checks(teacher, tmp_path):
    from rljax.models.tokenizer import CharTokenizer

    path, graphdef, params = teacher
    run = tmp_path / "tau1"
    out = launch(*BASE, "trainer.mode=async", "async_training.max_staleness=1",
                 "async_training.trigger_parameter_sync_step=2", "trainer.total_steps=2", "trace.rollout_dump=true",
                 f"distillation.teacher_model.model_path={path}", "--run-dir", str(run))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = train_rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["async/weight_pushes"] for r in rows] == [0, 1]  # every second update
    assert [r["async/staleness_max"] for r in rows] == [0, 1]  # batch 2: generated by version 0, trained at 1
    assert all({"distillation/loss", "distillation/teacher_mass", "distillation/student_mass"} <= _distill_keys(r)
               and r["distillation/loss"] > 1e-3 for r in rows), rows

    # The teacher scored the tokens each step trained: its top-k mass over them, recomputed here.
    pad = CharTokenizer().pad_id
    for r in rows:
        trained = _dumped_rows(run, r["step"], pad)
        assert len(trained) == 8
        mass = np.concatenate([_teacher_topk_mass(graphdef, params, p, t) for p, t in trained])
        got = (r["distillation/teacher_mass"], r["distillation/teacher_mass_min"], r["distillation/teacher_mass_max"])
        np.testing.assert_allclose(got, (mass.mean(), mass.min(), mass.max()), rtol=1e-4, err_msg=str(r["step"]))

    # python -m rljax.trace check's checks, run here (a process less)
    from rljax.trace.check import run_checks

    results = run_checks(str(run))
    assert not [r for r in results if r[0] == "FAIL"], results
    passed = {r[1] for r in results if r[0] == "PASS"}
    for name in ("trained staleness within tau", "every prompt trained once", "token versions tie to min_version",
                 "loss_mask consumed by the update == rollout's response_mask"):
        assert name in passed, results


@pytest.mark.slow
def test_two_processes_async_distillation_equals_one_process(teacher, sync_run, tmp_path):
    two = tmp_path / "two"
    out = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", *BASE, *ASYNC_TAU0,
                          "trainer.total_steps=2", f"distillation.teacher_model.model_path={teacher[0]}",
                          "--run-dir", str(two)],
                         cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    topo = json.loads((two / "topology.json").read_text())
    assert topo["process_count"] == 2 and topo["rollout_share"]["prompts_by_process"] == {"0": [0, 2], "1": [2, 4]}
    assert_same_metrics(metrics(sync_run), metrics(two), skip=_SKIP)
    assert all(r["distillation/loss"] > 1e-3 for r in train_rows(two))
