"""Multi-turn decoding that keeps each session's slot and KV cache across turns
(``run_episodes(continuation="kv")``, ``RljaxEngine.extend_many``) against the recompute
reference (``continuation="reprefill"``): greedy episodes equal token for token, the extended
cache equals a full prefill of the concatenated context, and the earlier context is never
prefilled again (prefilled tokens counted)."""

import functools

import numpy as np
import pytest

from rljax.env import Environment, Step, run_episodes
from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.tokenizer import CharTokenizer
from test_env_rollout import P  # a dataset example: prompt ids, text, answer

TOK = CharTokenizer()
CFG = get_config("tiny", vocab_size=TOK.vocab_size, num_layers=1)
STOP = TOK.encode("?")[0]


@functools.lru_cache(maxsize=None)
def _params():
    return F.init_params(CFG, seed=1)


@functools.lru_cache(maxsize=None)
def _engine(num_slots):
    from rljax.rollout import RljaxEngine

    return RljaxEngine(CFG, num_slots=num_slots, max_prefill_length=32, max_decode_length=24, prefill_batch_size=4)


def _sampler(num_slots):
    from rljax.rollout import Sampler

    return Sampler(_engine(num_slots), _params()[1], steps_per_sync=4, refill_batch=1)


class Ragged(Environment):
    """Whatever the model wrote, answers with an observation whose length depends on the
    session and the turn (0 to 5 tokens, some cut by max_obs_tokens) and ends the episode after
    ``1 + (session + index) % 3`` turns: sessions are ragged in turns, observation lengths and
    prompt lengths, so slots finish, park and resume at different times."""

    def step(self, turn):
        ex = self.example
        if turn.index >= (ex.session + ex.index) % 3:
            return Step(reward=1.0)
        k = (2 * ex.session + 3 * turn.index + ex.index) % 7
        return Step(observation="=<" + "abcdefg"[:k], tool="t")


PROMPTS = [P(tuple(TOK.encode(t, add_bos=True)), t, "7", i) for i, t in enumerate(["key ab=", "q=", "x y z w v="])]
T = 20
FIELDS = ("response_ids", "response_mask", "response_attention", "loss_mask", "roles", "num_turns", "obs_tokens",
          "tool_calls", "response_length", "truncated", "min_version", "max_version", "is_padding", "env_reward")


def _run(num_slots, continuation, *, n=3, max_new_tokens=5, prompts=PROMPTS):
    from rljax.rollout import DecodeParams

    sampler = _sampler(num_slots)
    decode = DecodeParams(max_new_tokens=max_new_tokens, temperature=0.0, eos_ids=(TOK.eos_id,), seed=3)
    eng = sampler.engine
    before = dict(eng.stats)
    traj = run_episodes(sampler, prompts, uids=[f"u{i}" for i in range(len(prompts))], n=n, decode=decode,
                        env_cls=Ragged, tokenizer=TOK, stop_id=STOP, max_turns=3, max_response_tokens=T,
                        max_obs_tokens=4, pad_to_multiple=4, continuation=continuation)
    counts = {k: eng.stats.get(k, 0) - before.get(k, 0) for k in ("prefill_tokens", "extended_tokens", "extend_calls")}
    return traj, counts


@functools.lru_cache(maxsize=None)
def _episodes(num_slots, continuation):
    return _run(num_slots, continuation)


@pytest.mark.slow
@pytest.mark.parametrize("num_slots", [2, 5])
def test_kv_continuation_equals_the_recompute_of_the_whole_context(num_slots):
    ref, _ = _episodes(num_slots, "reprefill")
    kv, _ = _episodes(num_slots, "kv")
    turns = np.asarray(kv.num_turns)[~kv.is_padding]
    assert len(set(turns.tolist())) == 3 and (np.asarray(kv.obs_tokens) > 0).any()  # ragged episodes
    for name in FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(kv, name)), np.asarray(getattr(ref, name)), err_msg=name)
    np.testing.assert_allclose(kv.rollout_logp, ref.rollout_logp, atol=1e-4)
    assert kv.turn_spans == ref.turn_spans and kv.final_text == ref.final_text
    assert kv.episode_stats["continuation"] == "kv" and ref.episode_stats["continuation"] == "reprefill"
    assert kv.episode_stats["tool_calls"] == ref.episode_stats["tool_calls"] > 0


