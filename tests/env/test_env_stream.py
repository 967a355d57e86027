"""Streaming admission over multi-turn episodes (``rljax.env._rollout.EpisodeStream``, issue 23): one
driver kept across batches gives every batch the episodes ``run_episodes`` gives it alone (same
tokens, log-probs, turns, observations, token versions), admits a later batch's prompts into the
slots an earlier batch's ended episodes free while its other sessions are parked on a tool or
decoding, returns a batch only when every one of its episodes ended, in submission order, and
honours the admit gate. The trainer's use of it: tests/trainer/test_async_streaming.py."""

import numpy as np
import pytest

from rljax.env._rollout import EpisodeStream
from rljax.rollout import DecodeParams
from test_env_kv import PROMPTS, STOP, TOK, Ragged, _sampler
from test_env_rollout import P

# ragged episodes (1 to 3 turns, observations of 0 to 4 tokens), sampled (the keys matter)
DECODE = DecodeParams(max_new_tokens=5, temperature=1.0, eos_ids=(TOK.eos_id,), seed=11)
KW = dict(env_cls=Ragged, tokenizer=TOK, stop_id=STOP, max_turns=3, max_response_tokens=20, max_obs_tokens=4)
EXTRA = [P(tuple(TOK.encode(t, add_bos=True)), t, "3", i) for i, t in enumerate(["ab=", "key zz="])]
BATCHES = [PROMPTS[:2], [PROMPTS[2], EXTRA[0]], EXTRA[1:]]
FIELDS = ("response_ids", "response_mask", "response_attention", "roles", "num_turns", "obs_tokens", "tool_calls",
          "response_length", "truncated", "token_version", "env_reward")


def _uids(k, prompts):
    return [f"{k}-{i}" for i in range(len(prompts))]


def _stream(admit=None, on_return=None):
    st = EpisodeStream(_sampler(4), DECODE, n=2, admit=admit, **KW)
    try:
        for k, p in enumerate(BATCHES):
            st.submit(k, p, _uids(k, p))
        out = []
        while st.busy:
            for batch, traj in st.step():
                # returned only when every episode of it ended (whole groups: group advantages see every session)
                assert all(s.status == "finished" for s in batch.sessions), batch.key
                out.append((batch, traj))
                if on_return is not None:
                    on_return(batch)
            if on_return is not None:
                assert all(b.admitted == 0 for b in st.batches if admit(b) is False), "a refused batch was admitted"
        return st, out
    finally:
        st.close()


@pytest.mark.slow  # ~12 s of compiling and decoding at load 7 (the gate test below covers the stream in the default run)
def test_streamed_episodes_equal_one_run_per_batch_and_later_batches_take_freed_slots():
    from rljax.env import run_episodes

    st, out = _stream()
    assert [b.key for b, _ in out] == [0, 1, 2]
    for batch, traj in out:
        k = batch.key
        ref = run_episodes(_sampler(4), BATCHES[k], uids=_uids(k, BATCHES[k]), n=2, decode=DECODE, **KW)
        for f in FIELDS:
            np.testing.assert_array_equal(np.asarray(getattr(traj, f)), np.asarray(getattr(ref, f)), err_msg=f"{k} {f}")
        np.testing.assert_allclose(traj.rollout_logp, ref.rollout_logp, rtol=0, atol=1e-5)
        assert traj.uid == ref.uid and traj.session == ref.session and traj.turn_spans == ref.turn_spans
        assert traj.episode_stats["turns"] == ref.episode_stats["turns"] == int(np.asarray(traj.num_turns).sum())
        assert 0 < traj.stats.slot_occupancy <= 1
    turns = np.concatenate([np.asarray(t.num_turns) for _, t in out])
    assert turns.min() == 1 and turns.max() >= 2, "episodes must be ragged in turns (some park on a tool)"
    # 4 + 4 + 2 episodes on 4 slots: batch 1's prompts took the slots batch 0's short episodes freed
    assert out[0][0].admitted_ahead > 0
    assert 0 < st.driver.slot_occupancy <= 1


def test_admit_gate_holds_later_batches_of_episodes():
    allowed = {0}

    def admit(batch):
        return batch.key in allowed

    _, out = _stream(admit=admit, on_return=lambda b: allowed.add(b.key + 1))
    assert [b.key for b, _ in out] == [0, 1, 2]
    assert all(b.admitted_ahead == 0 for b, _ in out)  # the gate held every later batch
