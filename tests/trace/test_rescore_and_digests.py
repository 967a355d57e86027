"""Rows re-scored by the reward function from their recorded response and their own prompt's answer
(rljax.trace.rescore), and parameter digests that prove which weights were used (rljax._digest)."""

import types

import numpy as np
import pytest

from rljax._digest import DigestLog, hex_digest, param_digest
from rljax.trace.rescore import Rescorer


class _Prompt:
    def __init__(self, answer):
        self.answer = answer

    def reward_extra(self):
        return {}


def _exact(response, answer, **_):
    return float(response.strip() == answer)


def _traj():
    ids = np.array([[1, 2, 0], [3, 0, 0], [4, 5, 6], [7, 0, 0]], np.int32)  # token i decodes to "i"
    return types.SimpleNamespace(response_ids=ids, response_length=np.array([2, 1, 3, 1]),
                                 is_padding=np.array([False, False, False, True]), uid=("1-0", "1-0", "1-1", ""),
                                 session=np.array([0, 1, 0, -1]), index=np.arange(4))


def _fields(scores):
    return {"uids": ["1-0", "1-1"], "prompts": [_Prompt("12"), _Prompt("456")],
            "scored_rows": {"digest": np.zeros(4, np.uint32), "scores": np.asarray(scores, np.float32)}}


def _decode(ids):
    return "".join(str(int(i)) for i in ids)


KEYS = ("1-0_0_0", "1-0_1_1", "1-1_0_2", "_-1_3")


def test_rescore_names_a_score_given_to_the_wrong_row():
    r = Rescorer(_exact, _decode, rows=8)
    traj = _traj()
    rows = r.sample(traj, [], step=1, seed=0)
    assert rows.tolist() == [0, 1, 2]  # every real row (8 asked), never padding
    counts, v = r.check(1, traj, _fields([1.0, 0.0, 1.0, 0.0]), rows, KEYS)
    assert counts["rows"] == 3 and v == []
    # row 2 scored against uid 1-0's answer ("12") by the reward stage: 0 recorded, its own prompt says 1
    counts, v = r.check(1, traj, _fields([1.0, 0.0, 0.0, 0.0]), rows, KEYS)
    assert [(x["uid"], x["session"], x["tensor"], x["stage"]) for x in v] == [("1-1", 0, "scores", "reward")]
    assert "re-scored 1" in v[0]["detail"] and "recorded 0 for session 0" in v[0]["detail"]
    # two sessions' rewards swapped before the reward stage recorded them
    _, v = r.check(1, traj, _fields([0.0, 1.0, 1.0, 0.0]), rows, KEYS)
    assert [x["key"] for x in v] == ["1-0_0_0", "1-0_1_1"]


def test_rescore_sample_is_bounded_and_keeps_the_traced_rows():
    r = Rescorer(_exact, _decode, rows=1)
    traj = _traj()
    rows = r.sample(traj, [2, 3], step=5, seed=0)
    assert 2 in rows and 3 not in rows and len(rows) == 2
    assert (r.sample(traj, [2], step=5, seed=0) == r.sample(traj, [2], step=5, seed=0)).all()


def test_a_nondeterministic_reward_declares_itself():
    def sandbox(response, answer, **_):
        return 1.0

    sandbox.deterministic = False
    assert "declares itself nondeterministic" in Rescorer(sandbox, _decode, rows=1).skip
    sandbox.rescore_tolerance = 0.5
    r = Rescorer(sandbox, _decode, rows=8)
    assert r.skip is None
    _, v = r.check(1, _traj(), _fields([0.7, 1.0, 1.0, 0.0]), np.array([0, 1, 2]), KEYS)
    assert v == []  # within the declared tolerance


def test_digest_is_layout_free_and_sees_every_element():
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    k = jax.random.key(0)
    tree = {"w": jax.random.normal(k, (16, 8)), "b": {"s": jnp.arange(8, dtype=jnp.bfloat16), "i": jnp.arange(3)}}
    d = hex_digest(param_digest(tree))
    mesh = jax.make_mesh((8,), ("x",))
    sharded = {"w": jax.device_put(tree["w"], NamedSharding(mesh, PartitionSpec("x"))), "b": tree["b"]}
    assert hex_digest(param_digest(sharded)) == d  # another layout, the same weights: bit for bit
    replicated = jax.device_put(tree, NamedSharding(mesh, PartitionSpec()))  # one copy per device: digested once
    assert hex_digest(param_digest(replicated)) == d
    moved = jax.device_put({**tree, "w": tree["w"].at[0, 0].add(1.0)}, NamedSharding(mesh, PartitionSpec()))
    assert hex_digest(param_digest(moved)) != d
    for changed in ({**tree, "w": tree["w"].at[15, 7].add(1e-7)},  # one element, one ulp-sized step
                    {**tree, "w": tree["w"].T.reshape(16, 8)},  # the same values elsewhere
                    {"w": tree["w"], "b": {"s": tree["b"]["s"], "i": tree["b"]["i"][::-1]}}):
        assert hex_digest(param_digest(changed)) != d


