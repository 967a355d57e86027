"""DAPO dynamic sampling (``algorithm.filter_groups``): verl's keep rule on hand cases, one-line
misuse errors (exit 2 from the launcher), and a real synchronous run that drops exactly the
zero-variance groups, refills to full batches, marks every dropped uid in the trace, passes
``python -m rljax.trace check`` (which fails when a dropped uid is trained), and resumes to the
same prompt draws; the same in trainer.mode=async (tau=0 equal to sync) and multi-turn runs."""

import json
import shutil
import subprocess
import sys
from collections import defaultdict

import numpy as np
import pytest

from rljax.reward import FILTER_METRICS, groups_to_keep


def _verl_keep(uids, values):
    """verl's RayDAPOTrainer.fit: keep a uid when np.std of its values > 0 or it has one sample."""
    by = defaultdict(list)
    for u, v in zip(uids, values):
        by[u].append(v)
    return {u for u, vs in by.items() if np.std(vs) > 0 or len(vs) == 1}


CASES = [  # (group ids, values)
    ([0, 0, 0, 1, 1, 1], [1, 1, 1, 0, 1, 0]),
    ([0, 0, 1, 1, 2, 2, 3], [0, 0, 0.5, 0.5, 0.1, 0.2, 7]),  # group 3 has one sample: kept, as verl's
    ([0, 1, 0, 1], [-1.0, 2.0, -1.0, 2.0]),
    ([0, 0, 1, 1], [1e-9, 0.0, 3.0, 3.0]),  # any spread keeps a group
]


@pytest.mark.parametrize("gid,values", CASES)
def test_groups_to_keep_is_verls_rule(gid, values):
    keep, std = groups_to_keep(values, gid, max(gid) + 1)
    assert {g for g in range(max(gid) + 1) if keep[g]} == _verl_keep(gid, values)
    for g in range(max(gid) + 1):
        np.testing.assert_allclose(std[g], np.std([v for i, v in zip(gid, values) if i == g]))


def test_groups_to_keep_ignores_padding_rows():
    keep, _ = groups_to_keep([1, 1, 0, 5], [0, 0, 0, 1], 2, real=[True, True, False, False])
    assert keep.tolist() == [False, False]  # group 0's real rows agree; group 1 has no real row
    with pytest.raises(ValueError, match="group ids"):
        groups_to_keep([1, 2], [0, 2], 2)


def test_filter_metrics_listed_in_the_schema():
    from rljax.config import _schema

    assert _schema.FILTER_METRICS == FILTER_METRICS


@pytest.mark.parametrize("overrides,match", [
    (["rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus_baseline"], "rollout.n>=2"),
    (["algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=true"], "seq_final_reward"),
    (["algorithm.filter_groups.metric=accuracy"], "metric"),
    (["algorithm.filter_groups.max_num_gen_batches=-1"], "max_num_gen_batches"),
])
def test_filter_groups_misuse_is_one_config_error_line(overrides, match):
    from rljax.config import ConfigError, resolve
    from rljax.trainer import check

    with pytest.raises(ConfigError, match=match) as e:  # the schema's range checks or rljax.trainer.check
        check(resolve("default", ["algorithm.filter_groups.enable=true", *overrides])[0])
    assert "\n" not in str(e.value)


def test_filter_groups_with_one_sample_exits_2_before_writing(tmp_path):
    from launching import launch

    out = launch("--run-dir", str(tmp_path / "run"), "algorithm.filter_groups.enable=true", "rollout.n=1",
                 "algorithm.adv_estimator=reinforce_plus_plus_baseline", timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "rollout.n>=2" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "run").exists()


#: What an async run's rollout_uids.jsonl lines add to the synchronous record: the queued batch,
#: the batches dropped before it and the data position after its draw (trace check's "every prompt
#: trained once").
ASYNC_ONLY = ("batch_index", "dropped_batches", "data_after")
RUN = ["--mesh=dp2", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=4",
       "data.embedded.num_train=64", "data.embedded.num_test=16", "trainer.test_freq=-1",
       "trainer.val_before_train=false", "trace.ledgers=false", "algorithm.filter_groups.enable=true",
       "algorithm.filter_groups.max_num_gen_batches=0", "trainer.save_freq=1", "trace.rollout_dump=true",
       "trace.log_train_generations=16"]


def _records(path):
    with open(path) as fh:
        return {r["step"]: r for r in map(json.loads, fh) if "step" in r}  # not the resume markers


