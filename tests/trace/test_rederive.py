"""Re-derivations on hand-made batches (rljax.trace.rederive, the re-derivation rows of
rljax.trace.invariants.step_facts, the re-derivation checks of python -m rljax.trace check):
each recomputes a value from the inputs it is a function of and names the row where the
producer was wrong, even when the value's consumer agrees with it."""

import types

import numpy as np
import pytest

from rljax.trace import rederive as R
from rljax.trace.invariants import position_digest, step_facts
from rljax.trace.checks import recompute as C
from rljax.trace.checks.recompute import untied_weights

B, T, N = 8, 6, 4  # rows, response width, sessions per prompt


def _traj(*, roles=False):
    """Two prompts x four sessions: ragged responses, the last row padding; with ``roles`` a tool
    observation at t=2 of every row long enough (multi-turn)."""
    length = np.array([6, 3, 4, 1, 5, 2, 6, 0], np.int32)
    within = np.arange(T)[None, :] < length[:, None]
    version = np.where(within, 0, -1).astype(np.int32)
    r = np.where(within, 3, 4).astype(np.int8)
    if roles:
        obs = within & (np.arange(T)[None, :] == 2)
        version[obs], r[obs] = -1, 2
        version[6, 2] = 0  # an observation token the sampler labelled with a version: its role still excludes it
    is_padding = np.arange(B) == B - 1
    t = types.SimpleNamespace(
        response_ids=np.arange(B * T).reshape(B, T).astype(np.int32) % 50 + 3, response_length=length,
        token_version=version, is_padding=is_padding, session=np.array([0, 1, 2, 3, 0, 1, 2, -1]),
        uid=("1-0",) * 4 + ("1-1",) * 3 + ("",), index=np.arange(B), group_id=np.array([0] * 4 + [1] * 4, np.int32),
        batch_size=B)
    if roles:
        t.roles = r
    return t


def _keys(t):
    return tuple(f"{u}_{s}_{i}" for u, s, i in zip(t.uid, t.session, t.index))


@pytest.mark.parametrize("multi_turn", [False, True])
def test_mask_from_roles_names_padding_after_eos_and_observations(multi_turn):
    t = _traj(roles=multi_turn)
    want = R.mask_from_roles(t)
    assert want.sum(1).tolist() == ([5, 2, 3, 1, 4, 2, 5, 0] if multi_turn else [6, 3, 4, 1, 5, 2, 6, 0])
    real = ~t.is_padding
    ok = {"tokens": want.sum(1), "mask_digest": position_digest(want)}
    assert R.compare_masks(1, _keys(t), real, t, ok, stage="actor_minibatch") == []
    bad = want.copy()
    bad[1, 3] = True  # the padding position after row 1's EOS counted (the rollout's own mask and the update agree)
    if multi_turn:
        bad[4, 2] = True  # row 4's observation token counted
    got = R.compare_masks(1, _keys(t), real, t, {"tokens": bad.sum(1), "mask_digest": position_digest(bad)},
                          stage="actor_minibatch")
    assert [(v["uid"], v["session"], v["tensor"]) for v in got] == [("1-0", 1, "loss_mask")] + \
        ([("1-1", 0, "loss_mask")] * multi_turn)
    assert "the token roles give 3" in got[0]["detail"] if not multi_turn else "give 2" in got[0]["detail"]
    moved = want.copy()
    moved[2, 0], moved[2, 4] = False, True  # same count, another position
    got = R.compare_masks(1, _keys(t), real, t, {"tokens": moved.sum(1), "mask_digest": position_digest(moved)},
                          stage="actor_minibatch")
    assert [v["key"] for v in got] == ["1-0_2_2"] and "the same count at other positions" in got[0]["detail"]


def test_group_ids_must_partition_rows_as_the_uids_do():
    t = _traj()
    real = ~t.is_padding
    assert R.compare_group_ids(1, _keys(t), real, np.array([5, 5, 5, 5, 9, 9, 9, 0]), list(t.uid)) == []  # labels free
    wrong = np.array([0, 0, 0, 1, 1, 1, 1, 1])  # row 3 (uid 1-0) grouped with uid 1-1
    got = R.compare_group_ids(1, _keys(t), real, wrong, list(t.uid))
    assert [(v["key"], v["tensor"], v["stage"]) for v in got] == [("1-0_3_3", "group_id", "trajectory_fields")]
    assert "grouped with 1-1" in got[0]["detail"]
    merged = np.zeros(B, np.int32)  # two uids in one group: the second uid's rows named
    assert [v["uid"] for v in R.compare_group_ids(1, _keys(t), real, merged, list(t.uid))] == ["1-1"] * 3


def _device_batch(t, scores, *, wrong_groups=False):
    import jax.numpy as jnp

    from rljax import loss as rl

    mask = R.mask_from_roles(t).astype(np.float32)
    groups = t.group_id.copy()
    if wrong_groups:
        groups[3] = 1  # what the producer normalised over
    tok = np.zeros((B, T), np.float32)
    for i in range(B):
        if mask[i].any():
            tok[i, np.flatnonzero(mask[i])[-1]] = scores[i]
    adv, _ = rl.get_adv_estimator("grpo")(jnp.asarray(tok), jnp.asarray(mask), group_id=jnp.asarray(groups),
                                          num_groups=2, row_mask=jnp.asarray(~t.is_padding), values=None,
                                          config={"norm_adv_by_std_in_grpo": True})
    return jnp.asarray(mask), adv


