"""rljax.trace without a training run: the Tracer's hooks on a synthetic step, each alert
provoked, the shard-reading field summaries, deterministic group choice."""

import json
import types

import jax
import numpy as np
import pytest

from jax.sharding import NamedSharding, PartitionSpec

from rljax.config import resolve
from rljax.sharding import batch_shardings, make_mesh
from rljax.trace import STAGES, Tracer, choose_groups
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
    t = types.SimpleNamespace(
        prompt_ids=rng.integers(1, 9, (rows, S)).astype(np.int32), prompt_mask=~is_padding[:, None].repeat(S, 1),
        response_ids=rng.integers(1, 9, (rows, T)).astype(np.int32), response_mask=response_mask,
        loss_mask=response_mask.copy(), rollout_logp=-np.ones((rows, T), np.float32) * response_mask,
        prompt_length=np.where(is_padding, 0, S).astype(np.int32), response_length=resp_len.astype(np.int32),
        truncated=resp_len == T, group_id=np.where(is_padding, 0, np.arange(rows) // N),
        min_version=np.zeros(rows, np.int32), max_version=np.zeros(rows, np.int32), is_padding=is_padding,
        queue_s=np.zeros(rows, np.float32), decode_s=np.full(rows, 0.01, np.float32), uid=tuple(uids),
        session=tuple(b % N if b < B else -1 for b in range(rows)), index=tuple(0 if b < B else -1 for b in range(rows)))
    return t


def _step(tmp_path, *, overrides=(), old_logp_shape=None, attention=None, metrics=None, memory=None, pad=0,
          leak=False):
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg, _ = resolve("default", [f"rollout.n={N}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=4",
                                 *overrides])
    mesh = make_mesh("dp8")
    tracer = Tracer(cfg, mesh, str(tmp_path), owner=None)
    if memory is not None:
        tracer.memory_stats = lambda: memory
    traj = _traj(pad, leak)
    rows = B + pad
    old_logp_shape = old_logp_shape or (rows, T)
    prompts = [types.SimpleNamespace(index=10 + g, position=g, ids=tuple(range(S)), truncated=False) for g in range(4)]
    decode = types.SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=T, seed=0)
    att = np.concatenate([traj.prompt_mask, traj.response_mask], 1) if attention is None else attention
    host = {"input_ids": np.concatenate([traj.prompt_ids, traj.response_ids], 1), "attention_mask": att,
            "positions": np.zeros((rows, S + T), np.int32), "loss_mask": traj.loss_mask.astype(np.float32),
            "rollout_logp": traj.rollout_logp}
    placed = {k: jax.device_put(v, s) for (k, v), s in zip(host.items(), batch_shardings(host, mesh).values())}
    tracer.submit(1, prompts, [f"1-{g}" for g in range(4)], version=0, decode=decode)
    tracer.rollout(traj)
    scores = np.linspace(0, 1, rows).astype(np.float32) * ~traj.is_padding
    tracer.reward(scores, placed, {"scores": scores})
    old = jax.device_put(np.full(old_logp_shape, -0.5, np.float32), NamedSharding(mesh, PartitionSpec()))
    tracer.logprob("old_log_prob", old_logp=old, entropy=np.ones((rows, T), np.float32))
    adv = jax.device_put(np.ones((rows, T), np.float32) * traj.loss_mask, placed["loss_mask"].sharding)
    tracer.advantages(dict(placed, old_logp=old, advantages=adv))
    tracer.actor_update({"pg_loss": 0.1, "grad_norm": 1.0}, optimizer_steps=1)
    tracer.weight_sync(1, types.SimpleNamespace(version=1, last_weight_sync_s=0.0))
    base = {"actor/ppo_kl": 0.01, "actor/grad_norm": 1.0, "actor/entropy": 1.0, "response_length/mean": float(T)}
    out = tracer.end_step(dict(base, **(metrics or {})), host=host)
    return tracer, out


def _records(tmp_path):
    with open(tmp_path / "trace.jsonl") as fh:
        return [json.loads(line) for line in fh]


