"""Data-flow bugs provoked on purpose (rljax.trace.faults, switched on by RLJAX_FAULTS) in short
runs: each makes ``python -m rljax.trace check`` fail, naming the tensor, the step and the uid,
and the run exit 3 (an error-severity alert); the observation ones on the tool task. The whole-batch invariants cover rows outside the
traced prompt groups: every fault here hits an untraced row. Each launch first asserts that its fault acted
(the run's ``rljax faults:`` line, :func:`assert_acted`): an armed fault with nothing to act on leaves a run that
passes, and a test of its check that cannot fail."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from launching import REPO, launch_env
from test_launch import SMALL


def test_position_digest_sees_positions_not_counts():
    import jax.numpy as jnp

    from rljax.trace.invariants import compare, host_row_facts, position_digest

    mask = np.zeros((3, 12), bool)
    mask[:, 2:7] = True
    ids = np.arange(36).reshape(3, 12) * 7919
    shifted = np.roll(mask, 1, axis=1)
    assert (position_digest(mask) != position_digest(shifted)).all()
    # the learner's wider (sp-rounded) copy on device agrees with the sampler's host arrays
    wide = np.pad(mask, ((0, 0), (0, 4))).astype(np.float32)
    dev = np.asarray(position_digest(jnp.asarray(wide), jnp.asarray(np.pad(ids, ((0, 0), (0, 4))), jnp.int32)))
    assert (dev == position_digest(mask, ids)).all()
    rollout = host_row_facts(mask, ids)
    update = host_row_facts(np.stack([mask[0], shifted[1], mask[2]]), ids)
    keys = ("1-0_0_0", "1-0_1_1", "1-1_0_2")
    counts, v = compare(1, keys, np.ones(3, bool), rollout, update, max_version=np.array([0, 0, 2]),
                        learner_version=1)
    assert counts == {"rows": 3, "violations": 2}
    assert [(x["tensor"], x["key"], x["uid"]) for x in v] == [("loss_mask", "1-0_1_1", "1-0"),
                                                              ("max_version", "1-1_0_2", "1-1")]


@pytest.mark.parametrize("on_host", [False, True])
def test_step_facts_one_reduction_equals_the_host_facts(on_host):
    """The tracer's fused device reduction (every pair's facts, the row sums, the scores, one
    transfer) gives, bit for bit, what the host computes from the same arrays: on dp8-sharded
    rows, a learner mask wider than the sampler's (sp rounding), ids with prompt columns. Both
    ways of running it: the program over every device (accelerators) and, on a CPU mesh, one
    host copy of the inputs reduced by one device's program."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from rljax.trace.invariants import host_row_facts, position_digest, step_facts

    rng = np.random.default_rng(0)
    B, S, T = 16, 5, 7
    mask = rng.random((B, T)) < 0.6
    ids = rng.integers(0, 50_000, (B, S + T)).astype(np.int32)
    obs = rng.random((B, T)) < 0.2
    scores = np.array([0.5, -0.0, 1e-30, 3.0] * 4, np.float32)
    mesh = jax.make_mesh((8,), ("dp",))
    rows = NamedSharding(mesh, PartitionSpec("dp"))
    lm = jax.device_put(np.pad(mask, ((0, 0), (0, 1))).astype(np.float32), rows)  # T' = 8
    wide_ids = jax.device_put(np.pad(ids, ((0, 0), (0, 1))), rows)
    other = jax.device_put(jnp.roll(lm, 1, axis=1), rows)  # a second, different mask read by another stage
    per_pair, extra = step_facts([(lm, wide_ids), (other, None)], obs, lm, jax.device_put(scores, rows),
                                 on_host=on_host)
    want = host_row_facts(mask, ids[:, S:])
    assert set(per_pair[0]) == {"tokens", "mask_digest", "token_digest", "observation_tokens"}
    for k in ("tokens", "mask_digest", "token_digest"):
        assert per_pair[0][k].dtype == want[k].dtype and (per_pair[0][k] == want[k]).all(), k
    assert (per_pair[0]["observation_tokens"] == (mask & obs).sum(axis=1)).all()
    assert set(per_pair[1]) == {"tokens", "mask_digest", "observation_tokens"}
    assert (per_pair[1]["mask_digest"] == position_digest(np.roll(np.pad(mask, ((0, 0), (0, 1))), 1, axis=1))).all()
    assert extra["row_sum"].dtype == np.float32 and (extra["row_sum"] == mask.sum(axis=1)).all()
    assert extra["scores"].tobytes() == scores.tobytes()  # bit for bit, -0.0 and denormals included


