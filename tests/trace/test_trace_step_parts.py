"""The tracer's per-step parts made with fewer host calls record what the plain reading records:
the records' field summaries (each == :func:`rljax.trace.fields.summarize` of the array over the
group's rows, as the batch-field table says to read it), the length percentiles (== np.percentile,
bit for bit), the bytes per field (== the arrays' ``nbytes``) and the uids each process generated."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import NamedSharding, PartitionSpec

from rljax.config import resolve
from rljax.rollout.trajectory import Trajectories
from rljax.sharding import make_mesh
from rljax.trace.batch_fields import BY_NAME
from rljax.trace.fields import host_rows, summarize
from rljax.trace.observers.perf import Perf, _percentiles, percentiles
from rljax.trace.observers.records import Records
from rljax.trace.observers.rollouts import Rollouts
from rljax.trace.observers.step import StepView
from rljax.trainer.runner import StageEvent

B, S, T, N = 16, 5, 4, 4  # 3 groups of 4 sessions, then 4 padding rows (group 0, as the sampler pads)


def test_percentiles_are_numpys_bit_for_bit():
    """The sort-and-interpolate path (integers of 32 bits or more, below 2**30) and the fallback
    (narrow integers, whose differences numpy wraps; floats; NaN) give np.percentile's floats."""
    rng = np.random.default_rng(0)
    fast = 0
    for i in range(3000):
        n = int(rng.integers(1, 600))
        dtype = [np.int32, np.int64, np.uint32, np.uint16, np.int16, np.int8, np.float32, np.float64][i % 8]
        top = {np.int8: 127, np.int16: 32767, np.uint16: 65535}.get(dtype, [1, 7, 300, 2 ** 29, 2 ** 31 - 1][i % 5])
        low = 0 if np.dtype(dtype).kind == "u" else -top
        x = rng.integers(low, top, n, endpoint=True).astype(dtype)
        if dtype == np.float64 and i % 3 == 0:
            x[rng.integers(n)] = np.nan
        fast += np.dtype(dtype).kind in "iu" and np.dtype(dtype).itemsize >= 4 and top < 2 ** 30
        want = [float(v) for v in np.percentile(x, [50, 90, 99])]
        got = percentiles(x)
        assert [np.float64(v).tobytes() for v in got] == [np.float64(v).tobytes() for v in want], (x.dtype, n, got, want)
        assert all(type(v) is float for v in got)
    assert fast >= 800  # the mix holds many inputs of the sort path
    x = np.array([3, 1, 2], np.int32)
    assert list(_percentiles(x, "len")) == ["len/mean", "len/min", "len/max", "len/p50", "len/p90", "len/p99"]
    assert _percentiles(x, "len", stats=False) == {"len/p50": 2.0, "len/p90": 2.8, "len/p99": 2.98}
    assert _percentiles(x[:0], "len") == {}