def test_one_record_per_stage_per_traced_group_with_field_summaries(tmp_path):
    tracer, out = _step(tmp_path)
    recs = _records(tmp_path)
    assert [r["stage"] for r in recs] == [s for s in STAGES if s != "reference"]
    uid = recs[0]["uid"]
    keys = [f"{uid}_{s}_0" for s in range(N)]
    assert all(r["uid"] == uid and r["keys"] == keys for r in recs)
    fields = {f["name"]: f for r in recs for f in r["fields"]}
    lm = fields["loss_mask"]
    assert lm["mask_sum"] == [T] * N and lm["is_padding"] == [False] * N and lm["valid_length"] == [T] * N
    adv = next(f for r in recs if r["stage"] == "advantages" for f in r["fields"] if f["name"] == "advantages")
    assert adv["sharding"]["spec"][0] == "dp" and adv["sharding"]["local_shape"] == [B // 8, T]
    assert adv["row_mean"] == [1.0] * N and adv["outside_mask_abs_sum"] == 0.0
    assert len(adv["sharding"]["owner_devices"]) == N // (B // 8)
    assert 0 <= out["trace/overhead_frac"] < 1 and out["timing_s/dataset_item"] >= 0
    assert not any(k.startswith("alerts/") for k in out), out
    assert all(r["t_start"] <= r["t_end"] for r in recs)
    assert tracer.close()["records"] == len(recs)


def test_shape_checksum_mismatch_alert(tmp_path, caplog):
    _, out = _step(tmp_path, old_logp_shape=(B, T - 1))
    assert out.get("alerts/shape_checksum_mismatch") == 1
    assert "old_log_prob" in caplog.text and "resp_len" in caplog.text


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
    ("actor/ppo_kl", "kl_spike", [0.01, 0.012, 0.009, 0.011, 0.5]),
    ("actor/grad_norm", "grad_norm_spike", [1.0, 1.1, 0.9, 1.0, 30.0]),
    ("actor/entropy", "entropy_spike", [1.0, 1.1, 0.9, 1.0, 0.01]),
])
def test_spike_alerts(key, name, values):
    det = A.SpikeDetector(factor=10, window=20)
    fired = [det.update({key: v}) for v in values]
    assert all(not f for f in fired[:-1]) and fired[-1][0][0] == name
    calm = A.SpikeDetector(factor=100, window=20)
    assert not any(calm.update({key: v}) for v in values)


def test_host_rows_reads_only_owning_shards_and_matches_numpy():
    mesh = make_mesh("dp2,tp2,sp2")
    x = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    arr = jax.device_put(x, batch_shardings({"x": x}, mesh)["x"])
    rows = np.array([2, 3, 5])
    np.testing.assert_array_equal(host_rows(arr, rows), x[rows])
    f = summarize("x", arr, producer="a:b", consumer="c:d", rows=rows, mask=x > 10, values=True)
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
    assert check_padding(Run(str(tmp_path / "ok")))[0]
    _step(tmp_path / "leak", pad=8, leak=True)  # padding rows with a loss mask and advantages
    ok, _, detail = check_padding(Run(str(tmp_path / "leak")))
    assert not ok and "padding rows" in detail


def test_more_traced_groups_give_more_records(tmp_path):
    _step(tmp_path, overrides=["trace.groups=2"])
    recs = _records(tmp_path)
    assert len({r["uid"] for r in recs}) == 2 and len(recs) == 2 * (len(STAGES) - 1)


def test_shape_ledger_rows_from_the_step_arrays_flag_rows_not_split_over_dp(tmp_path):
    _step(tmp_path)
    rows = {r["tensor"]: r for r in json.loads((tmp_path / "shape_ledger.json").read_text())}
    assert rows["loss_mask"]["local_shape"] == [B // 8, T] and "note" not in rows["loss_mask"]
    assert rows["old_logp"]["local_shape"] == [B, T] and "every device holds all" in rows["old_logp"]["note"]
    assert "old_logp" in (tmp_path / "shape_ledger.md").read_text()
