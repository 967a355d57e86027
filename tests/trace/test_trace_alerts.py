"""rljax.trace without a training run: the Tracer's hooks on a synthetic step, each alert
provoked, the shard-reading field summaries, deterministic group choice."""

import functools
import json
import time
import types

import jax
import numpy as np
import pytest

from jax.sharding import NamedSharding, PartitionSpec

from rljax.config import resolve
from rljax.rollout.trajectory import Trajectories
from rljax.sharding import batch_shardings, make_mesh
from rljax.trainer.prepare import PrepareConfig, prepare
from rljax.trace import Tracer, choose_groups, faults
from rljax.trace import alerts as A
from rljax.trace.fields import host_rows, summarize

B, S, T, N = 16, 6, 4, 4  # 4 groups of 4 sessions


def _traj(pad=0, leak=False):
    """``B`` real rows (4 groups of ``N``) then ``pad`` padding rows (group 0, as the sampler pads)."""
    rng = np.random.default_rng(0)
    rows = B + pad
    is_padding = np.arange(rows) >= B
    response_mask = np.ones((rows, T), bool) & (~is_padding[:, None] | leak)
    resp_len = response_mask.sum(1)
    uids = [f"1-{b // N}" if b < B else "" for b in range(rows)]
    t = _Traj(
        prompt_ids=rng.integers(1, 9, (rows, S)).astype(np.int32), prompt_mask=~is_padding[:, None].repeat(S, 1),
        response_ids=rng.integers(1, 9, (rows, T)).astype(np.int32), response_mask=response_mask,
        loss_mask=response_mask.copy(), rollout_logp=-np.ones((rows, T), np.float32) * response_mask,
        token_version=np.where(response_mask, 0, -1).astype(np.int32),  # every token sampled at version 0
        prompt_length=np.where(is_padding, 0, S).astype(np.int32), response_length=resp_len.astype(np.int32),
        truncated=resp_len == T, group_id=np.where(is_padding, 0, np.arange(rows) // N),
        min_version=np.zeros(rows, np.int32), max_version=np.zeros(rows, np.int32), is_padding=is_padding,
        queue_s=np.zeros(rows, np.float32), decode_s=np.zeros(rows, np.float32), uid=tuple(uids),
        session=tuple(b % N if b < B else -1 for b in range(rows)), index=tuple(0 if b < B else -1 for b in range(rows)),
        batch_size=rows, num_groups=4,
        decode=types.SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=T, seed=0))
    return t


class _Traj(types.SimpleNamespace):
    def arrays(self):
        return {k: v for k, v in vars(self).items() if isinstance(v, np.ndarray)}

    version_spans = Trajectories.version_spans  # the sampler's spans of token_version