def test_scores_are_tied_to_the_trajectory_they_scored():
    from rljax.trace.invariants import compare_scores

    digest = np.array([11, 22, 33, 44], np.uint32)
    scored = {"digest": digest, "scores": np.array([1.0, 0.0, 0.5, 0.0], np.float32)}
    keys = ("1-0_0_0", "1-0_1_1", "1-1_0_2", "1-1_1_3")
    ok = compare_scores(1, keys, np.ones(4, bool), digest, scored, scored["scores"])
    assert ok == ({"violations": 0}, [])
    swapped = np.array([0.5, 0.0, 1.0, 0.0], np.float32)  # rows 0 and 2 (groups 1-0 and 1-1) swapped
    counts, v = compare_scores(1, keys, np.ones(4, bool), digest, scored, swapped)
    assert counts == {"violations": 2} and [(x["tensor"], x["uid"]) for x in v] == [("scores", "1-0"), ("scores", "1-1")]
    assert "score 0.5 read by the advantages, the reward stage scored this trajectory 1" in v[0]["detail"]


def test_unknown_fault_is_one_clear_error():
    from rljax.trace import faults

    with pytest.raises(ValueError, match="unknown fault.*nope; accepted: keep_batch_field"):
        faults.enable("nope")


def assert_acted(out, *names):
    """Every fault in ``names`` acted in the launch ``out`` (its stderr's ``rljax faults:`` line)."""
    from rljax.trace import faults

    acted = faults.acted_in(out.stderr)
    never = [n for n in names if not acted.get(n)]
    line = next((x for x in out.stderr.splitlines() if x.startswith("rljax faults: ")), "no 'rljax faults:' line")
    assert not never, (f"fault(s) {', '.join(never)} armed but never acted in this run, so its check could not "
                       f"fail: give it something to act on; the run said: {line}")


def test_a_fault_says_whether_it_acted():
    """The report line and its reader: a fault that acted, one whose hook ran with nothing to act on, one whose
    hook never ran; several processes' lines are summed."""
    from rljax.trace import faults

    faults.enable("keep_batch_field", "observation_loss_mask", "swap_rewards")
    try:
        assert faults.active("keep_batch_field") and faults.acts("keep_batch_field") == 1
        faults.learner_fields({}, _NoObservation(), seed=0, step=1, groups=1, version=0)
        line = faults.report()
    finally:
        faults.disable()
    assert line == ("rljax faults: keep_batch_field acted 1 of 1; observation_loss_mask acted 0 of 1 (NEVER ACTED: "
                    "nothing to act on); swap_rewards acted 0 of 0 (NEVER ACTED: no hook of it ran)")
    assert faults.acted_in(f"x\n{line}\n{line}\n") == {"keep_batch_field": 2, "observation_loss_mask": 0,
                                                        "swap_rewards": 0}
    assert faults.report() == "" and faults.acts("keep_batch_field") == 0  # disabled: nothing armed, counts gone


class _NoObservation:
    """A multi-turn batch of two rows, neither with a tool observation."""
    batch_size, num_groups = 2, 2
    is_padding = np.zeros(2, bool)
    group_id = np.array([0, 1])
    roles = np.zeros((2, 4), np.int32)


TOOL_TASK = ("--config", "tool_lookup")
TOOL_ROWS = ("data.train_batch_size=32", "rollout.n=16", "actor.ppo_mini_batch_size=16", "trainer.total_steps=1")


