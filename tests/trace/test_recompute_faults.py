"""Producers that are wrong, provoked in real runs (rljax.trace.faults, RLJAX_FAULTS): the producer and
its consumer agree, so only the re-derivations (rljax.trace.recompute) catch them. Each fails its own
``python -m rljax.trace check`` line naming step, tensor, stage and uid (and session), and the launch
exits 3. One launch carries the faults that leave the run going (they hit different checks); a future
version in a synchronous run stops the step before its update."""

import json
import subprocess
import sys

import pytest

from launching import REPO, launch_env
from test_launch import SMALL
from test_trace_faults import assert_acted

#: fault -> (its check in trace_summary.json's recompute section, the check line, tensor, stage, words of the detail)
EXPECT = {
    "wrong_group_id": ("group_ids", "group ids follow the uids", "group_id", "trajectory_fields", "is grouped with"),
    "mask_after_eos": ("response_mask", "loss mask re-derived from token roles", "loss_mask", "actor_minibatch",
                       "the token roles give"),
    "restart_positions": ("positions", "positions re-derived from attention", "positions", "actor_minibatch",
                          "not the count of attended tokens"),
    # the line names the batch's first (the aggregation: loss_agg_mode is on too), then the rows lost
    "drop_micro_row": ("update_report", "the update's own report", "loss", "actor_minibatch",
                       "built with loss_agg_mode="),
    "reward_other_answer": ("rewards", "rewards re-scored", "scores", "reward", "re-scored"),
    # the old log-prob pass reading a copy of step 1's policy, the reference pass the policy, the sampler keeping
    # step 1's weights under version 2: the step-2 records fail (the line names the first: the old pass ran first)
    "stale_old_logp": ("weights", "sampler weights tied to the learner's digests", "old_logp", "old_log_prob",
                       "the old_log_prob pass read parameters"),
    "reference_is_policy": ("weights", "sampler weights tied to the learner's digests", None, None, ""),
    "stale_sampler_weights": ("weights", "sampler weights tied to the learner's digests", None, None, ""),
}


def _check(run):
    out = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(run)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    return out.returncode, out.stdout.splitlines()


#: A reward that depends on the answer whatever the response (a random policy's answers are all wrong: every
#: answer would score it 0, so a wrong answer would change nothing to see).
PLUGIN = """import zlib


def reward(response, answer, **kwargs):
    return (zlib.crc32(str(answer).encode()) % 1000) / 1000.0
"""


@pytest.mark.slow
def test_wrong_producers_fail_their_checks_by_name(tmp_path):
    run = tmp_path / "run"
    faults = ",".join([*EXPECT, "loss_agg_mode"])
    (tmp_path / "answer_reward.py").write_text(PLUGIN)
    out = subprocess.run([sys.executable, "-m", "rljax.launch", "--mesh=dp2", "--run-dir", str(run), *SMALL,
                          "trainer.total_steps=3", "data.max_response_length=16", "trace.rescore_rows=64",
                          "actor.use_kl_loss=true",
                          f"reward.function={tmp_path / 'answer_reward.py'}:reward"],
                         cwd=REPO, env=dict(launch_env(), RLJAX_FAULTS=faults), capture_output=True, text=True,
                         timeout=900)
    assert_acted(out, *EXPECT, "loss_agg_mode")
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    rc, lines = _check(run)
    assert rc == 1
    rec = json.loads((run / "trace_summary.json").read_text())["recompute"]
    for fault, (key, title, tensor, stage, words) in EXPECT.items():
        line = next(x for x in lines if title in x)
        assert line.startswith("FAIL") and words in line, (fault, line)
        if tensor is not None:
            v = rec[key]["violations"][0]
            assert (v["tensor"], v["stage"]) == (tensor, stage), v
            session = ", session " if v["row"] >= 0 else ""
            assert f"step {v['step']} tensor {tensor} at {stage}, {v['key']} (uid {v['uid']}{session}" in line, line
    # the micro-batches' lost rows, each named
    lost = [v for v in rec["update_report"]["violations"] if "the loss consumed 0 token(s)" in v["detail"]]
    assert lost and all(v["tensor"] == "loss_mask" and v["uid"].startswith(f"{v['step']}-") for v in lost), lost
    # the advantages were normalised over the wrong group: re-derived from the uids' groups, they differ
    line = next(x for x in lines if "advantages re-derived" in x)
    assert line.startswith("FAIL") and "tensor advantages at advantages" in line, line
    # and the aggregation that ran is not the configuration's
    assert any("the loss aggregated as" in v["detail"] for v in rec["update_report"]["violations"])
    # every record whose weights are not the learner's of its version: the reference pass from step 2 on (step 1's
    # policy is still the initial one), the stale old pass from step 2, the stale sampler's install under version 2
    # (step 2) and the chunks decoded with it (step 3): each at the first step it happens
    bad = {(s["kind"], s["version"], s["step"]) for s in rec["weights"]["sampler"]
           if s["digest"] != rec["weights"]["learner"][str(s["version"])]}
    assert {("reference", 0, 2), ("old", 1, 2), ("install", 2, 2), ("chunk", 2, 3)} <= bad, bad
    assert min(step for _, _, step in bad) == 2, bad


