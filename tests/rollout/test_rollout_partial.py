"""Partial rollout with a per-token weight-version record (issue 23 item 3): a weight push
between decode chunks steps each row's ``token_version`` up at the install point under
``partial_rollout`` ``keep`` and ``recompute``; ``recompute`` re-prefills the context so the
tokens after the push are the ones a fresh run from that context with the new weights draws;
the tokens before it keep the old weights' tokens and log-probs; ``min_version`` is the minimum
over the row's tokens. The trainer's use (async metrics, the trace check) is in
test_async_streaming.py."""

import functools

import jax
import numpy as np
import pytest

from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.rollout import DecodeParams, RljaxEngine, Sampler
from rljax.rollout.driver import NO_VERSION, Driver
from rljax.rollout.sampling import sample_tokens, trajectory_keys

CFG = get_config("tiny")
# no EOS: every row runs 20 tokens, so the push lands mid-row for the rows in slots
DECODE = DecodeParams(temperature=1.0, max_new_tokens=20, seed=3)
PROMPTS = [[17, 4, 99], [3, 8, 120, 45], [30, 31, 32], [7, 7, 7, 1]]
UIDS = ["a", "b", "c", "d"]
N = 2
PUSH_AFTER_CHUNK = 1  # 4 steps a chunk: the rows in slots have 1 + 2 * 4 = 9 tokens at the push


@functools.lru_cache(maxsize=None)
def weights():
    graphdef, p0 = F.init_params(CFG, seed=0)
    return graphdef, p0, F.init_params(CFG, seed=1)[1]


def run(mode, push=True):
    _, p0, p1 = weights()
    eng = RljaxEngine(CFG, num_slots=4, max_prefill_length=16, max_decode_length=24)
    s = Sampler(eng, p0, version=0, steps_per_sync=4, refill_batch=1, partial_rollout=mode)

    def on_chunk(info):
        if push and info.chunk == PUSH_AFTER_CHUNK and s.version == 0:
            s.update_weights(p1, 1)

    return s.generate(PROMPTS, uids=UIDS, n=N, decode=DECODE, on_chunk=on_chunk), eng


@functools.lru_cache(maxsize=None)
def runs():
    return {"keep": run("keep"), "recompute": run("recompute"), "none": run("keep", push=False)}


def teacher_forced(params, traj, row):
    """``(tokens, logp)`` a fresh run with ``params`` draws for each response position of ``row``
    from the context of the prompt and the row's tokens before it (one full forward, causal)."""
    graphdef = weights()[0]
    prompt = np.asarray(traj.prompt_ids[row])[np.asarray(traj.prompt_mask[row])]
    resp = np.asarray(traj.response_ids[row, : traj.response_length[row]])
    ids = np.concatenate([prompt, resp])[None].astype(np.int32)
    logits = F.compute_logits(params, F.forward(graphdef, params, ids))[0, len(prompt) - 1 : -1]
    key = trajectory_keys(DECODE.seed, [traj.uid[row]], [traj.session[row]])[0]
    keys = jax.vmap(lambda t: jax.random.fold_in(key, t))(np.arange(len(resp), dtype=np.uint32))
    tok, logp = sample_tokens(logits, keys, temperature=DECODE.temperature, top_k=DECODE.top_k, top_p=DECODE.top_p)
    return np.asarray(tok), np.asarray(logp)


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_token_versions_step_up_at_the_install_point(mode):
    traj, _ = runs()[mode]
    tv = np.asarray(traj.token_version)
    mask = np.asarray(traj.response_mask)
    assert tv.shape == traj.response_ids.shape and tv.dtype == np.int32
    assert (tv[~mask] == NO_VERSION).all()
    first = np.arange(tv.shape[0]) < 4  # prompts 0, 1 (2 sessions each) held the 4 slots at the push
    for b in range(tv.shape[0]):
        row = tv[b, mask[b]]
        assert (np.diff(row) >= 0).all(), f"row {b}: versions go down: {row}"
        assert row.min() == traj.min_version[b], "min_version is the minimum over the row's tokens"
        assert row.max() <= traj.max_version[b]
        assert traj.version_spans(b) == ([[0, 0], [9, 1]] if first[b] else [[0, 1]]), (b, traj.version_spans(b))
    spans = np.asarray(traj.min_version) < np.asarray(traj.max_version)
    np.testing.assert_array_equal(spans, first)