def _stages(tmp_path, traj, mesh, cfg, *, old_logp_shape, attention, metrics, bypass=False, in_update=False, bugs=(),
            gather=False):
    """Synthetic stages of one step (the runner's real protocol, no model): each produces the
    fields the trainer's stage of the same name produces. ``bugs`` provokes one defect each.
    ``in_update``: no old_log_prob stage, the update writes its own old_logp
    (``actor.skip_old_log_prob``). ``gather``: a communication stage after the reward (as
    ``gather_rollout`` on several processes), declared ``comm=True`` by its ``Stage``."""
    from rljax.config import derive
    from rljax.trainer import stages as ST
    from rljax.trainer.runner import Stage

    rows = traj.prompt_ids.shape[0]
    sizes = derive(cfg)
    kept = []  # where a leaking stage keeps the batch

    def dataset_item(b):
        prompts = [types.SimpleNamespace(index=10 + g, position=g, ids=tuple(range(S)), truncated=False)
                   for g in range(4)]
        return {"prompts": prompts, "uids": [f"1-{g}" for g in range(4)], "weight_version": 0}

    def trajectory_fields(b):
        t = b["trajectories"]
        att = np.concatenate([t.prompt_mask, t.response_mask], 1) if attention is None else attention
        loss_mask = t.loss_mask.astype(np.float32)
        if "mask" in bugs:  # the learner drops the first action token of every row
            loss_mask = loss_mask.copy()
            loss_mask[:, 0] = 0
        host = {"input_ids": np.concatenate([t.prompt_ids, t.response_ids], 1), "attention_mask": att,
                "positions": np.maximum(np.cumsum(att, 1) - 1, 0).astype(np.int32), "loss_mask": loss_mask,
                "rollout_logp": t.rollout_logp, "group_id": t.group_id.astype(np.int32), "row_mask": ~t.is_padding}
        faults.learner_fields(host, t, seed=0, step=b["step"], groups=1, version=0)  # the trainer's fault hooks
        shardings = batch_shardings(host, mesh)
        return {k: jax.device_put(v, shardings[k]) for k, v in host.items()}

    def reward(b):
        scores = np.linspace(0, 1, rows).astype(np.float32) * ~b["trajectories"].is_padding
        return {"scores": jax.device_put(scores, NamedSharding(mesh, PartitionSpec("dp")))}

    def old_log_prob(b):
        x = b["input_ids"]
        return {"old_logp": jax.device_put(np.full(old_logp_shape, -0.5, np.float32),
                                           NamedSharding(mesh, PartitionSpec())),
                "entropy": jax.device_put(np.ones((rows, T), np.float32), NamedSharding(mesh, PartitionSpec()))}

    def advantages(b):  # GRPO's, as the trainer's prepare stage computes them (the trace re-derives them)
        fields = {k: b[k] for k in ("scores", "loss_mask", "group_id", "row_mask")}
        return {"advantages": prepare(fields, 0.0, cfg=PrepareConfig(estimator="grpo", num_groups=4))["advantages"]}

    def own_old_logp():
        return jax.device_put(np.full((rows, T), -0.5, np.float32), NamedSharding(mesh, PartitionSpec("dp")))

    def actor_minibatch(b):
        out = {"actor_metrics": {"pg_loss": 0.1, "grad_norm": 1.0}, "optimizer_steps": 1,
               "update_sizes": {"global_batch_size": rows, "ppo_mini_batch_size": sizes.mini_batch_trajectories,
                                "ppo_micro_batch_size": sizes.micro_batch_trajectories, "ppo_epochs": cfg.actor.ppo_epochs,
                                "optimizer_steps_taken": 1}}
        if in_update:
            if "late_old_logp" not in bugs:
                out["old_logp"] = own_old_logp()
        else:
            behaviour = b["rollout_logp"] if bypass and "bypass" not in bugs else b["old_logp"]
            del behaviour
        _ = (b["input_ids"], b["attention_mask"], b["positions"], b["loss_mask"], b["advantages"])
        if "leak" in bugs:
            kept.append(b["advantages"])
        return out

    def weight_sync(b):
        out = {"weight_version_after": 1, "sampler_version": 0 if "stale" in bugs else 1, "weight_sync_s": 0.0}
        if "late_old_logp" in bugs:  # old_logp scored with the updated weights (ratio stuck at 1)
            out["old_logp"] = own_old_logp()
        return out

    def step_metrics(b):
        base = {"actor/ppo_kl": 0.01, "actor/grad_norm": 1.0, "actor/entropy": 1.0, "response_length/mean": float(T),
                "critic/score/mean": 0.5}
        return {"metrics": dict(base, **(metrics or {}))}

    def stage(name, fn, facts=None, reads=None, writes=()):  # the trainer's declarations and facts for each stage
        reads = ST.READS[name] if reads is None else reads
        return Stage(name, fn, reads=reads, writes=(*ST.WRITES[name], *writes), facts=facts)

    learner_reads = ("step", *ST.MODEL_INPUTS, "loss_mask", "advantages", "old_logp", "rollout_logp")
    stages = [stage("dataset_item", dataset_item, ST.dataset_item_facts),
              stage("rollout_sessions", lambda b: {"trajectories": traj}, functools.partial(ST.rollout_facts, n=N)),
              stage("trajectory_fields", trajectory_fields, ST.trajectory_fields_facts),
              stage("reward", reward, ST.reward_facts)]
    if gather:
        stages.append(Stage("gather_rollout", lambda b: (time.sleep(0.01), {})[1], comm=True))
    if (not bypass or "bypass" in bugs) and not in_update:
        stages.append(stage("old_log_prob", old_log_prob))
    stages += [stage("advantages", advantages, functools.partial(ST.advantages_facts, estimator="grpo"),
                     reads=("scores", "loss_mask", "group_id", "row_mask")),
               stage("actor_minibatch", actor_minibatch, functools.partial(
                   ST.actor_minibatch_facts, bypass_mode=bypass, dp=8), reads=learner_reads),
               stage("weight_sync", weight_sync, ST.weight_sync_facts,  # late_old_logp: declared, to reach the trace
                     writes=("old_logp",) if "late_old_logp" in bugs else ()),
               stage("metrics", step_metrics, ST.metrics_facts)]
    return stages, kept