def _trajectories() -> Trajectories:
    rng = np.random.default_rng(1)
    pad = np.arange(B) >= B - N
    resp_len = np.where(pad, 0, rng.integers(1, T + 1, B)).astype(np.int32)
    prompt_len = np.where(pad, 0, rng.integers(1, S + 1, B)).astype(np.int32)
    response_mask = np.arange(T)[None, :] < resp_len[:, None]
    loss_mask = response_mask & (rng.random((B, T)) < 0.8)  # an observation token here and there
    prompt_mask = np.arange(S)[None, :] >= (S - prompt_len)[:, None]
    uids = tuple(f"7-{b // N}" if not pad[b] else "" for b in range(B))
    return Trajectories(
        prompt_ids=rng.integers(1, 50, (B, S)).astype(np.int32) * prompt_mask, prompt_mask=prompt_mask,
        response_ids=rng.integers(1, 50, (B, T)).astype(np.int32) * response_mask, response_mask=response_mask,
        loss_mask=loss_mask, rollout_logp=(-rng.random((B, T)) * response_mask).astype(np.float32),
        prompt_length=prompt_len, response_length=resp_len, truncated=resp_len == T,
        group_id=np.where(pad, 0, np.arange(B) // N).astype(np.int32), min_version=np.zeros(B, np.int32),
        max_version=np.zeros(B, np.int32), is_padding=pad, queue_s=np.zeros(B, np.float32),
        prefill_s=np.zeros(B, np.float32), decode_s=np.zeros(B, np.float32), uid=uids,
        session=tuple(b % N if not pad[b] else -1 for b in range(B)), index=tuple(0 if not pad[b] else -1 for b in range(B)),
        decode=None, stats=None, num_groups=3, token_version=np.where(response_mask, 0, -1).astype(np.int32))


def _step(traj):
    """One step's stage events as the runner makes them: the learner's fields sharded over dp8 rows."""
    rows = NamedSharding(make_mesh("dp8"), PartitionSpec("dp"))
    rng = np.random.default_rng(2)

    def dev(x):
        return jax.device_put(np.asarray(x), rows)
    ids, attn = traj.sequences()
    loss_mask = dev(traj.loss_mask & ~traj.is_padding[:, None])
    learner = {"input_ids": dev(ids), "attention_mask": dev(attn), "positions": dev(np.maximum(np.cumsum(attn, 1) - 1, 0)),
               "loss_mask": loss_mask, "rollout_logp": dev(traj.rollout_logp)}
    old = {"old_logp": dev(rng.normal(size=(B, T)).astype(np.float32)),
           "entropy": dev(rng.random((B, T)).astype(np.float32))}
    scores = {"scores": rng.normal(size=B).astype(np.float32)}  # host [B]: the sampler's layout
    adv = {"advantages": dev(rng.normal(size=(B, T)).astype(np.float32)), "token_level_rewards": jnp.zeros((B, T))}
    producers = {"trajectories": "rollout_sessions", **{k: "trajectory_fields" for k in learner},
                 **{k: "old_log_prob" for k in old}, "scores": "reward", **{k: "advantages" for k in adv}}

    def ev(stage, reads, writes, t):
        return StageEvent(step=3, stage=stage, reads=reads, writes=writes,
                          producers={k: producers[k] for k in {**reads, **writes} if k in producers}, aliases={},
                          t_start=float(t), t_end=t + 0.5)
    return [ev("rollout_sessions", {"step": 3}, {"trajectories": traj}, 1),
            ev("trajectory_fields", {"trajectories": traj}, learner, 2),
            ev("reward", {"trajectories": traj}, scores, 3),
            ev("old_log_prob", {k: learner[k] for k in ("input_ids", "attention_mask", "positions")}, old, 4),
            ev("advantages", {**scores, "loss_mask": loss_mask}, adv, 5),
            ev("actor_minibatch", {**learner, **old, "advantages": adv["advantages"], "trajectories": traj},
               {"actor_metrics": {"pg_loss": 0.5}}, 6)]


def _reference(name, x, producer, consumers, traj, g, loss_mask) -> dict:
    """A field's summary read the plain way: summarize() of the array over the group's real rows,
    with the valid length, mask and values the batch-field table names."""
    row = BY_NAME[name]
    rows = np.nonzero((traj.group_id == g) & ~traj.is_padding)[0]
    sampler = isinstance(x, np.ndarray)
    lengths = {"prompt": traj.prompt_length, "response": traj.response_length,
               "sequence": traj.prompt_length + traj.response_length}
    if row.mask:
        mask = host_rows(x, rows)
    elif row.valid == "response":
        mask = traj.response_mask[rows] if sampler else host_rows(loss_mask, rows)
    else:
        mask = None
    out = summarize(name, x, producer=producer, consumers=consumers, rows=rows,
                    valid_length=lengths.get(row.valid), mask_rows=mask, is_padding=traj.is_padding, values=row.values)
    return {**out, "layout": "sampler" if sampler else "learner"}


def test_record_fields_are_summarize_of_each_array(tmp_path):
    """Every field of every traced group's records (2 groups: nothing of one group's rows reaches the
    other's) == summarize() of that array; the light summary the step's checks read (shape, layout,
    mask sums) and the records' signatures agree with the whole one."""
    traj = _trajectories()
    events = _step(traj)
    view = StepView.of(3, events)
    cfg, _ = resolve("default", ["trace.groups=2", "trainer.seed=5"])
    records = Records(cfg, str(tmp_path), enabled=True, wall=lambda t: t)
    sigs = records.step(view, None, {})
    arrays = view.fields
    by_traj = {"prompt_ids": traj.prompt_ids, "prompt_mask": traj.prompt_mask, "response_ids": traj.response_ids,
               "response_mask": traj.response_mask, "sampler_loss_mask": traj.loss_mask,
               "rollout_logp": traj.rollout_logp}
    groups, checked, names = set(), 0, set()
    light = [[dict(f) for f in r["fields"]] for r in records.pending]  # before any is completed (records share them)
    for r, before_all in zip(records.pending, light):
        if r["stage"] == "config_resolve":
            continue
        groups.add(r["group"])
        for f, before in zip(r["fields"], before_all):
            f.complete()
            sampler = f["layout"] == "sampler"
            x = by_traj[f["name"]] if sampler and f["name"] in by_traj else arrays[f["name"]]
            want = _reference(f["name"], x, f["producer"], view.consumers.get(
                "trajectories" if sampler and f["name"] in by_traj else f["name"], []), traj, r["group"], view.loss_mask)
            assert dict(f) == want, (r["stage"], f["name"])
            assert before == {k: want[k] for k in ("name", "shape", "layout", "mask_sum") if k in want}
            checked += 1
            names.add(f["name"])
        fields = r["fields"]
        resp = [f for f in fields if BY_NAME[f["name"]].valid == "response"]
        assert r["signature"] == {
            "keys": r["keys"], "rows": N, "batch": sorted({f["shape"][0] for f in fields}) or None,
            "resp_len": sorted({f["shape"][1] for f in resp if len(f["shape"]) == 2}) or None,
            "mask_sum": sorted({sum(f["mask_sum"]) for f in resp if "mask_sum" in f}) or None}
        assert sigs[r["uid"]][r["stage"]] == r["signature"]
    assert len(groups) == 2 and checked > 60
    assert {"prompt_mask", "sampler_loss_mask", "attention_mask", "loss_mask", "old_logp", "scores",
            "advantages", "input_ids", "positions", "token_level_rewards"} <= names


def test_bytes_per_field_are_the_arrays_nbytes():
    traj = _trajectories()
    events = _step(traj)
    perf = Perf(8, types.SimpleNamespace())
    total = perf._field_bytes(events)
    want = {}
    for ev in events:
        for name, x in ev.writes.items():
            arrays = {f"trajectories.{k}": v for k, v in x.arrays().items()} if name == "trajectories" else \
                {name: x} if hasattr(x, "nbytes") else {}
            want.setdefault(ev.stage, {}).update({k: int(v.nbytes) for k, v in arrays.items()})
    assert perf.bytes == want and total == sum(sum(d.values()) for d in want.values())
    assert all(type(v) is int for d in perf.bytes.values() for v in d.values())


@pytest.mark.parametrize("uids", ["strings", "ints"])
def test_rollout_uids_are_the_real_rows_first_seen(tmp_path, uids):
    pad = np.array([0, 0, 1, 0, 0, 0, 1, 0], bool)
    uid = ("b", "b", "", "a", "c", "a", "", "b") if uids == "strings" else (2, 2, -1, 1, 3, 1, -1, 2)
    rollouts = Rollouts(str(tmp_path), enabled=False, dump=False)
    rollouts.step(1, types.SimpleNamespace(is_padding=pad, uid=uid), {})
    want = [str(u) for u in dict.fromkeys(u for u, p in zip(uid, pad) if not p)]
    assert rollouts.summary["uids_by_process"] == {"0": 3} and want == (["b", "a", "c"] if uids == "strings"
                                                                        else ["2", "1", "3"])
    rollouts.enabled = True
    rollouts.step(2, types.SimpleNamespace(is_padding=pad, uid=uid), {})
    assert (tmp_path / "rollout_uids.jsonl").read_text() == '{"step":2,"by_process":{"0":%s}}\n' % str(want).replace(
        "'", '"').replace(" ", "")


def test_version_spans_are_the_per_token_reading():
    """Trajectories.version_spans (a short row: one pass over its list; a long one: numpy) == the
    spans read token by token: a new span where the version of the sampled tokens changes."""
    def plain(tv):
        idx = [i for i in range(len(tv)) if tv[i] >= 0]
        return [[int(i), int(tv[i])] for j, i in enumerate(idx) if j == 0 or tv[i] != tv[idx[j - 1]]]
    rng = np.random.default_rng(3)
    for width in (1, 3, 64, 65, 300):
        tv = rng.integers(-1, 3, (40, width)).astype(np.int32)
        tv[::7] = -1  # no sampled token
        tv[1::5] = np.sort(tv[1::5], axis=1)  # a few versions in order, with unsampled positions first
        traj = types.SimpleNamespace(token_version=tv)
        for b in range(tv.shape[0]):
            got = Trajectories.version_spans(traj, b)
            assert got == plain(tv[b]) and all(type(v) is int for s in got for v in s), (width, b, got)
    assert Trajectories.version_spans(types.SimpleNamespace(token_version=None), 0) is None


def test_summaries_made_from_shared_facts_share_no_list(tmp_path):
    """The fields of one layout derive their valid lengths, padding flags, mask sums and owner devices
    once (a memo per layout, a cache per sharding); each summary still gets lists of its own, so a
    change to one record's summary (a reader's, a test's) reaches no other summary, nor a later step's."""
    traj = _trajectories()
    view = StepView.of(3, _step(traj))
    cfg, _ = resolve("default", ["trace.groups=2", "trainer.seed=5"])

    def summaries() -> list:
        records = Records(cfg, str(tmp_path), enabled=True, wall=lambda t: t)
        records.step(view, None, {})
        return list({id(f): f.complete() for r in records.pending for f in r["fields"]}.values())

    first = summaries()
    lists = [(f["name"], k, v) for f in first for k, v in (*f.items(), *f["sharding"].items())
             if k in ("valid_length", "mask_sum", "is_padding", "owner_devices")]
    assert len({k for _, k, _ in lists}) == 4 and len(lists) > 40
    assert len({id(v) for _, _, v in lists}) == len(lists), "a list object is shared by two summaries"
    want = [json.dumps(f) for f in summaries()]
    for _, _, v in lists:  # a reader changes the first step's summaries: the next ones are as before
        v.append(-1)
    assert [json.dumps(f) for f in summaries()] == want
