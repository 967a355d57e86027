"""The rollout driver itself (rljax.rollout.driver): the events it raises and their order, a
parked session resuming with its own cache, a weight install between decode chunks, the
admission seam, and bad client calls. Sampler.generate and multi-turn episodes, its two
clients, are tested in test_sampler.py and test_env_kv.py."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.rollout import DecodeParams, RljaxEngine, trajectory_keys
from rljax.rollout.driver import Driver, Request, results_for

CFG = get_config("tiny")
PROMPTS = [[17, 4, 99], [3, 8, 120, 45, 61, 7, 7], list(range(30, 42))]


@functools.lru_cache(maxsize=None)
def params(seed=0):
    return F.init_params(CFG, seed=seed)[1]


@functools.lru_cache(maxsize=None)
def engine(slots=2):
    return RljaxEngine(CFG, num_slots=slots, max_prefill_length=32, max_decode_length=24)


class Weights:
    """A weight source the test swaps by hand (the Sampler is the real one)."""

    def __init__(self, p, version):
        self.p, self.v = p, version

    def snapshot(self):
        return self.p, self.v


@functools.lru_cache(maxsize=None)
def _forward_fn():
    graphdef = F.abstract_params(CFG)[0]
    return jax.jit(lambda p, tokens: F.compute_logits(p, F.forward(graphdef, p, tokens)))


def greedy(p, context, steps, width=64):
    """Greedy continuation without a cache: a full forward over the whole context every token. The
    context is right-padded to one ``width`` (causal attention: padding after the last token
    changes none of its logits), so every call runs one compiled program."""
    out = list(context)
    for _ in range(steps):
        assert len(out) <= width
        tokens = jnp.asarray([out + [0] * (width - len(out))], jnp.int32)
        out.append(int(np.asarray(_forward_fn()(p, tokens))[0, len(out) - 1].argmax()))
    return out[len(context):]


def keys(uid, n):
    return trajectory_keys(0, [uid] * n, list(range(n)))


def run(driver):
    """Rounds until the driver is idle; every event, each as (round, kind, session index or version)."""
    seen, rnd = [], 0
    while driver.busy:
        for ev in driver.step():
            seen.append((rnd, ev))
        rnd += 1
    return seen


def test_events_in_order_and_a_parked_session_resumes_with_its_cache():
    eng = engine(2)
    decode = DecodeParams(temperature=0.0, max_new_tokens=4, eos_ids=())
    driver = Driver(eng, Weights(params(), 1), decode, steps_per_sync=8)
    multi = driver.submit(Request(np.asarray(PROMPTS[0]), keys=keys("m", 2), park=True))
    res = results_for(eng, 1, 4)
    single = driver.submit(Request(np.asarray(PROMPTS[1]), keys=keys("s", 1), results=res))

    events = driver.step()  # both slots take the multi-turn sessions; their first turn ends (4 tokens)
    assert [(e.kind, e.session) for e in events] == [("turn_ended", multi[0]), ("turn_ended", multi[1])]
    turn1 = [list(e.tokens) for e in events]
    assert turn1[0] == turn1[1] == greedy(params(), PROMPTS[0], 4)
    assert [s.status for s in multi] == ["parked", "parked"] and single[0].status == "queued"

    # parked sessions keep their slots: the single-turn request waits, nothing decodes
    assert driver.step() == [] and driver.waiting == 1 and driver.decoding == 0 and driver.occupied == 2

    obs = [9, 10, 11]
    driver.resume(multi[0], obs, keys("m-turn1", 1)[0])
    driver.end(multi[1])  # its slot frees now: the single-turn session takes it this round
    events = driver.step()
    assert [(e.kind, e.session) for e in events] == [
        ("finished", multi[1]), ("turn_ended", multi[0]), ("finished", single[0])]
    # the resumed turn continues the cached context: prompt, turn 1, observation
    assert list(events[1].tokens) == greedy(params(), PROMPTS[0] + turn1[0] + obs, 4)
    assert multi[0].turns == 2 and multi[0].slot >= 0
    tokens, _ = res.fetch()
    assert list(tokens[0]) == greedy(params(), PROMPTS[1], 4)

    driver.end(multi[0])
    assert [(e.kind, e.session) for e in driver.step()] == [("finished", multi[0])]
    assert not driver.busy and driver.occupied == 0


def test_a_weight_install_between_chunks_changes_the_version_of_later_tokens_only():
    eng = engine(2)
    v1, v2 = params(0), params(1)
    weights = Weights(v1, 1)
    decode = DecodeParams(temperature=0.0, max_new_tokens=12, eos_ids=())
    driver = Driver(eng, weights, decode, steps_per_sync=4, compact=False)
    res = results_for(eng, 2, 12)
    first = driver.submit(Request(np.asarray(PROMPTS[2]), keys=keys("a", 1), results=res, rows=[0]))
    assert driver.step() == []  # inserted (token 0) and 4 decode steps under v1: 5 tokens
    weights.p, weights.v = v2, 2
    later = driver.submit(Request(np.asarray(PROMPTS[0]), keys=keys("b", 1), results=res, rows=[1]))
    seen = [(e.kind, e.version if e.kind == "weights_changed" else e.session) for _, e in run(driver)]
    assert seen[0] == ("weights_changed", 2) and sorted(map(str, seen[1:])) == sorted(
        map(str, [("finished", first[0]), ("finished", later[0])]))
    tokens, logp = res.fetch()
    head = greedy(v1, PROMPTS[2], 5)
    assert list(tokens[0, :5]) == head  # sampled before the install: v1's, untouched
    # after it: not v1's (v2's weights over the cache v1 wrote: partial rollout keeps the cache)
    assert list(tokens[0, 5:]) != greedy(v1, PROMPTS[2] + head, 7)
    assert (first[0].min_version, first[0].max_version) == (1, 2)
    assert (later[0].min_version, later[0].max_version) == (2, 2)
    assert list(tokens[1]) == greedy(v2, PROMPTS[0], 12)
    assert np.all(logp[:, :12] <= 0)


def test_admit_holds_the_head_of_the_queue_until_it_says_yes():
    """The seam streaming admission plugs into: a request is prefilled only once admit(request) is True."""
    eng = engine(2)
    gate = {"open": False}
    decode = DecodeParams(temperature=0.0, max_new_tokens=3, eos_ids=())
    driver = Driver(eng, Weights(params(), 0), decode, admit=lambda req: req.tag != "later" or gate["open"])
    res = results_for(eng, 3, 3)
    a = driver.submit(Request(np.asarray(PROMPTS[0]), keys=keys("a", 1), results=res, rows=[0], tag="now"))
    b = driver.submit(Request(np.asarray(PROMPTS[1]), keys=keys("b", 2), results=res, rows=[1, 2], tag="later"))
    assert [e.session for e in driver.step()] == [a[0]]
    assert driver.step() == [] and driver.waiting == 2 and b[0].status == "queued"  # free slots, not admitted
    gate["open"] = True
    assert sorted((e.session for _, e in run(driver)), key=lambda s: s.index) == b
    tokens, _ = res.fetch()
    assert list(tokens[1]) == list(tokens[2]) == greedy(params(), PROMPTS[1], 3)


def test_bad_client_calls_are_one_line_errors():
    eng = engine(2)
    driver = Driver(eng, Weights(params(), 0), DecodeParams(temperature=0.0, max_new_tokens=2, eos_ids=()))
    with pytest.raises(ValueError, match="needs results"):
        Request(np.asarray(PROMPTS[0]), keys=keys("a", 1))
    with pytest.raises(ValueError, match="rows has 1 entries for 2 sessions"):
        Request(np.asarray(PROMPTS[0]), keys=keys("a", 2), park=True, rows=[0])
    s = driver.submit(Request(np.asarray(PROMPTS[0]), keys=keys("a", 1), park=True))
    with pytest.raises(ValueError, match="only a parked session"):
        driver.resume(s[0], [1], keys("a", 1)[0])
    with pytest.raises(ValueError, match="only a parked session"):
        driver.end(s[0])