def test_digest_log_records_installs_and_chunks_by_weights():
    import jax.numpy as jnp

    log = DigestLog()
    old, new = {"w": jnp.ones(4)}, {"w": jnp.full(4, 2.0)}
    log.record("install", 1, new)
    for _ in range(3):
        log.chunk(new, 1)
    log.chunk(old, 2)  # old weights decoding under a new label
    got = sorted((r["kind"], r["version"], r["digest"], r.get("chunks")) for r in log.drain())
    dn, do = hex_digest(param_digest(new)), hex_digest(param_digest(old))
    assert got == sorted([("install", 1, dn, None), ("chunk", 1, dn, 3), ("chunk", 2, do, 1)])
    assert log.drain() == []


@pytest.mark.slow
def test_sampler_records_what_it_installed():
    """The real sampler records the digest of the weights it installed under each version."""
    from rljax.models import functional as F
    from rljax.models.config import get_config
    from rljax.rollout.engine import RljaxEngine
    from rljax.rollout.sampler import Sampler

    cfg = get_config("tiny")
    _, params = F.init_params(cfg, seed=0)
    engine = RljaxEngine(cfg, num_slots=2, max_prefill_length=8, max_decode_length=8)
    sampler = Sampler(engine, params, version=0)
    sampler.digest_log = log = DigestLog()
    sampler.update_weights(params, 1)
    (rec,) = log.drain()
    assert (rec["kind"], rec["version"], rec["digest"]) == ("install", 1, hex_digest(param_digest(params)))


def test_digest_log_reuses_a_digest_only_for_the_very_same_arrays():
    """The old / reference passes take the digest the update computed of its output (DigestLog.known)
    when they read those arrays; a copy (a stale policy) is digested anew, and the log keeps nothing alive."""
    import gc
    import weakref

    import jax
    import jax.numpy as jnp

    log = DigestLog()
    tree = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    declared = jnp.array([1, 2], jnp.uint32)  # not the tree's digest: seen again only when the log reused it
    log.known(tree, declared)
    log.record("old", 1, {"b": tree["b"], "w": tree["w"]})  # another dict, the same arrays (same leaf order)
    copy = jax.tree.map(jnp.copy, tree)  # the same values in other arrays
    log.record("old", 2, copy)
    log.record("reference", 0, {"w": tree["w"], "b": copy["b"]})  # one leaf not the known one
    got = [r["digest"] for r in log.drain()]
    assert got == [hex_digest(declared), hex_digest(param_digest(tree)), hex_digest(param_digest(tree))]
    ref = weakref.ref(copy["w"])
    del copy
    gc.collect()
    assert ref() is None  # the log held the digested copy weakly


def test_digest_reduces_any_layout_to_the_same_words():
    """Every rank (the per-dimension weights, one dimension at a time) and 64-bit / 16-bit leaves."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    x = jax.random.normal(jax.random.key(1), (4, 8, 16))
    tree = {"x": x, "h": x.astype(jnp.bfloat16)[0], "v": jnp.arange(5, dtype=jnp.int32), "s": jnp.float32(3.0)}
    d = hex_digest(param_digest(tree))
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    moved = dict(tree, x=jax.device_put(x, NamedSharding(mesh, PartitionSpec("a", "b"))),
                 h=jax.device_put(tree["h"], NamedSharding(mesh, PartitionSpec(None, ("a", "b")))))
    assert hex_digest(param_digest(moved)) == d
    for changed in (dict(tree, x=x.at[3, 7, 15].set(x[3, 7, 15] + 1)), dict(tree, x=jnp.swapaxes(x, 1, 1)[::-1]),
                    dict(tree, s=jnp.float32(-3.0)), dict(tree, h=tree["h"].at[0, 0].add(1))):
        assert hex_digest(param_digest(changed)) != d