def test_recompute_draws_what_a_fresh_run_from_the_reprefilled_context_draws():
    _, p0, p1 = weights()
    rec, eng = runs()["recompute"]
    keep, _ = runs()["keep"]
    none, _ = runs()["none"]
    assert eng.stats["reprefill_slots"] == 4 and eng.stats["reprefill_calls"] >= 1
    k = 9
    for b in range(4):  # the rows that spanned the push
        # before the push: the old weights' tokens and log-probs, in both modes, as without a push
        for traj in (rec, keep):
            np.testing.assert_array_equal(traj.response_ids[b, :k], none.response_ids[b, :k])
            np.testing.assert_allclose(traj.rollout_logp[b, :k], none.rollout_logp[b, :k], atol=1e-5)
        tok0, logp0 = teacher_forced(p0, rec, b)
        np.testing.assert_allclose(rec.rollout_logp[b, :k], logp0[:k], atol=2e-4)
        # after it: recompute's tokens and log-probs are the new weights' from the re-prefilled context
        tok1, logp1 = teacher_forced(p1, rec, b)
        np.testing.assert_array_equal(rec.response_ids[b, k:], tok1[k:])
        np.testing.assert_allclose(rec.rollout_logp[b, k:], logp1[k:], atol=2e-4)
        # keep decodes on over the old weights' cache: not the new weights' fresh log-probs
        _, logp1_keep = teacher_forced(p1, keep, b)
        assert np.abs(keep.rollout_logp[b, k:] - logp1_keep[k:]).max() > 1e-3, b
    # rows that started after the push are the same in both modes (nothing to recompute)
    np.testing.assert_array_equal(rec.response_ids[4:], keep.response_ids[4:])


def test_without_a_push_both_modes_give_the_same_tokens():
    a, _ = run("recompute", push=False)
    b, _ = runs()["none"]
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.rollout_logp, b.rollout_logp)
    assert (np.asarray(a.token_version)[np.asarray(a.response_mask)] == 0).all()


def test_partial_mode_and_reprefill_inputs_are_checked():
    _, p0, _ = weights()
    eng = RljaxEngine(CFG, num_slots=2, max_prefill_length=8, max_decode_length=4)
    with pytest.raises(ValueError, match="partial_rollout is 'sometimes'; accepted: keep, recompute"):
        Sampler(eng, p0, partial_rollout="sometimes")
    with pytest.raises(ValueError, match="partial is 'x'; accepted: keep, recompute"):
        Driver(eng, Sampler(eng, p0), DECODE, partial="x")
    state = eng.init_decode_state(DecodeParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="slot 0 holds no trajectory"):
        eng.reprefill_many(p0, state, slots=[0], contexts=[[1, 2]])
    with pytest.raises(ValueError, match="slots must be distinct"):
        eng.reprefill_many(p0, state, slots=[0, 0], contexts=[[1], [2]])


def test_partial_rollout_key_accepts_keep_recompute_and_the_old_booleans():
    from rljax.config import resolve
    from rljax.errors import ConfigError
    from rljax.trainer.async_loop import partial_mode

    for value, mode in (("true", "keep"), ("false", "false"), ("keep", "keep"), ("recompute", "recompute")):
        cfg = resolve(overrides=[f"async_training.partial_rollout={value}"])[0]
        assert partial_mode(cfg) == mode, value
    assert partial_mode(resolve()[0]) == "false"
    with pytest.raises(ConfigError, match="async_training.partial_rollout=.*sometimes.* is not accepted; accepted: "
                                          "false, keep, recompute, true"):
        resolve(overrides=["async_training.partial_rollout=sometimes"])