@pytest.mark.slow
def test_a_future_version_stops_a_synchronous_step_before_its_update(tmp_path):
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rljax.launch", "--mesh=dp2", "--run-dir", str(run), *SMALL,
                          "trainer.total_steps=1"], cwd=REPO, env=dict(launch_env(), RLJAX_FAULTS="future_version"),
                         capture_output=True, text=True, timeout=900)
    assert_acted(out, "future_version")
    assert out.returncode != 0 and "stopped before the update" in out.stderr, out.stderr[-2000:]
    rc, lines = _check(run)
    line = next(x for x in lines if x.startswith("FAIL") and "trace summary saved" in x)
    assert rc == 1 and "tensor max_version at trajectory_fields" in line and "(uid 1-" in line, line
    trace = run / "trace.jsonl"  # nothing of the step was recorded past the stop (no update)
    assert not trace.exists() or not any(json.loads(x).get("stage") == "actor_minibatch" for x in open(trace))


#: multi-turn fault -> (check line, tensor, stage, words of the detail)
MULTI_TURN = {
    "wrong_group_id": ("group ids follow the uids", "group_id", "trajectory_fields", "is grouped with"),
    "restart_positions": ("positions re-derived from attention", "positions", "actor_minibatch",
                          "not the count of attended tokens"),
}


@pytest.mark.slow
def test_multi_turn_wrong_producers_fail_naming_the_session(tmp_path):
    """The tool task (``--config tool_lookup``, every row an episode of its own session): a row grouped
    with another prompt, its positions restarted, and (the episode reward stage's record) two rows'
    scores swapped. The launch exits 3; each check line FAILs naming step, tensor, stage, uid and
    the session of the row; the swapped scores fail the whole-batch invariants on untraced rows."""
    run = tmp_path / "run"
    out = subprocess.run([sys.executable, "-m", "rljax.launch", "--mesh=dp2", "--config", "tool_lookup",
                          "--run-dir", str(run), *SMALL, "trainer.total_steps=1"], cwd=REPO,
                         env=dict(launch_env(), RLJAX_FAULTS=",".join([*MULTI_TURN, "swap_rewards"])),
                         capture_output=True, text=True, timeout=600)
    assert_acted(out, *MULTI_TURN, "swap_rewards")
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    rc, lines = _check(run)
    assert rc == 1
    summary = json.loads((run / "trace_summary.json").read_text())
    rec = summary["recompute"]
    for fault, (title, tensor, stage, words) in MULTI_TURN.items():
        line = next(x for x in lines if title in x)
        v = rec[EXPECT[fault][0]]["violations"][0]
        assert (v["tensor"], v["stage"], v["step"]) == (tensor, stage, 1), v
        session = int(v["key"].split("_")[1])  # {uid}_{session}_{index}
        assert v["session"] == session, v
        assert line.startswith("FAIL") and words in line, (fault, line)
        assert f"step 1 tensor {tensor} at {stage}, {v['key']} (uid {v['uid']}, session {session})" in line, line
    # the episode reward stage's scores, swapped on two untraced rows: the reward tie on every row
    traced = {json.loads(x)["uid"] for x in open(run / "trace.jsonl")}
    swapped = [v for v in summary["invariants"]["violations"] if v["tensor"] == "scores"]
    assert swapped and all(v["stage"] == "advantages" and v["uid"] not in traced for v in swapped), swapped
    line = next(x for x in lines if "whole-batch invariants" in x)
    assert line.startswith("FAIL") and "tensor scores at advantages" in line, line