@pytest.mark.slow
def test_run_drops_zero_variance_groups_refills_and_resumes(tmp_path):
    from launching import launch, metrics

    from rljax.trace.check import run_checks

    run = tmp_path / "run"
    out = launch("--run-dir", str(run), *RUN, "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    uids = _records(run / "rollout_uids.jsonl")
    ms = {m["step"]: m for m in metrics(run) if "train/kept_groups" in m}
    for step in (1, 2):
        m, rec = ms[step], uids[step]
        trained = rec["by_process"]["0"]
        assert m["train/kept_groups"] == len(trained) == 4  # always a full batch
        assert m["train/dropped_groups"] + m["train/excess_groups"] == len(rec["dropped"])
        assert m["train/num_gen_batches"] == 1 + (len(trained) + len(rec["dropped"]) - 1) // 4
        assert not set(trained) & set(rec["dropped"])
        # the trained rows: every kept group has some reward spread (the dump holds this process's rows)
        dump = np.load(run / "rollouts" / "process0" / f"step{step}.npz")
        assert sorted(set(dump["uid"].tolist())) == sorted(trained)
        # the training generations log holds the trained (kept) rows, each with its own group's prompt
        gens = [g for g in map(json.loads, open(run / "generations.jsonl")) if g["step"] == step]
        assert [g["uid"] for g in gens] == [u for u in trained for _ in range(4)], gens
        assert len({g["prompt"] for g in gens}) == 4 and all(g["prompt"] for g in gens)
    dropped_zero = [u for r in uids.values() for u, why in r["dropped"].items() if why.startswith("zero variance")]
    assert dropped_zero, "the tiny random policy should fail every sample of some groups"
    checks = {name: (status, detail) for status, name, detail in run_checks(str(run))}
    name = "no dropped group trained (dynamic sampling)"
    assert checks[name][0] == "PASS", checks[name]
    assert all(s != "FAIL" for s, _ in checks.values()), {k: v for k, v in checks.items() if v[0] == "FAIL"}

    # The check fails when a dropped uid is listed as trained.
    bad = tmp_path / "tampered"
    shutil.copytree(run, bad)
    recs = [json.loads(line) for line in open(bad / "rollout_uids.jsonl")]
    recs[0]["by_process"]["0"][0] = next(iter(recs[0]["dropped"]))
    (bad / "rollout_uids.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    checks = {name: (status, detail) for status, name, detail in run_checks(str(bad))}
    assert checks[name][0] == "FAIL" and "was trained" in checks[name][1], checks[name]

    # Resume from step 1: step 2 draws the same prompt batches (kept and dropped uids alike).
    again = tmp_path / "resumed"
    shutil.copytree(run, again)
    out = launch("--run-dir", str(again), *RUN, "trainer.total_steps=2", "--resume=1")
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = _records(again / "rollout_uids.jsonl")
    assert resumed[2]["by_process"] == uids[2]["by_process"] and resumed[2]["dropped"] == uids[2]["dropped"]
    a, b = (np.load(d / "rollouts" / "process0" / "step2.npz") for d in (run, again))
    np.testing.assert_array_equal(a["prompt_ids"], b["prompt_ids"])


@pytest.mark.parametrize("draws,full,kept,undecided,zero", [
    ([[True, None, True, False]], False, 2, 1, 1),  # the undecided group may still be the 3rd kept one
    ([[True, True, False, True, None]], True, 3, 1, 1),  # the first 3 kept groups are decided: full
    ([[True, False, False, False], [None, True]], False, 2, 1, 3),  # a later draw's undecided group blocks
    ([[True, False], [False, True, True, None]], True, 3, 1, 2),
    ([[False, False, None]], False, 0, 1, 2),
])
def test_streamed_batch_is_full_only_when_its_first_kept_groups_are_decided(draws, full, kept, undecided, zero):
    """Streaming with the filter (trainer.mode=async): a batch of 3 groups is full once its first 3
    kept groups in draw and group order are known; a further draw is needed only when kept +
    undecided < 3 (the synchronous filter draws exactly then)."""
    from rljax.trainer.dynamic_sampling import fill_state

    assert fill_state(draws, 3) == (full, kept, undecided, zero)


def test_streamed_rollout_keeps_what_the_synchronous_filter_keeps():
    """Two draws scored group by group give the synchronous accounting: the first 4 kept groups in
    order, zero-variance and excess uids with their reasons, the kept rows' scores and digests."""
    from rljax.reward import RewardReport
    from rljax.trainer.distribute import Share
    from rljax.trainer.dynamic_sampling import group_facts, streamed_rollout

    n, want = 2, 4
    draws, values = [], {0: [1, 1, 0, 1, 1, 0, 0, 0], 1: [0, 1, 1, 1, 1, 0, 0, 1]}  # per row: 4 groups x 2 sessions
    for d, v in values.items():
        traj = _episodes(4, n, f"{d}-")
        facts = group_facts(traj, np.asarray(v, np.float32))
        draws.append({"traj": traj, "facts": facts, "shaped": np.asarray(v, np.float32) + d,
                      "digests": np.arange(8, dtype=np.uint32) + 10 * d,
                      "report": RewardReport(8, 0, 0, (), None), "prompts": [f"p{d}{g}" for g in range(4)],
                      "uids": [f"1-{4 * d + g}" for g in range(4)]})
    out = streamed_rollout(draws, want=want, metric="acc", share=Share(0, 1, 0, want, n, want, True, (0,)))
    assert out["uids"] == ["1-1", "1-2", "1-4", "1-6"] and out["prompts"] == ["p01", "p02", "p10", "p12"]
    ds = out["dynamic_sampling"]
    assert ds["dropped"] == {"1-0": "zero variance: acc=1.0 in all 2", "1-3": "zero variance: acc=0.0 in all 2",
                             "1-5": "zero variance: acc=1.0 in all 2", "1-7": "excess: the batch was full (4 groups kept)"}
    assert (ds["num_gen_batches"], ds["kept_groups"], ds["dropped_groups"], ds["excess_groups"]) == (2, 4, 3, 1)
    assert out["trajectories"].final_text == ("0-2", "0-3", "0-4", "0-5", "1-0", "1-1", "1-4", "1-5")
    np.testing.assert_array_equal(ds["scores"], [0, 1, 1, 0, 1, 2, 2, 1])
    np.testing.assert_array_equal(ds["scored_rows"]["digest"], [2, 3, 4, 5, 10, 11, 14, 15])


def test_filter_groups_runs_in_async_mode_too():
    from rljax.config import resolve
    from rljax.trainer import check

    check(resolve("default", ["algorithm.filter_groups.enable=true", "trainer.mode=async"])[0])


@pytest.mark.slow
def test_async_dynamic_sampling_keeps_the_sync_rule(tmp_path):
    """In trainer.mode=async the producer refills each queued batch by the same rule: with tau=0
    (the synchronous schedule) every metric, kept and dropped uid equals the synchronous run's;
    with tau=1 and weight pushes between decode chunks every batch is full, the dropped uids are
    recorded and the trace check proves none was trained."""
    from launching import launch, train_rows
    from test_async_launch import _compare

    from rljax.trace.check import run_checks

    base = [*RUN, "trainer.total_steps=3", "trainer.save_freq=-1"]
    out = launch("--run-dir", str(tmp_path / "sync"), *base)
    assert out.returncode == 0, out.stderr[-3000:]
    sync = train_rows(tmp_path / "sync")
    for streaming in ("false", "true"):  # one batch per call; streaming admission scoring group by group
        run = tmp_path / f"tau0-{streaming}"
        out = launch("--run-dir", str(run), *base, "trainer.mode=async", "async_training.max_staleness=0",
                     f"async_training.streaming={streaming}")
        assert out.returncode == 0, out.stderr[-3000:]
        tau0 = train_rows(run)
        if streaming == "true":  # a draw's sessions take the slots the previous draw's tail frees: only the
            for r in sync + tau0:  # occupancy differs, not the tokens
                r.pop("rollout/slot_occupancy", None)
        _compare(sync, tau0)
        assert _records(tmp_path / "sync" / "rollout_uids.jsonl") == {
            s: {k: v for k, v in r.items() if k not in ASYNC_ONLY}
            for s, r in _records(run / "rollout_uids.jsonl").items()}

    run = tmp_path / "tau1"
    out = launch("--run-dir", str(run), *base, "trainer.mode=async", "async_training.max_staleness=1",
                 "async_training.partial_rollout=true")
    assert out.returncode == 0, out.stderr[-3000:]
    uids = _records(run / "rollout_uids.jsonl")
    assert sorted(uids) == [1, 2, 3]
    for m in train_rows(run):
        rec = uids[m["step"]]
        assert m["train/kept_groups"] == len(rec["by_process"]["0"]) == 4
        assert m["train/dropped_groups"] + m["train/excess_groups"] == len(rec["dropped"])
        assert not set(rec["by_process"]["0"]) & set(rec["dropped"])
    assert any(r["dropped"] for r in uids.values()), "the tiny random policy should fail every sample of some groups"
    checks = {name: (status, detail) for status, name, detail in run_checks(str(run))}
    name = "no dropped group trained (dynamic sampling)"
    assert checks[name][0] == "PASS", checks[name]
    # streaming (the default): every prompt drawn was trained or dropped, each batch's draws at the data order's
    assert checks["every prompt trained once"][0] == "PASS", checks["every prompt trained once"]
    assert "data positions of 3 batch(es) checked" in checks["every prompt trained once"][1]
    assert all(s != "FAIL" for s, _ in checks.values()), {k: v for k, v in checks.items() if v[0] == "FAIL"}


@pytest.mark.slow
def test_streaming_dynamic_sampling_stops_at_max_num_gen_batches_like_sync(tmp_path):
    """The draws per batch are bounded as in the synchronous filter, with its error."""
    from launching import launch

    base = [*RUN, "trainer.total_steps=3", "trainer.save_freq=-1", "algorithm.filter_groups.max_num_gen_batches=1"]
    errors = []
    for mode in (["trainer.mode=sync"], ["trainer.mode=async", "async_training.max_staleness=0"]):
        out = launch("--run-dir", str(tmp_path / mode[0][-5:]), *base, *mode)
        assert out.returncode != 0
        errors.append(next(ln for ln in out.stderr.splitlines() if "max_num_gen_batches=1" in ln))
    assert "prompt groups kept after 1 prompt batches" in errors[0], errors
    assert errors[0].split("RuntimeError: ")[-1] == errors[1].split("RuntimeError: ")[-1], errors


@pytest.mark.slow  # a real sampler: ~17 s of compiling on this loaded host
def test_each_draw_checks_the_weights_it_started_with():
    """trainer.mode=async with partial_rollout may install a weight push while the filter draws:
    each further draw is checked against the sampler's version at its start (the synchronous
    step's learner version otherwise). A real sampler; the push is installed between decode
    chunks of the first draw, as the asynchronous producer's on_chunk does."""
    import functools
    import types

    from rljax import models
    from rljax.config import resolve
    from rljax.reward import RewardReport
    from rljax.rollout import DecodeParams, RljaxEngine, Sampler
    from rljax.tokenizer import CharTokenizer
    from rljax.trainer.dynamic_sampling import filtered_rollout
    from rljax.trainer.distribute import Share
    from rljax.trainer.services import Rollout, Services
    from rljax.trainer.stages import rollout_sessions

    tok = CharTokenizer()
    config = models.get_config("tiny").replace(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id)
    _, params = models.init_params(config, seed=0)
    sampler = Sampler(RljaxEngine(config, num_slots=4, max_prefill_length=8, max_decode_length=3), params)
    cfg = resolve("default", ["algorithm.filter_groups.enable=true", "data.train_batch_size=2", "rollout.n=2",
                              "actor.ppo_mini_batch_size=2"])[0]
    prompt = lambda text: types.SimpleNamespace(ids=tok.encode(text, add_bos=True))  # noqa: E731
    pushed = []

    def on_chunk(info):  # one push during the first draw
        if not pushed:
            pushed.append(sampler.update_weights(params, sampler.version + 1))

    rollout = Rollout(sampler=sampler, decode=DecodeParams(max_new_tokens=3, seed=0), val_decode=None, tokenizer=tok,
                      env=None, prompts=iter([[prompt("3+4="), prompt("1+1=")]]), val_prompts=None,
                      share=Share(0, 1, 0, 2, 2, 2, True, (0,)), to_sampler=None)
    c = Services(cfg=cfg, mesh=None, model=None, rollout=rollout, learner=None, reward=None)
    draws = []

    def score(c, traj, prompts):  # only group 0 of a draw has spread: two draws fill the batch
        draws.append(int(traj.min_version.min()))
        keep = np.asarray(traj.group_id) == 0
        return np.where(keep, np.asarray(traj.session, np.float32), 0.0), RewardReport(len(traj.uid), 0, 0, (), None)

    out = filtered_rollout(c, {"step": 1, "prompts": [prompt("2+2="), prompt("0+4=")], "uids": ["1-0", "1-1"],
                               "weight_version": 0}, rollout_fn=functools.partial(rollout_sessions, on_chunk=on_chunk),
                           score_fn=score, shape_fn=lambda c, t, s: s,
                           digest_fn=lambda t: np.zeros(len(t.uid), np.uint32))
    assert pushed and draws == [0, 1]  # the second draw started on the pushed weights
    assert out["dynamic_sampling"]["num_gen_batches"] == 2 and out["uids"] == ["1-0", "1-2"]


@pytest.mark.slow
def test_multi_turn_dynamic_sampling_filters_whole_episodes(tmp_path):
    """env.function (the lookup tool task): groups whose episodes all score the same are dropped,
    every batch is refilled to full, the trained rows are whole episodes of kept groups (their
    turns, observations and tool calls with them) and the trace check passes."""
    from launching import launch, train_rows

    from rljax.trace.check import run_checks

    run = tmp_path / "run"
    out = launch("--config", "tool_lookup", "--run-dir", str(run), "--mesh=dp2", "data.train_batch_size=4",
                 "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.embedded.num_train=64", "data.embedded.num_test=16",
                 "trainer.test_freq=-1", "trainer.val_before_train=false", "trace.ledgers=false",
                 "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0",
                 "trace.rollout_dump=true", "trainer.total_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    uids = _records(run / "rollout_uids.jsonl")
    rows = train_rows(run)
    assert [m["step"] for m in rows] == [1, 2]
    for m in rows:
        rec = uids[m["step"]]
        trained = rec["by_process"]["0"]
        assert m["train/kept_groups"] == len(trained) == 4
        assert m["train/dropped_groups"] + m["train/excess_groups"] == len(rec["dropped"])
        assert not set(trained) & set(rec["dropped"])
        assert m["critic/score/max"] > m["critic/score/min"]  # kept groups have spread
        assert 0 <= m["env/tool_call_rate"] <= 1 and m["env/num_turns/mean"] >= 1  # over the trained episodes
        dump = np.load(run / "rollouts" / "process0" / f"step{m['step']}.npz")
        assert sorted(set(dump["uid"].tolist())) == sorted(trained)
    assert any(r["dropped"] for r in uids.values()), "a random policy fails every episode of some groups"
    checks = {name: (status, detail) for status, name, detail in run_checks(str(run))}
    assert checks["no dropped group trained (dynamic sampling)"][0] == "PASS"
    assert all(s != "FAIL" for s, _ in checks.values()), {k: v for k, v in checks.items() if v[0] == "FAIL"}


TWO = ["--mesh=dp4", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
       "data.embedded.num_train=64", "data.embedded.num_test=16", "trainer.test_freq=-1",
       "trainer.val_before_train=false", "trace.ledgers=false", "algorithm.filter_groups.enable=true",
       "algorithm.filter_groups.max_num_gen_batches=0", "trace.rollout_dump=true", "trainer.total_steps=2",
       "trainer.save_freq=-1"]


def _trained_rows(run_dir):
    """``{(step, uid, session): (prompt ids, response ids)}`` of every process's
    rollout dump (the trained rows), and how many times each key occurs."""
    import glob
    import os

    out, seen = {}, defaultdict(int)
    for path in sorted(glob.glob(os.path.join(str(run_dir), "rollouts", "process*", "step*.npz"))):
        step, z = int(os.path.basename(path)[4:-4]), np.load(path)
        for i, (uid, session) in enumerate(zip(z["uid"], z["session"])):
            key = (step, str(uid), int(session))
            seen[key] += 1
            # left padding stripped (pad id 0; every prompt starts with BOS, id 1): the widths may differ
            prompt = np.trim_zeros(z["prompt_ids"][i], "f")
            out[key] = (prompt.tolist(), z["response_ids"][i][: z["response_length"][i]].tolist())
    return out, seen


@pytest.mark.slow
def test_two_processes_keep_the_one_process_groups(tmp_path):
    """launch/local_multiprocess.sh, 2 processes x 2 CPU devices, dp4: each process generates and
    scores its half of every drawn prompt batch, the processes agree on every group's keep flag
    each draw, so both draw the same batches, stop together and keep exactly the one-process run's
    groups; the kept groups are then exchanged so each process trains its share of the
    one-process batch (some generated by the other process). The union of the processes' trained
    rows, the dropped uids with their reasons and every batch metric equal the one-process run's,
    and the trace check passes."""
    import json
    import math
    import os

    from launching import REPO, launch, launch_env, metrics
    from test_launch import _NOT_COMPARED

    from rljax.trace.check import run_checks

    out = launch("--run-dir", str(tmp_path / "one"), *TWO)
    assert out.returncode == 0, out.stderr[-3000:]
    two = subprocess.run(["bash", os.path.join(REPO, "launch", "local_multiprocess.sh"), "2",
                          "--run-dir", str(tmp_path / "two"), *TWO],
                         cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=600)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]

    one_uids, two_uids = _records(tmp_path / "one" / "rollout_uids.jsonl"), _records(tmp_path / "two" / "rollout_uids.jsonl")
    assert sorted(one_uids) == sorted(two_uids) == [1, 2]
    exchanged = 0
    for step, rec in two_uids.items():
        ref = one_uids[step]
        assert rec["dropped"] == ref["dropped"], step
        assert rec["by_process"]["0"] + rec["by_process"]["1"] == ref["by_process"]["0"], step
        for p, uids in rec["by_process"].items():  # uid index i: draw i // 8, group i % 8, generated by (i % 8) // 4
            exchanged += sum((int(u.split("-")[1]) % 8) // 4 != int(p) for u in uids)
    assert exchanged, "no kept group was trained by a process other than its generator: the exchange is untested"
    assert any(len(r["dropped"]) for r in one_uids.values())

    ref, ref_seen = _trained_rows(tmp_path / "one")
    got, seen = _trained_rows(tmp_path / "two")
    assert len(ref) == 2 * 8 * 4 and set(ref_seen.values()) == set(seen.values()) == {1}
    assert got == ref

    a, b = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert [r["step"] for r in a] == [r["step"] for r in b]
    compared = 0
    for ra, rb in zip(a, b):
        for key, va in ra.items():
            # rollout/slot_occupancy: each process's engine, sized for the whole batch, fills half its slots
            if key.startswith((*_NOT_COMPARED, "rollout/slot_occupancy")) or not isinstance(va, (int, float)):
                continue
            assert key in rb, (ra["step"], key)
            assert math.isclose(va, rb[key], rel_tol=1e-5, abs_tol=1e-6), (ra["step"], key, va, rb[key])
            compared += 1
    assert compared > 60
    assert [r["train/num_gen_batches"] for r in b if "train/num_gen_batches" in r] == \
        [r["train/num_gen_batches"] for r in a if "train/num_gen_batches" in r]
    checks = {name: (status, detail) for status, name, detail in run_checks(str(tmp_path / "two"))}
    assert checks["no dropped group trained (dynamic sampling)"][0] == "PASS"
    assert all(s != "FAIL" for s, _ in checks.values()), {k: v for k, v in checks.items() if v[0] == "FAIL"}
    topo = json.loads((tmp_path / "two" / "topology.json").read_text())
    assert topo["process_count"] == 2 and topo["rollout_share"]["assembly"] == "direct"


def test_async_dynamic_sampling_over_processes_is_refused_in_one_line():
    """trainer.mode=async: the producer threads run no collective, so the filter's agreement cannot
    run there; several processes are refused (launch exits 2 on it), one process is accepted."""
    from rljax.trainer.distribute import Share, check_async_share

    two = Share(0, 2, 0, 4, 4, 8, True, (0, 4))
    check_async_share(two, "dp4")  # no filter: accepted
    check_async_share(Share(0, 1, 0, 8, 4, 8, True, (0,)), "dp4", filter_groups=True)
    with pytest.raises(ValueError, match="filter_groups.enable=true with trainer.mode=async runs on one process") as e:
        check_async_share(two, "dp4", filter_groups=True)
    assert "\n" not in str(e.value)


def _episodes(n_groups, n, tag):
    """Hand-made multi-turn rows: each row's host fields name it (``{tag}{row}``)."""
    from rljax.env import EpisodeTrajectories
    from rljax.rollout import DecodeParams, RolloutStats

    b, t = n_groups * n, 3
    z = lambda dt=np.float32: np.zeros(b, dt)  # noqa: E731
    rows = np.arange(b)
    return EpisodeTrajectories(
        prompt_ids=np.tile(rows[:, None], (1, 2)).astype(np.int32), prompt_mask=np.ones((b, 2), bool),
        response_ids=np.tile(rows[:, None], (1, t)).astype(np.int32), response_mask=np.ones((b, t), bool),
        loss_mask=np.ones((b, t), bool), rollout_logp=np.zeros((b, t), np.float32),
        prompt_length=np.full(b, 2, np.int32), response_length=np.full(b, t, np.int32), truncated=z(bool),
        group_id=(rows // n).astype(np.int32), min_version=z(np.int32), max_version=z(np.int32), is_padding=z(bool),
        queue_s=z(), prefill_s=z(), decode_s=z(), uid=tuple(f"{tag}{r // n}" for r in rows),
        session=tuple(int(r % n) for r in rows), index=(0,) * b, decode=DecodeParams(), stats=RolloutStats(
            wall_s=1.0, prefill_s=0.5, decode_s=0.5, weight_sync_s=0.0, generated_tokens=b * t, prefill_calls=1,
            prefill_rows=n_groups, decode_chunks=1, num_slots=b, version_start=0, version_end=0),
        num_groups=n_groups, pad_id=0, response_attention=np.ones((b, t), bool), roles=np.ones((b, t), np.int8),
        num_turns=np.ones(b, np.int32), obs_tokens=rows.astype(np.int32), tool_calls=z(np.int32), env_reward=z(),
        tool_s=z(), env_wait_s=z(), final_text=tuple(f"{tag}{r}" for r in rows),
        turn_spans=tuple(((0, int(r), 1),) for r in rows), episode=(("continuation", "kv"), ("tool_calls", b)))


def test_filtered_episodes_keep_their_own_turns_and_text():
    """take_groups / concat carry multi-turn rows whole: each kept row's final text and turn
    spans stay with its arrays, and the episode totals add up over the draws."""
    from rljax.trainer.dynamic_sampling import concat, take_groups

    a, b = _episodes(3, 2, "a"), _episodes(2, 2, "b")
    out = concat([take_groups(a, [2, 0]), take_groups(b, [1])])
    assert out.uid == ("a2", "a2", "a0", "a0", "b1", "b1") and out.group_id.tolist() == [0, 0, 1, 1, 2, 2]
    assert out.final_text == ("a4", "a5", "a0", "a1", "b2", "b3")
    assert [s[0][1] for s in out.turn_spans] == out.obs_tokens.tolist() == [4, 5, 0, 1, 2, 3]
    assert out.episode_stats == {"continuation": "kv", "tool_calls": 6 + 4}


@pytest.mark.parametrize("keeps,max_draws,want_call", [
    ([[True, True, True, None]], 0, None),  # the undecided group may fill it: draw nothing (not the next batch)
    ([[True, False, True, None]], 0, "more"),  # short even if the last is kept: a further prompt batch for it
    ([[True, True, True, True]], 0, "next"),  # full: the next batch's first prompt batch
    ([[True, False, True, None]], 1, None),  # at max_num_gen_batches: wait for the undecided group
    ([[True, False, True, False]], 1, "error"),  # at max_num_gen_batches, short: the synchronous error
])
def test_streaming_producer_draws_what_the_synchronous_filter_would(keeps, max_draws, want_call):
    """The streaming producer's draw decision (FilteredStreamingProducer._maybe_draw) over a batch
    being filled: a further prompt batch only when even keeping every undecided group leaves it
    short, the next batch's only once it is full, so the draws stay contiguous in the data order."""
    import types

    from rljax.trainer.async_loop import FilteredStreamingProducer, _Filling

    p = object.__new__(FilteredStreamingProducer)
    p.want = 4
    p.fg = types.SimpleNamespace(max_num_gen_batches=max_draws, metric="acc")
    p.stream = types.SimpleNamespace(driver=types.SimpleNamespace(waiting=0))
    p._fill = [_Filling(7, [types.SimpleNamespace(keep=k) for k in keeps], 0.0)]
    calls = []
    p._draw_for = lambda f: calls.append("next" if f is None else "more")
    if want_call == "error":
        with pytest.raises(RuntimeError, match="step 7: 2 of data.train_batch_size=4 prompt groups kept after 1"):
            p._maybe_draw()
        return
    p._maybe_draw()
    assert calls == ([] if want_call is None else [want_call])
    p.stream.driver.waiting = 3  # sessions wait for a slot: nothing is drawn
    calls.clear()
    p._maybe_draw()
    assert calls == []