def _step(tmp_path, *, overrides=(), old_logp_shape=None, attention=None, metrics=None, memory=None, pad=0,
          leak=False, bugs=(), steps=1, in_update=None, gather=False):
    from rljax.config import write_resolved
    from rljax.trainer.runner import StepRunner

    tmp_path.mkdir(parents=True, exist_ok=True)
    # one mini-batch: on-policy, so the separate old_log_prob pass is asked for explicitly
    # (actor.skip_old_log_prob=auto in overrides: the update's own old_logp)
    cfg, prov = resolve("default", [f"rollout.n={N}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                                    "actor.skip_old_log_prob=false", *overrides])
    write_resolved(cfg, prov, tmp_path / "config.resolved.yaml")
    (tmp_path / "topology.json").write_text(json.dumps(
        {"world_size": 8, "mesh": {"dp": 8}, "actor_dp": 8, "actor_dp_derivation": "world_size / (tp * sp) = 8",
         "rollout_tp": 1, "rollout_replicas": 8}))
    mesh = make_mesh("dp8")
    tracer = Tracer(cfg, mesh, str(tmp_path))
    if memory is not None:
        tracer.memory_stats = lambda: memory
    traj = _traj(pad, leak)
    rows = B + pad
    in_update = in_update if in_update is not None else cfg.actor.skip_old_log_prob != "false"
    stages, kept = _stages(tmp_path, traj, mesh, cfg, old_logp_shape=old_logp_shape or (rows, T), attention=attention,
                           metrics=metrics, bypass=cfg.algorithm.bypass_mode, in_update=in_update, bugs=bugs,
                           gather=gather)
    runner = StepRunner(stages, [tracer])
    out = {}
    for step in range(1, steps + 1):
        out, _ = runner.run(step, {"step": step})
    tracer.flush()  # the writer thread's records and summary on disk, as the trainer's save flushes them
    return tracer, out


def test_communication_is_what_the_stages_declare(tmp_path):
    """comm_s/*: the weight push a stage times in its weight_sync_s field, and the whole time of a
    stage declared as one communication (Stage(comm=True): gather_rollout on several processes);
    the tracer names no stage for it."""
    _, out = _step(tmp_path / "gather", gather=True)
    assert out["comm_s/gather_rollout"] >= 0.01 and out["comm_s/weight_push"] == 0.0, out
    assert out["timing_s/comm"] == pytest.approx(out["comm_s/gather_rollout"] + out["comm_s/weight_push"])
    _, out = _step(tmp_path / "plain")
    assert not any(k.startswith("comm_s/gather") for k in out) and "comm_s/weight_push" in out


def _records(tmp_path):
    with open(tmp_path / "trace.jsonl") as fh:
        return [json.loads(line) for line in fh]


def test_one_record_per_stage_per_traced_group_with_field_summaries(tmp_path):
    tracer, out = _step(tmp_path)
    recs = _records(tmp_path)
    assert [r["stage"] for r in recs] == ["config_resolve", "dataset_item", "rollout_sessions", "trajectory_fields",
                                          "reward", "old_log_prob", "advantages", "actor_minibatch", "weight_sync",
                                          "metrics", "cleanup"]
    uid = recs[0]["uid"]
    keys = [f"{uid}_{s}_0" for s in range(N)]
    assert all(r["uid"] == uid and r["keys"] == keys for r in recs)
    fields = {f["name"]: f for r in recs for f in r["fields"]}
    lm = fields["loss_mask"]
    assert lm["mask_sum"] == [T] * N and lm["is_padding"] == [False] * N and lm["valid_length"] == [T] * N
    adv = next(f for r in recs if r["stage"] == "advantages" for f in r["fields"] if f["name"] == "advantages")
    assert adv["sharding"]["spec"][0] == "dp" and adv["sharding"]["local_shape"] == [B // 8, T]
    # GRPO over the group's scores 0, 1/15, 2/15, 3/15 (linspace over the 16 rows): -1.16, -0.39, 0.39, 1.16
    np.testing.assert_allclose(adv["row_mean"], [-1.1619, -0.3873, 0.3873, 1.1619], atol=1e-3)
    assert adv["outside_mask_abs_sum"] == 0.0
    assert len(adv["sharding"]["owner_devices"]) == N // (B // 8)
    assert 0 <= out["trace/overhead_frac"] < 1 and out["timing_s/dataset_item"] >= 0
    assert lm["producer"] == "trajectory_fields" and lm["consumers"] == ["advantages", "actor_minibatch"]
    assert recs[-1]["released"] and recs[-1]["tracked_objects"] > 0
    assert not any(k.startswith("alerts/") for k in out), out
    assert all(r["t_start"] <= r["t_end"] for r in recs if r["t_start"] is not None)
    assert tracer.close()["records"] == len(recs)


def test_shape_checksum_mismatch_alert(tmp_path, caplog):
    _, out = _step(tmp_path, old_logp_shape=(B, T - 1))
    assert out.get("alerts/shape_checksum_mismatch") == 1
    assert "old_log_prob" in caplog.text and "resp_len" in caplog.text and "[error]" in caplog.text
    # the tensor named, with the exact width of its layout (the learner's here), not "one of the two"
    assert f"tensor old_logp at stage old_log_prob (step 1, uid 1-" in caplog.text, caplog.text
    assert f"width {T - 1} != {T}, the learner layout's response width" in caplog.text, caplog.text


def test_dp_token_imbalance_alert(tmp_path):
    att = np.zeros((B, S + T), bool)
    att[: B // 8] = True  # every token on the first dp shard
    att[B // 8:, 0] = True
    _, out = _step(tmp_path, attention=att)
    assert out["perf/dp_token_imbalance"] > 1.5 and out.get("alerts/dp_token_imbalance") == 1
    _, out = _step(tmp_path, attention=att, overrides=["trace.alert_dp_imbalance=20"])
    assert "alerts/dp_token_imbalance" not in out


def test_memory_alert(tmp_path):
    stats = [{"bytes_in_use": 95, "bytes_limit": 100, "peak_bytes_in_use": 95}]
    _, out = _step(tmp_path, memory=stats)
    assert out.get("alerts/memory_near_limit") == 1 and out["memory/bytes_in_use"] == 95
    _, out = _step(tmp_path, memory=stats, overrides=["trace.alert_memory_frac=0.99"])
    assert "alerts/memory_near_limit" not in out
    assert A.memory_alert([None], 0.5) is None  # CPU reports no statistics


@pytest.mark.parametrize("key,name,values", [
    ("actor/ppo_kl", "kl_spike", [0.01, 0.012, 0.009, 0.011] * 3 + [0.5]),
    ("actor/grad_norm", "grad_norm_spike", [1.0, 1.1, 0.9, 1.0] * 3 + [30.0]),
    ("actor/entropy", "entropy_spike", [1.0, 1.1, 0.9, 1.0] * 3 + [0.01]),
])
def test_spike_alerts(key, name, values):
    det = A.SpikeDetector(factor=10, window=20)
    fired = [det.update({key: v}) for v in values]
    assert all(not f for f in fired[:-1]) and fired[-1][0][0] == name
    calm = A.SpikeDetector(factor=100, window=20)
    assert not any(calm.update({key: v}) for v in values)


def test_spike_alerts_stay_quiet_without_a_baseline():
    """Issue 25: a 6-step run alerted 'ppo_kl=-0.0015 > 10.0 x running median 1e-06'."""
    det = A.SpikeDetector(factor=10, window=20)
    assert not any(det.update({"actor/ppo_kl": v, "actor/grad_norm": g})
                   for v, g in zip([0.0, 0.0, 0.0, 0.0, 0.0, -0.0015], [1.0, 1.0, 1.0, 1.0, 1.0, 5.0]))
    zero = A.SpikeDetector(factor=10, window=20)  # exactly on-policy: KL 0 at every step is no baseline
    assert not any(zero.update({"actor/ppo_kl": v}) for v in [0.0] * 12 + [-0.0015])


def test_spike_alerts_watch_the_first_window_against_a_warm_up_baseline():
    """Issue 35 item 4: a spike in the first trace.alert_spike_window steps fired nothing (10 steps of
    history were needed); from the fourth step the median of the steps so far is the baseline."""
    det = A.SpikeDetector(factor=10, window=20)
    fired = [det.update({"actor/grad_norm": g}) for g in [1.0, 1.2, 0.9, 30.0]]
    assert not any(fired[:3]) and fired[3] == [("grad_norm_spike", "actor/grad_norm=30 > 10.0 x running median 1")]
    early = A.SpikeDetector(factor=10, window=20)  # two steps are no baseline yet
    assert not any(early.update({"actor/grad_norm": g}) for g in [1.0, 30.0])


def test_host_rows_reads_only_owning_shards_and_matches_numpy():
    mesh = make_mesh("dp2,tp2,sp2")
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    arr = jax.device_put(x, batch_shardings({"x": x}, mesh)["x"])
    rows = np.array([2, 3, 5])
    np.testing.assert_array_equal(host_rows(arr, rows), x[rows])
    f = summarize("x", arr, producer="a", consumers=["c"], rows=rows, mask_rows=(x > 10)[rows], values=True)
    assert f["sharding"]["local_shape"] == [4, 3] and f["mask_sum"] == [6, 6, 6]


def test_traced_groups_are_deterministic_and_rotate():
    assert choose_groups(0, 5, 32, 1) == choose_groups(0, 5, 32, 1)
    assert len({choose_groups(0, s, 32, 1)[0] for s in range(1, 40)}) > 5
    assert choose_groups(0, 1, 4, 10) == [0, 1, 2, 3] and choose_groups(0, 1, 4, 0) == []


def test_padding_rows_are_kept_out_and_a_leak_fails_the_padding_check(tmp_path):
    from rljax.trace.check import Run, check_padding

    _step(tmp_path / "ok", pad=8)
    recs = _records(tmp_path / "ok")
    mb = next(r for r in recs if r["stage"] == "actor_minibatch")["minibatch"]
    assert mb["global_batch_size"] == B + 8 and mb["loss_tokens_on_padding_rows"] == 0
    assert mb["advantages_on_padding_rows_abs_sum"] == 0.0
    assert next(r for r in recs if r["stage"] == "reward")["padding_rows"] == 8
    assert all(len(r["keys"]) == N for r in recs)  # padding rows (group 0) are never traced
    assert check_padding(Run(str(tmp_path / "ok")))[0] == "PASS"
    _step(tmp_path / "leak", pad=8, leak=True)  # padding rows with a loss mask and advantages
    status, _, detail = check_padding(Run(str(tmp_path / "leak")))
    assert status == "FAIL" and "padding rows" in detail


def test_more_traced_groups_give_more_records(tmp_path):
    _step(tmp_path, overrides=["trace.groups=2"])
    recs = _records(tmp_path)
    assert len({r["uid"] for r in recs}) == 2 and len(recs) == 2 * 11


def test_shape_ledger_rows_from_the_step_arrays_flag_rows_not_split_over_dp(tmp_path):
    _step(tmp_path)
    rows = {r["tensor"]: r for r in json.loads((tmp_path / "shape_ledger.json").read_text())}
    assert rows["loss_mask"]["local_shape"] == [B // 8, T] and "note" not in rows["loss_mask"]
    assert rows["old_logp"]["local_shape"] == [B, T] and "every device holds all" in rows["old_logp"]["note"]
    assert "old_logp" in (tmp_path / "shape_ledger.md").read_text()


def _check(run_dir):
    from rljax.trace.check import run_checks

    return {name: (status, detail) for status, name, detail in run_checks(str(run_dir))}


def _close(tracer):
    tracer.close()


# Provoked bugs: each makes `python -m rljax.trace check` fail, for its own reason.
@pytest.mark.parametrize("bug,overrides,check,why", [
    ("mask", (), "loss_mask consumed by the update == rollout's response_mask", "loss_mask has 3 tokens"),
    ("leak", (), "nothing left in the buffer after cleanup", "advantages"),
    ("bypass", ("algorithm.bypass_mode=true",), "behaviour log-prob from the right producer (bypass_mode)",
     "bypass_mode=true but"),
    ("stale", (), "weight version after each sync == next rollout's version", "sampler 0"),
    ("shape", (), "no error-severity alerts", "shape_checksum_mismatch"),
    # actor.skip_old_log_prob: old_logp from the update itself, but written after the update
    ("late_old_logp", ("actor.skip_old_log_prob=auto",), "behaviour log-prob from the right producer (bypass_mode)",
     "expected old_logp from the update itself"),
])
def test_provoked_bugs_fail_the_check_for_their_own_reason(tmp_path, bug, overrides, check, why):
    good, _ = _step(tmp_path / "good", overrides=overrides)
    _close(good)
    results = _check(tmp_path / "good")
    assert all(s != "FAIL" for s, _ in results.values()), results
    bad, _ = _step(tmp_path / "bad", overrides=overrides, bugs=(bug,) if bug != "shape" else (),
                   old_logp_shape=(B, T - 1) if bug == "shape" else None)
    _close(bad)
    results = _check(tmp_path / "bad")
    status, detail = results[check]
    assert status == "FAIL" and why in detail, (check, results)
    failed = {k for k, (s, _) in results.items() if s == "FAIL"}
    own = {"leak": {check, "no error-severity alerts"},
           "mask": {check, "whole-batch invariants on every row", "no error-severity alerts",
                    "loss mask re-derived from token roles"},  # the token roles re-derive the mask too
           "late_old_logp": {check, "reward / old,ref log-prob / advantage producers and consumers"}}.get(bug, {check})
    assert failed == own, failed


def test_old_logp_from_the_update_passes_only_when_the_update_is_on_policy(tmp_path):
    """actor.skip_old_log_prob: a one-epoch, one-mini-batch run whose update writes old_logp
    passes for that reason; the same trace from a run with two epochs fails (the stage it
    needed is missing and the update's own old_logp is off-policy after the first epoch)."""
    behaviour = "behaviour log-prob from the right producer (bypass_mode)"
    good, _ = _step(tmp_path / "good", overrides=("actor.skip_old_log_prob=auto",))
    _close(good)
    results = _check(tmp_path / "good")
    assert all(s != "FAIL" for s, _ in results.values()), results
    assert "own log-probs, detached" in results[behaviour][1], results[behaviour]
    recs = _records(tmp_path / "good")
    assert "old_log_prob" not in {r["stage"] for r in recs}
    mb = next(r for r in recs if r["stage"] == "actor_minibatch")
    assert mb["behaviour_logp"] == {"field": "old_logp", "producer": "actor_minibatch", "bypass_mode": False,
                                    "in_update": True}
    bad, _ = _step(tmp_path / "bad", overrides=("actor.skip_old_log_prob=auto", "actor.ppo_epochs=2"), in_update=True)
    _close(bad)
    results = _check(tmp_path / "bad")
    status, detail = results[behaviour]
    assert status == "FAIL" and "not exactly on-policy" in detail, results[behaviour]
    assert results["prompt group uid/sessions/keys consistent across every stage"][0] == "FAIL"


def test_group_records_are_checked_against_the_stages_the_runner_ran(tmp_path):
    """The cleanup record lists the stages the step ran; a group missing one of their records fails
    the check, naming it; a trace from before stage records fails in one line saying so."""
    name = "prompt group uid/sessions/keys consistent across every stage"
    tracer, _ = _step(tmp_path / "ok")
    _close(tracer)
    recs = _records(tmp_path / "ok")
    cleanup = next(r for r in recs if r["stage"] == "cleanup")
    assert cleanup["stages"] == [r["stage"] for r in recs][1:-1]  # config_resolve and cleanup are the trace's own
    assert _check(tmp_path / "ok")[name][0] == "PASS"

    def rewrite(dst, keep):
        dst.mkdir()
        for f in (tmp_path / "ok").iterdir():
            (dst / f.name).write_bytes(f.read_bytes())
        (dst / "trace.jsonl").write_text("".join(json.dumps(keep(r)) + "\n" for r in recs if keep(r) is not None))

    rewrite(tmp_path / "missing", lambda r: None if r["stage"] == "reward" else r)
    status, detail = _check(tmp_path / "missing")[name]
    assert status == "FAIL" and "no record of stage(s) the runner ran: reward" in detail, detail
    rewrite(tmp_path / "old", lambda r: {k: v for k, v in r.items() if k != "stages"})
    status, detail = _check(tmp_path / "old")[name]
    assert status == "FAIL" and "predates stage records" in detail and "\n" not in detail, detail


def test_check_cli_exits_1_on_an_error_alert_and_counts_na(tmp_path):
    import subprocess
    import sys

    tracer, _ = _step(tmp_path / "ok")
    _close(tracer)
    out = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(tmp_path / "ok")], capture_output=True,
                         text=True, timeout=120)
    # 2 + the three trainer.mode=async checks + the algorithm.filter_groups one + 3 re-derivations that a tracer
    # driven by hand, without a trainer, cannot run (rewards re-scored, the update's report, sampler weights) + the
    # weight-version line (one step: its sync has no next rollout)
    assert out.returncode == 0 and "10 not applicable" in out.stdout and "N/A   updates finite" in out.stdout, out.stdout
    assert "N/A   weight version after each sync == next rollout's version" in out.stdout, out.stdout
    tracer, _ = _step(tmp_path / "bad", old_logp_shape=(B, T - 1))
    _close(tracer)
    out = subprocess.run([sys.executable, "-m", "rljax.trace", "check", str(tmp_path / "bad")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and "FAIL  no error-severity alerts" in out.stdout, out.stdout


def test_a_failed_run_still_writes_its_summary_with_the_error(tmp_path):
    from rljax.trace.check import check_summary, Run

    tracer, _ = _step(tmp_path)
    tracer.close(error="RuntimeError: boom", step=2)
    s = json.loads((tmp_path / "trace_summary.json").read_text())
    assert s["status"] == "failed" and s["error"] == "RuntimeError: boom" and s["failed_at_step"] == 2
    status, _, detail = check_summary(Run(str(tmp_path)))
    assert status == "FAIL" and "boom" in detail


@pytest.fixture
def fault():
    yield faults.enable
    faults.disable()


@pytest.mark.parametrize("name,tensor,why", [
    ("zero_loss_mask_token", "loss_mask", "loss tokens in the update"),
    ("future_version", "max_version", "max_version 1 > the learner's version 0"),
])
def test_fault_outside_the_traced_group_fails_the_invariants(tmp_path, fault, name, tensor, why):
    """The trainer's own fault hooks (rljax.trace.faults) hit a row the trace does not follow: the traced-group
    checks pass, the whole-batch invariants fail naming the tensor, the step and the uid. (shift_loss_mask needs
    a row with a free position: these rows are full; test_trace_faults.py provokes it in a real run.)"""
    fault(name)
    tracer, _ = _step(tmp_path, overrides=("trainer.seed=0",))
    _close(tracer)
    assert faults.acts(name), f"the fault {name} never acted: {faults.report()}"
    results = _check(tmp_path)
    traced = {r["uid"] for r in _records(tmp_path)}
    status, detail = results["whole-batch invariants on every row"]
    uid = detail.split("(uid ")[1].split(")")[0]
    assert status == "FAIL" and f"step 1 tensor {tensor}" in detail and why in detail, detail
    assert uid not in traced, (uid, traced)
    assert results["loss_mask consumed by the update == rollout's response_mask"][0] == "PASS"
    # the mask re-derived from the token roles sees the zeroed token too (rljax.trace.rederive)
    assert {k for k, (st, _) in results.items() if st == "FAIL"} == {"whole-batch invariants on every row",
                                                                     "no error-severity alerts"} | (
        {"loss mask re-derived from token roles"} if name == "zero_loss_mask_token" else set())


def test_a_field_summary_shared_by_records_is_written_whole_in_each():
    """trace.jsonl's lines encode a field summary several records share once (records._line): each
    line still parses to its whole record."""
    import json

    from rljax.trace.observers.records import _line

    shared = {"name": "loss_mask", "mask_sum": [3, 2], "consumers": ["a", "b"]}
    recs = [{"stage": "a", "fields": [shared], "signature": {"rows": 2}},
            {"stage": "b", "fields": [{"name": "x"}, shared], "reads": ["loss_mask"]}, {"stage": "c", "fields": []}]
    memo: dict = {}
    assert [json.loads(_line(r, memo)) for r in recs] == recs
