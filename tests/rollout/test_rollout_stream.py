"""Streaming admission on the rollout side (rljax.rollout.stream): one driver across batches gives
the same tokens as one ``generate`` call per batch, admits later batches into slots an earlier
batch's tail frees, returns batches in submission order, honours the admit gate, and measures
slot occupancy. The asynchronous trainer's use of it is tested in test_async_streaming.py."""

import functools

import numpy as np
import pytest

from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.rollout import DecodeParams, RljaxEngine, Sampler

CFG = get_config("tiny")
# long-tailed: with top_k=1 (greedy) and no EOS the lengths are max_new_tokens; EOS ids make them vary
DECODE = DecodeParams(temperature=1.0, max_new_tokens=20, seed=3, eos_ids=(5, 9, 11, 13))
BATCHES = [[[17, 4, 99], [3, 8, 120, 45], [30, 31, 32]], [[7, 7, 7, 1], [44, 2]], [[90, 91], [12, 13, 14]]]


@functools.lru_cache(maxsize=None)
def sampler(slots=4):
    eng = RljaxEngine(CFG, num_slots=slots, max_prefill_length=16, max_decode_length=24)
    return Sampler(eng, F.init_params(CFG, seed=0)[1], version=0, steps_per_sync=4, refill_batch=1)


def uids(k, prompts):
    return [f"{k}-{i}" for i in range(len(prompts))]


def stream_all(s, admit=None, n=2):
    st = s.stream(DECODE, n=n, admit=admit)
    for k, p in enumerate(BATCHES):
        st.submit(k, p, uids(k, p))
    out, ahead = [], []
    while st.busy:
        for batch, traj in st.step():
            ahead.append(batch.admitted_ahead)
            out.append((batch.key, traj))
    return st, out, ahead


def test_streamed_batches_equal_one_generate_call_each_and_come_in_order():
    s = sampler()
    st, out, ahead = stream_all(s)
    assert [k for k, _ in out] == [0, 1, 2]
    for k, traj in out:
        ref = s.generate(BATCHES[k], uids=uids(k, BATCHES[k]), n=2, decode=DECODE)
        np.testing.assert_array_equal(traj.response_ids, ref.response_ids)
        np.testing.assert_array_equal(traj.response_length, ref.response_length)
        np.testing.assert_allclose(traj.rollout_logp, ref.rollout_logp, rtol=0, atol=1e-6)
        assert traj.uid == ref.uid and traj.session == ref.session
    lengths = np.concatenate([np.asarray(t.response_length) for _, t in out])
    assert lengths.min() < lengths.max(), "the decode must give a length mix (EOS ids)"
    # 6 + 4 + 4 sessions on 4 slots: the next batches' prompts take slots before batch 0 is complete
    assert ahead[0] > 0
    assert 0 < st.driver.slot_occupancy <= 1
    for _, t in out:
        assert 0 < t.stats.slot_occupancy <= 1


def test_admit_gate_holds_a_batch_until_it_says_yes_and_nothing_is_admitted_ahead():
    s = sampler()
    allowed = {0}
    st = s.stream(DECODE, n=2, admit=lambda b: b.key in allowed)
    for k, p in enumerate(BATCHES):
        st.submit(k, p, uids(k, p))
    got = []
    while st.busy:
        for batch, _ in st.step():
            got.append(batch.key)
            assert batch.admitted_ahead == 0  # the gate held every later batch
            allowed.add(batch.key + 1)
        assert all(b.admitted == 0 for b in st.batches if b.key not in allowed), "a refused batch was admitted"
    assert got == [0, 1, 2]


def test_occupancy_is_higher_streaming_than_batch_at_a_time():
    s = sampler()
    st, _, _ = stream_all(s)
    per_call = []
    for k, p in enumerate(BATCHES):
        per_call.append(s.generate(p, uids=uids(k, p), n=2, decode=DECODE).stats)
    batch_at_a_time = (sum(x.slot_occupancy * x.decode_chunks for x in per_call)
                       / sum(x.decode_chunks for x in per_call))
    assert st.driver.slot_occupancy > batch_at_a_time


def test_bad_batches_are_one_line_errors_before_anything_is_queued():
    s = sampler()
    st = s.stream(DECODE, n=2)
    with pytest.raises(ValueError, match="appears more than once"):
        st.submit(0, [[1, 2], [3]], ["a", "a"])
    with pytest.raises(ValueError, match="n is 0"):
        s.stream(DECODE, n=0)
    assert not st.busy and st.batches == ()


def test_groups_complete_one_by_one_and_can_be_taken_before_their_batch():
    """A client may score whole groups as they complete (dynamic sampling in the asynchronous
    producer): ``groups_done`` lists each prompt once all its sessions finished, and ``take`` gives
    those rows, before the batch is complete, as the batch's trajectories hold them at its end."""
    s = sampler()
    st = s.stream(DECODE, n=2)
    for k, p in enumerate(BATCHES):
        st.submit(k, p, uids(k, p))
    early, final, seen = {}, {}, {}
    while st.busy:
        live = {b.key: b for b in st.batches}
        for batch, traj in st.step():
            final[batch.key] = traj
        for key, b in live.items():
            new = b.groups_done[seen.get(key, 0):]
            seen[key] = len(b.groups_done)
            if new and key not in final:
                early[(key, tuple(new))] = st.take(b, new)
    assert early, "no group completed before its batch: nothing was taken early"
    for (key, groups), traj in early.items():
        ref = final[key]
        rows = [g * 2 + i for g in groups for i in range(2)]
        np.testing.assert_array_equal(traj.response_ids, np.asarray(ref.response_ids)[rows])
        np.testing.assert_array_equal(traj.token_version, np.asarray(ref.token_version)[rows])
        np.testing.assert_allclose(traj.rollout_logp, np.asarray(ref.rollout_logp)[rows], rtol=0, atol=0)
        assert traj.uid == tuple(ref.uid[r] for r in rows) and list(traj.group_id) == [i // 2 for i in range(len(rows))]
    with pytest.raises(ValueError, match="has not finished"):
        st2 = s.stream(DECODE, n=2)
        b = st2.submit(9, BATCHES[0], uids(9, BATCHES[0]))
        st2.take(b, [0])