@pytest.mark.slow
def test_kv_prefills_each_prompt_once_and_then_only_the_new_tokens():
    """Prefilled tokens counted: the prompts once (shared by their n sessions), then per resumed
    turn the turn's last token and the observation. The re-prefill reference prefills every
    session's whole context again on every turn."""
    kv, counts = _episodes(5, "kv")
    ref, ref_counts = _episodes(5, "reprefill")
    real = ~np.asarray(kv.is_padding)
    resumed = int((np.asarray(kv.num_turns)[real] - 1).sum())  # turns after the first
    assert counts["prefill_tokens"] == sum(len(p.ids) for p in PROMPTS)
    assert counts["extended_tokens"] == int(kv.obs_tokens[real].sum()) + resumed
    assert kv.episode_stats["extended_tokens"] == counts["extended_tokens"]
    # the reference: turn k's prompt is the whole context before it
    contexts = 0
    for i in np.nonzero(real)[0]:
        plen = len(PROMPTS[kv.group_id[i]].ids)
        contexts += sum(plen + start for start, _, role in kv.turn_spans[i] if role != 2)
    assert ref_counts["prefill_tokens"] == contexts and ref_counts["extended_tokens"] == 0
    assert counts["prefill_tokens"] + counts["extended_tokens"] < ref_counts["prefill_tokens"]


@pytest.mark.slow
def test_extend_cache_equals_a_full_prefill_of_the_concatenated_context():
    import jax

    from rljax.rollout import DecodeParams

    eng, params = _engine(5), _params()[1]
    state = eng.init_decode_state(DecodeParams(max_new_tokens=3, temperature=0.0, eos_ids=(TOK.eos_id,)))
    a, b = list(PROMPTS[0].ids), list(PROMPTS[2].ids)
    prefix = eng.prefill_batch(params, [a, b])
    state = eng.insert_many(prefix, state, rows=[0, 1], slots=[3, 1], keys=np.zeros((2, 2), np.uint32))
    pending = np.asarray(state.out_tokens)[:, 0]  # sampled, not yet in the cache
    obs = [TOK.encode("=<abc"), []]  # a ragged pair: 5 tokens and none (only the pending token)
    state, logits = eng.extend_many(params, state, slots=[3, 1], tokens=obs, keys=np.ones((2, 2), np.uint32))
    contexts = [a + [int(pending[3])] + obs[0], b + [int(pending[1])] + obs[1]]
    full = eng.prefill_batch(params, contexts)
    np.testing.assert_allclose(np.asarray(logits)[:2], np.asarray(full.logits)[:2], atol=1e-4)
    kv = state.cache.stacked()
    k, v, index = jax.device_get((kv.k, kv.v, state.index))
    for slot, row, ctx in ((3, 0, contexts[0]), (1, 1, contexts[1])):
        assert index[slot] == len(ctx)  # positions continue at the slot's length
        np.testing.assert_allclose(k[:, slot, : len(ctx)], np.asarray(full.kv.k)[:, row, : len(ctx)], atol=1e-5)
        np.testing.assert_allclose(v[:, slot, : len(ctx)], np.asarray(full.kv.v)[:, row, : len(ctx)], atol=1e-5)
    # the first resumed token is the greedy token of the full context
    np.testing.assert_array_equal(np.asarray(state.out_tokens)[[3, 1], 0], np.asarray(full.logits)[:2].argmax(-1))
    with pytest.raises(ValueError, match="holds no trajectory"):
        eng.extend_many(params, state, slots=[0], tokens=[[5]], keys=np.zeros((1, 2), np.uint32))
    with pytest.raises(ValueError, match="no room for the next token"):
        eng.extend_many(params, state, slots=[3], tokens=[[5] * 60], keys=np.zeros((1, 2), np.uint32))
    with pytest.raises(ValueError, match="distinct"):
        eng.extend_many(params, state, slots=[3, 3], tokens=[[5], [6]], keys=np.zeros((2, 2), np.uint32))


def test_kv_rejects_a_cache_too_small_for_prompt_response_and_turn():
    with pytest.raises(ValueError, match="continuation='kv' needs a cache"):
        _run(2, "kv", max_new_tokens=24, prompts=[P(tuple(range(3, 33)), "", "7")])
    with pytest.raises(ValueError, match="continuation is 'paged'"):
        _run(2, "paged")