@pytest.mark.slow
@pytest.mark.parametrize("fault,tensor,detail,preset,extra", [
    ("zero_loss_mask_token", "loss_mask", "loss tokens in the update", (), ("trainer.total_steps=1",)),
    # rows that end before the last column (EOS), so the mask can shift by one position
    ("shift_loss_mask", "loss_mask", "same token count, different positions", (),
     ("trainer.total_steps=1", "data.max_response_length=16")),
    ("swap_rewards", "scores", "read by the advantages", (), ("trainer.total_steps=1",)),
    # the tool task: a random policy calls the tool ('?') in ~1% of rows (env/tool_calls 7 of 512 at this seed), so
    # one step of the preset's own 512 rows (32 prompts x 16) holds untraced rows with an observation (3 steps of 32
    # rows had none once the sampling changed: the fault never acted and the run passed)
    ("observation_action_mask", "loss_mask", "observation token(s) with mask 1", TOOL_TASK, TOOL_ROWS),
    ("observation_loss_mask", "loss_mask", "loss tokens in the update", TOOL_TASK, TOOL_ROWS),
    # multi-turn swap_rewards (the episode reward stage's record): test_recompute_faults.py's multi-turn launch
    # dynamic sampling: the kept rows' scores, recorded where they were scored
    ("swap_rewards", "scores", "read by the advantages", ("algorithm.filter_groups.enable=true",),
     ("trainer.total_steps=1",)),
])
def test_fault_fails_the_check_naming_tensor_step_and_uid(tmp_path, fault, tensor, detail, preset, extra):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rljax.launch", "--mesh=dp2", *preset, "--run-dir", str(run), *SMALL,
                          *extra], cwd=REPO, env=dict(launch_env(), RLJAX_FAULTS=fault),
                         capture_output=True, text=True, timeout=600)
    assert_acted(out, fault)
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    inv = json.loads((run / "trace_summary.json").read_text())["invariants"]
    v = inv["violations"][0]
    step = v["step"]
    traced = {json.loads(line)["uid"] for line in open(run / "trace.jsonl") if json.loads(line)["step"] == step}
    assert v["tensor"] == tensor and detail in v["detail"] and v["uid"] not in traced, (v, traced)
    check = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
    line = next(x for x in check.stdout.splitlines() if "whole-batch invariants" in x)
    assert check.returncode == 1 and line.startswith("FAIL"), check.stdout
    assert f"step {step} tensor {tensor}" in line and f"uid {v['uid']}" in line and detail in line, line


@pytest.mark.slow
def test_two_processes_check_their_own_rows_and_combine_the_verdict(tmp_path):
    """launch/local_multiprocess.sh, 2 processes x 2 CPU devices: each process checks the rows it
    generated against the global learner arrays; the verdicts are combined on process 0, so a
    row of process 1 outside the traced group fails the run and the check, named by uid."""
    run = tmp_path / "run"
    out = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2", "--mesh=dp4",
                          "--run-dir", str(run), *SMALL, "trainer.total_steps=1"], cwd=REPO,
                         env=dict(launch_env(), RLJAX_FAULTS="zero_loss_mask_token"), capture_output=True, text=True,
                         timeout=900)
    assert_acted(out, "zero_loss_mask_token")
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    inv = json.loads((run / "trace_summary.json").read_text())["invariants"]
    assert inv["processes"] == 2 and inv["rows"] == 32 and inv["violating_rows"] == 2, inv
    by_process = json.loads((run / "rollout_uids.jsonl").read_text().splitlines()[0])["by_process"]
    named = {v["uid"] for v in inv["violations"]}
    assert all(named & set(uids) for uids in by_process.values()), (named, by_process)  # one row of each process
    check = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], cwd=REPO, capture_output=True,
                           text=True, timeout=120)
    line = next(x for x in check.stdout.splitlines() if "whole-batch invariants" in x)
    assert check.returncode == 1 and line.startswith("FAIL") and "2 row(s) in all" in line, line
    assert "step 1 tensor loss_mask" in line and f"uid {inv['violations'][0]['uid']}" in line, line
    # the re-derivations need every row in one process: each says so, never a bare 'did not run'
    lines = check.stdout.splitlines()
    for title in ("advantages re-derived", "group ids follow the uids", "sampler weights tied"):
        line = next(x for x in lines if title in x)
        assert line.startswith("N/A") and "several processes" in line, line