@pytest.mark.parametrize("wrong_groups", [False, True])
def test_advantages_and_positions_re_derived_in_the_one_reduction(wrong_groups):
    import jax.numpy as jnp

    t = _traj()
    scores = np.array([1, 0, 1, 1, 0, 0, 1, 0], np.float32)
    mask, adv = _device_batch(t, scores, wrong_groups=wrong_groups)
    attn = np.ones((B, 3 + T), bool)
    positions = np.cumsum(attn, 1) - 1
    positions[6, 3:] = np.arange(T)  # row 6's response restarts its positions
    key, na = R.estimator_key("grpo", {"norm_adv_by_std_in_grpo": True}, use_kl_in_reward=False, num_groups=2,
                              critic=False)
    assert na is None
    _, extra = step_facts([(mask, None)], None, mask, jnp.asarray(scores), estimator=key,
                          advantages={"advantages": adv, "loss_mask": mask, "group_ids": R.uid_groups(list(t.uid)),
                                      "row_mask": ~t.is_padding},
                          positions=(jnp.asarray(attn), jnp.asarray(positions, jnp.int32)),
                          passthrough={"group_id": jnp.asarray(t.group_id)})
    assert extra["group_id"].tolist() == t.group_id.tolist()
    got = R.compare_advantages(1, _keys(t), ~t.is_padding, extra["advantage_error"], estimator="grpo")
    if wrong_groups:  # row 3 moved: both groups' statistics change
        assert {v["uid"] for v in got} == {"1-0", "1-1"} and all(v["tensor"] == "advantages" for v in got)
    else:
        assert got == [] and extra["advantage_error"].max() < 1e-6
    pos = R.compare_positions(1, _keys(t), ~t.is_padding, extra["position_errors"], stage="actor_minibatch")
    assert [(v["key"], v["tensor"]) for v in pos] == [("1-1_2_6", "positions")]
    # the KL-in-reward estimator is not re-derived: the check says why (N/A), never a pass
    assert R.estimator_key("grpo", {}, use_kl_in_reward=True, num_groups=2, critic=False)[0] is None


def _run(section):
    return types.SimpleNamespace(summary={"recompute": section})


def test_each_check_fails_passes_or_says_why_not():
    checks = {"rewards": C.check_rewards_rescored, "advantages": C.check_advantages_rederived,
              "positions": C.check_positions_rederived}
    v = {"check": "rewards", "step": 3, "tensor": "scores", "stage": "reward", "key": "3-1_2_6", "uid": "3-1",
         "session": 2, "row": 6, "detail": "re-scored 0 ..."}
    status, _, detail = checks["rewards"](_run({"rewards": {"steps": 2, "rows": 9, "violating_rows": 1,
                                                             "violations": [v]}}))
    assert status == "FAIL" and "step 3 tensor scores at reward, 3-1_2_6 (uid 3-1, session 2)" in detail
    assert checks["rewards"](_run({"rewards": {"steps": 2, "rows": 9, "violations": []}}))[0] == "PASS"
    # never a pass when it did not run, or could not
    assert checks["rewards"](_run({"rewards": {"steps": 0, "rows": 0, "violations": []}}))[0] == "N/A"
    status, _, detail = checks["advantages"](_run({"advantages": {"steps": 0, "rows": 0, "violations": [],
                                                                   "na": "use_kl_in_reward"}}))
    assert (status, detail) == ("N/A", "use_kl_in_reward")
    assert checks["positions"](types.SimpleNamespace(summary={}))[0] == "N/A"


def test_weights_check_ties_every_sampler_record_to_the_learners_digest():
    st = {"steps": 3, "rows": 4, "violations": [], "learner": {"0": "aa", "1": "bb", "2": "cc"},
          "sampler": [{"kind": "chunk", "version": 0, "digest": "aa", "step": 1, "count": 3},
                      {"kind": "install", "version": 1, "digest": "bb", "step": 1, "count": 1},
                      {"kind": "install", "version": 2, "digest": "bb", "step": 2, "count": 1},  # old weights, new label
                      {"kind": "chunk", "version": 2, "digest": "bb", "step": 3, "count": 2}]}
    assert untied_weights(st) == ("step 2: the sampler install labelled version 2 with weights digest bb, the "
                                  "learner's version 2 has cc")
    check = C.check_weights_tied
    assert check(_run({"weights": st}))[0] == "FAIL"
    st["sampler"] = st["sampler"][:2]
    assert check(_run({"weights": st}))[0] == "PASS"


def test_an_update_that_starts_from_other_weights_than_the_last_one_left_fails():
    """The update's "before" digest is compared with the learner's digest of its version (the previous
    update's "after"); before, the first digest recorded for a version stuck and the next update's
    "before" was never compared."""
    from rljax._digest import LOG
    from rljax.config import resolve
    from rljax.trace.recompute import Recompute

    rc = Recompute(resolve("default", [])[0])
    t = _traj()
    t.min_version, t.max_version = np.zeros(B, np.int32), np.zeros(B, np.int32)
    LOG.clear()

    def update(step, version, before, after):
        report = {"param_digest_before": np.array([before, 0], np.uint32),
                  "param_digest_after": np.array([after, 0], np.uint32)}
        return rc._weights(step, t, {}, report, _keys(t), version)

    assert update(1, 0, 10, 11) is None  # nothing to tie yet
    assert not update(2, 1, 11, 12)  # started from what step 1 left
    bad = update(3, 2, 99, 13) or []  # started from other parameters than step 2 left (12)
    assert len(bad) == 1 and bad[0]["step"] == 3 and bad[0]["stage"] == "actor_minibatch", bad
    assert "the update started from parameters with digest" in bad[0]["detail"], bad
    assert rc.learner[2] != bad[0]["detail"].split("digest ")[1].split(",")[0]
