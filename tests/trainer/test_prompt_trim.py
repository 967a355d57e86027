"""data.trim_prompt_padding: the learner drops prompt columns that are padding in every row,
and the log-probs, loss and gradients stay those of the full-width layout."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.rollout.trajectory import RolloutStats, Trajectories
from rljax.trainer import StepConfig, make_logprob_fn, make_train_step, init_state
from rljax.trainer.stages import learner_layout, prompt_longest, prompt_width

S, T = 16, 6  # the sampler's prompt width (data.max_prompt_length) and response length
CFG = get_config("tiny")


def test_prompt_width_buckets():
    # exact up to 8, then 4 lengths per octave; never below the longest, never above the cap
    assert [prompt_width(n, 64) for n in (0, 1, 4, 5, 7, 8, 9, 11, 13, 17, 33)] == \
        [1, 1, 4, 5, 7, 8, 10, 12, 14, 20, 40]
    assert prompt_width(13, 12) == 12 and prompt_width(40, 64) == 40
    assert prompt_width(5, 64, multiple=4) == 8 and prompt_width(9, 64, multiple=4) == 12
    widths = {prompt_width(n, 1024) for n in range(1, 1025)}
    assert len(widths) <= 8 + 4 * 7  # few programs over a long run
    assert all(prompt_width(n, 1024) <= 1.25 * n for n in range(1, 1025))


def _trajectories(seed: int, b: int, longest: int) -> Trajectories:
    rng = np.random.default_rng(seed)
    plen = rng.integers(1, longest + 1, b)
    plen[0] = longest
    rlen = rng.integers(1, T + 1, b)
    prompt_mask = np.arange(S)[None, :] >= (S - plen)[:, None]
    response_mask = np.arange(T)[None, :] < rlen[:, None]
    prompt_ids = np.where(prompt_mask, rng.integers(3, CFG.vocab_size, (b, S)), 0).astype(np.int32)
    response_ids = np.where(response_mask, rng.integers(3, CFG.vocab_size, (b, T)), 0).astype(np.int32)
    zeros = np.zeros(b, np.float32)
    return Trajectories(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids, response_mask=response_mask,
        loss_mask=response_mask.copy(), rollout_logp=np.where(response_mask, -1.0, 0.0).astype(np.float32),
        prompt_length=plen.astype(np.int32), response_length=rlen.astype(np.int32), truncated=np.zeros(b, bool),
        group_id=(np.arange(b) // 2).astype(np.int32), min_version=np.zeros(b, np.int32),
        max_version=np.zeros(b, np.int32), is_padding=np.zeros(b, bool), queue_s=zeros, prefill_s=zeros,
        decode_s=zeros, uid=tuple(str(i // 2) for i in range(b)), session=tuple(range(b)), index=(0,) * b,
        decode=None, stats=RolloutStats(*([0.0] * 4), *([0] * 7)), num_groups=b // 2)


def test_trimmed_layout_is_the_full_one_without_all_padding_columns():
    tr = _trajectories(0, 8, longest=5)
    full = learner_layout(tr, prompt_len=S, response_len=T + 2)
    trim = learner_layout(tr, prompt_len=S, response_len=T + 2, trim=True)
    assert full["input_ids"].shape == (8, S + T + 2) and trim["input_ids"].shape == (8, 5 + T + 2)
    assert not full["attention_mask"][:, :S - 5].any()  # what was dropped is padding in every row
    for k in ("input_ids", "attention_mask", "positions"):
        np.testing.assert_array_equal(trim[k], full[k][:, S - 5:])
    for k in ("loss_mask", "rollout_logp", "group_id", "row_mask"):
        np.testing.assert_array_equal(trim[k], full[k])
    # a multiple of sp, and a learner width wider than the sampler's (pads on the left as before)
    assert learner_layout(tr, prompt_len=S, response_len=T, trim=True, multiple=4)["input_ids"].shape == (8, 8 + T)
    assert learner_layout(tr, prompt_len=S + 4, response_len=T)["input_ids"].shape == (8, S + 4 + T)


def _rows(tr: Trajectories, lo: int, hi: int) -> Trajectories:
    return tr.replace(**{k: getattr(tr, k)[lo:hi] for k in ("prompt_ids", "prompt_mask", "response_ids",
                                                             "response_mask", "loss_mask", "rollout_logp",
                                                             "group_id", "is_padding")})


def test_processes_agree_on_the_width_of_the_whole_batch():
    """Several processes (stages.trajectory_fields): each lays out its own rows with the longest
    prompt of all of them (an all-gathered int), so its rows are those of the one-process layout."""
    tr = _trajectories(1, 8, longest=11)
    tr = tr.replace(prompt_mask=np.concatenate([tr.prompt_mask[:4], tr.prompt_mask[4:] & (np.arange(S) >= S - 3)]))
    halves = [_rows(tr, 0, 4), _rows(tr, 4, 8)]
    assert [prompt_longest(h) for h in halves] == [11, 3] and prompt_longest(tr) == 11
    whole = learner_layout(tr, prompt_len=S, response_len=T, trim=True)
    longest = max(prompt_longest(h) for h in halves)
    parts = [learner_layout(h, prompt_len=S, response_len=T, trim=True, longest=longest) for h in halves]
    assert whole["input_ids"].shape == (8, 12 + T)
    for k in whole:
        np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), whole[k], err_msg=k)
    # on its own the second half would take 3 columns: a different program from the first half's
    assert learner_layout(halves[1], prompt_len=S, response_len=T, trim=True)["input_ids"].shape == (4, 3 + T)
    with pytest.raises(ValueError, match="longest=2 prompt columns"):
        learner_layout(halves[0], prompt_len=S, response_len=T, trim=True, longest=2)


@pytest.fixture(scope="module")
def model():
    return F.init_params(CFG, seed=0)


def _layouts(tr):
    out = {}
    for trim in (False, True):
        host = learner_layout(tr, prompt_len=S, response_len=T, trim=trim)
        out[trim] = host, {k: jnp.asarray(host[k]) for k in ("input_ids", "attention_mask", "positions")}
    assert out[False][0]["input_ids"].shape[1] == S + T and out[True][0]["input_ids"].shape[1] == 5 + T
    return out


def test_trimmed_batch_gives_the_same_logprobs(model):
    graphdef, params = model
    logprob = make_logprob_fn(graphdef, response_len=T, temperature=1.0, impl="chunked")
    out = {trim: logprob(params, inputs) for trim, (_, inputs) in _layouts(_trajectories(1, 8, longest=5)).items()}
    for a, b in zip(out[True], out[False]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_trimmed_batch_gives_the_same_loss_and_update(model):
    graphdef, params = model
    rng = np.random.default_rng(1)
    adv = np.repeat(rng.normal(0, 1, (8, 1)), T, 1).astype(np.float32)
    old_logp = (-2.0 + 0.1 * rng.normal(0, 1, (8, T))).astype(np.float32)
    cfg = StepConfig(ppo_mini_batch_size=8, ppo_micro_batch_size=8, logprob_impl="chunked")
    step = make_train_step(graphdef, optax.sgd(1.0), cfg)
    out = {}
    for trim, (host, inputs) in _layouts(_trajectories(1, 8, longest=5)).items():
        batch = dict(inputs, loss_mask=jnp.asarray(host["loss_mask"]), advantages=jnp.asarray(adv),
                     old_logp=jnp.asarray(old_logp))
        state, metrics = step(init_state(jax.tree.map(jnp.copy, params), optax.sgd(1.0)), batch, jax.random.key(0))
        out[trim] = (metrics["loss"], metrics["grad_norm"], metrics["pg_clipfrac"], state.params)
    assert float(out[False][1]) > 0
    for a, b in zip(jax.tree.leaves(out[True]), jax.tree.leaves(out[False])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-6)
