"""Every rollout split across processes: a 2-process run (2 x 2 CPU devices) of the multi-turn tool
task with dynamic sampling (``algorithm.filter_groups``), validating before and after training,
against the one-process run on 4 devices.

Each process runs its share of every drawn batch's training episodes (whole prompt groups) and
of every held-out batch; the processes agree on the kept groups and exchange the kept episodes
(their per-row multi-turn fields with them), so the union of the processes' trained rows is the
one-process batch, none twice; the dropped uids, the validation metrics, the generations log
and every metric equal the one-process run's; the packed learner plans from all-gathered row
spans only (``perf/packing_gather_bytes``: three ``[B]`` int32 arrays, not the batch's tokens). The
one-process run is also the multi-turn filter's own check: every batch refilled to full with groups
whose episodes differ in score, the trained rows whole episodes of the kept groups, none dropped
trained (tests/trainer/test_dynamic_sampling.py holds the rule and the single-process runs)."""

import glob
import json
import os
import subprocess

import numpy as np
import pytest

from launching import REPO, assert_same_metrics, launch, launch_env, metrics, train_rows
from test_dynamic_sampling import assert_kept_as_one_process

#: The tool task at a small size: 8 prompts x 4 sessions a step, groups whose episodes all score the
#: same dropped and refilled (a random policy fails every episode of some groups), 14 held-out
#: prompts in batches of 6 (6, 6, 2: blocks of 3 / 3 and 1 / 1 prompts), two sampled sessions each
#: (the uids' random streams matter), validated before and after training, every held-out row
#: logged, every group traced, the learner packed (actor.use_remove_padding=true) on dp4.
ARGS = ["--mesh=dp4", "--config", "tool_lookup", "data.train_batch_size=8", "rollout.n=4",
        "actor.ppo_mini_batch_size=4", "data.embedded.num_train=64", "data.embedded.num_test=14",
        "data.val_batch_size=6", "rollout.val_kwargs.n=2", "rollout.val_kwargs.temperature=1.0",
        "trainer.val_before_train=true", "trainer.test_freq=2", "trainer.log_val_generations=100",
        "trainer.total_steps=2", "trace.rollout_dump=true", "actor.use_remove_padding=true",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0", "trace.groups=8"]

#: Not compared: timings, throughput, memory, per-process engine facts (as tests/test_launch.py).
_SKIP = ("timing_s/", "perf/throughput", "perf/e2e_tokens_per_s", "perf/rollout_tokens_per_s", "perf/mfu",
         "trace/", "memory/", "comm_s/", "perf/step_time_by_process", "perf/slowest_process",
         "perf/step_time_max_over_min", "perf/batch_bytes", "invariants/", "rollout/slot_occupancy")


def _trained_rows(run_dir):
    """``{(step, uid, session): (prompt ids, response ids)}`` of every process's rollout dumps, the
    rows' sampling log-probs, and how many times each key was generated."""
    rows, logp, seen = {}, {}, {}
    for path in sorted(glob.glob(os.path.join(str(run_dir), "rollouts", "process*", "step*.npz"))):
        step, z = int(os.path.basename(path)[4:-4]), np.load(path)
        for i, (uid, session) in enumerate(zip(z["uid"], z["session"])):
            if z["is_padding"][i]:
                continue
            key = (step, str(uid), int(session))
            seen[key] = seen.get(key, 0) + 1
            n = int(z["response_length"][i])
            rows[key] = (z["prompt_ids"][i].tolist(), z["response_ids"][i][:n].tolist())
            logp[key] = z["rollout_logp"][i][:n]
    return rows, logp, seen


def _records(run_dir, name):
    path = os.path.join(str(run_dir), name)
    return [json.loads(x) for x in open(path) if x.strip()]


def _traced_episodes(run_dir):
    """``{(step, trajectory key): its episode facts}`` of the traced ``rollout_sessions`` records (turn
    spans, turns, tool calls, observation tokens: the multi-turn per-row fields)."""
    out = {}
    for r in _records(run_dir, "trace.jsonl"):
        if r.get("stage") != "rollout_sessions":
            continue
        for t in r["trajectories"]:
            out[(r["step"], t["key"])] = {k: t[k] for k in ("role_spans", "num_turns", "tool_calls",
                                                             "observation_tokens", "obs_mask_sum", "min_version")}
    return out


def _val_generations(run_dir):
    path = os.path.join(str(run_dir), "generations.jsonl")
    return [json.loads(x) for x in open(path) if x.strip() and json.loads(x)["split"] == "val"]


@pytest.mark.slow
def test_two_processes_split_validation_and_filtered_episodes_like_one(tmp_path):
    one = tmp_path / "one"
    out = launch("--run-dir", str(one), *ARGS)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    two = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2",
                          "--run-dir", str(tmp_path / "two"), *ARGS],
                         cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=1200)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    topo = json.loads((tmp_path / "two" / "topology.json").read_text())
    assert topo["process_count"] == 2 and topo["rollout_share"]["prompts_by_process"] == {"0": [0, 4], "1": [4, 8]}
    assert topo["rollout_share"]["assembly"] == "direct", topo["rollout_share"]  # dp across the processes
    assert "note" not in topo["rollout_share"], topo["rollout_share"]  # no "every process runs every episode"
    assert "rollout across 2 processes: 4 prompt groups each" in two.stdout

    # Dynamic sampling: the processes kept and dropped the one-process groups (with the same reasons),
    # and each trained its share of the one-process batch, some of it generated by the other process.
    one_uids = {r["step"]: r for r in _records(one, "rollout_uids.jsonl")}
    two_uids = {r["step"]: r for r in _records(tmp_path / "two", "rollout_uids.jsonl")}
    assert_kept_as_one_process(one_uids, two_uids)  # a random policy fails every episode of some groups
    # ... and the one-process run filtered whole episodes (the multi-turn filter's own checks): every batch
    # refilled to full with groups whose episodes differ in score, the dropped ones never trained, the trained
    # rows (the dump) the kept groups' episodes, their turns and tool calls counted
    for m in train_rows(one):
        rec = one_uids[m["step"]]
        trained = rec["by_process"]["0"]
        assert m["train/kept_groups"] == len(trained) == 8
        assert m["train/dropped_groups"] + m["train/excess_groups"] == len(rec["dropped"])
        assert not set(trained) & set(rec["dropped"])
        assert m["critic/score/max"] > m["critic/score/min"]  # kept groups have spread
        assert 0 <= m["env/tool_call_rate"] <= 1 and m["env/num_turns/mean"] >= 1  # over the trained episodes
        dump = np.load(one / "rollouts" / "process0" / f"step{m['step']}.npz")
        assert sorted(set(dump["uid"].tolist())) == sorted(trained)

    # Training episodes: the union of the processes' trained rows is the one-process batch, token for token.
    ref, ref_logp, ref_seen = _trained_rows(one)
    got, got_logp, seen = _trained_rows(tmp_path / "two")
    assert len(ref) == 2 * 8 * 4 and set(ref_seen.values()) == {1}
    assert set(seen.values()) == {1}, [k for k, c in seen.items() if c > 1][:4]
    assert got.keys() == ref.keys()
    assert all(got[k] == ref[k] for k in ref), [k for k in ref if got[k] != ref[k]][:4]
    for k in ref:
        np.testing.assert_allclose(got_logp[k], ref_logp[k], rtol=1e-5, atol=1e-6, err_msg=str(k))
    # ... and their multi-turn fields travelled with them: process 0 traces its share of each batch
    # (exchanged episodes included) as the one-process run traces those episodes.
    ep_one, ep_two = _traced_episodes(one), _traced_episodes(tmp_path / "two")
    assert len(ep_two) == 2 * 4 * 4 and ep_two.keys() <= ep_one.keys()
    assert {k: ep_one[k] for k in ep_two} == ep_two
    assert any((int(key.split("_")[0].split("-")[1]) % 8) // 4 for _, key in ep_two), "no exchanged episode traced"

    # Validation: the held-out rows logged by process 0 are every process's, the one-process rows.
    val_one, val_two = _val_generations(one), _val_generations(tmp_path / "two")
    assert len(val_one) == 2 * 14 * 2  # before training and after the last step, every row once
    assert [(r["step"], r["uid"], r["session"]) for r in val_two] == [(r["step"], r["uid"], r["session"])
                                                                      for r in val_one]
    assert val_two == val_one

    # Every metric of every record (validation's, the episodes', the learner's) as one process.
    a, b = metrics(one), metrics(tmp_path / "two")
    assert_same_metrics(a, b, skip=_SKIP)
    for key in ("val/score/mean", "val/env/tool_call_rate", "val/env/num_turns/mean", "env/tool_calls",
                "env/num_turns/mean", "perf/learner_padding_frac", "train/num_gen_batches", "train/dropped_groups"):
        assert sum(key in r for r in b) >= 1, key
    assert sum("val/score/mean" in r for r in b) == 2
    # The packed learner planned from the rows' spans, 3 x [32] int32, and (actor.shared_prefix=auto)
    # their prompts' keys, [32, 2] uint32, all-gathered a pass: no tokens.
    gathered = [r["perf/packing_gather_bytes"] for r in b if "perf/packing_gather_bytes" in r]
    assert gathered == [3 * 32 * 4 + 32 * 2 * 4] * 2, gathered
    assert not any("perf/packing_gather_bytes" in r for r in a)

    from rljax.trace.check import run_checks

    for run in (one, tmp_path / "two"):
        results = run_checks(str(run))
        assert not [r for r in results if r[0] == "FAIL"], (run.name, results)
        assert ("PASS", "no uid generated twice") in [(r[0], r[1]) for r in results]
        assert ("PASS", "no dropped group trained (dynamic sampling)") in [(r[0], r[1]) for r in results]
