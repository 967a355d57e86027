"""The RL sampler on the tiny model: exactness against recomputation, log-probs, reproducibility,
versions, group prefill, continuous batching, the data contract and bad input."""

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.rollout import DecodeParams, RljaxEngine, Sampler, sampler_mesh, truncate_logits
from rljax.rollout.engine import compact_size, compact_sizes

CFG = get_config("tiny")
MAX_PREFILL, MAX_DECODE = 32, 24
# Ragged prompts (lengths 1..20) over the tiny vocabulary.
PROMPTS = [
    [5],
    [17, 4, 99],
    [3, 8, 120, 45, 61, 7, 7],
    list(range(30, 42)),
    [int(x) for x in np.random.default_rng(0).integers(0, CFG.vocab_size, 20)],
]
UIDS = [f"p{i}" for i in range(len(PROMPTS))]


@functools.lru_cache(maxsize=None)
def _params(seed):
    return F.init_params(CFG, seed=seed)[1]


def params(seed=0):
    return _params(seed)


@functools.lru_cache(maxsize=None)
def engine(slots, mesh_tp=None):
    mesh = None if mesh_tp is None else sampler_mesh(mesh_tp)
    return RljaxEngine(CFG, num_slots=slots, max_prefill_length=MAX_PREFILL, max_decode_length=MAX_DECODE, mesh=mesh)


@functools.lru_cache(maxsize=None)
def _forward_fn():
    graphdef = F.abstract_params(CFG)[0]

    @jax.jit
    def fn(p, tokens, mask):
        return F.compute_logits(p, F.forward(graphdef, p, tokens, mask=mask))

    return fn


def greedy_recompute(p, prompts, steps, eos=()):
    """Greedy decoding without a cache: a full forward over the whole sequence every step."""
    width = max(map(len, prompts)) + steps
    tokens = np.zeros((len(prompts), width), np.int32)
    lengths = np.array([len(q) for q in prompts])
    for i, q in enumerate(prompts):
        tokens[i, : len(q)] = q
    out = [[] for _ in prompts]
    alive = np.ones(len(prompts), bool)
    for _ in range(steps):
        mask = np.arange(width)[None, :] < lengths[:, None]
        logits = np.asarray(_forward_fn()(p, jnp.asarray(tokens), jnp.asarray(mask)))
        nxt = logits[np.arange(len(prompts)), lengths - 1].argmax(-1)
        for i in np.nonzero(alive)[0]:
            out[i].append(int(nxt[i]))
            tokens[i, lengths[i]] = nxt[i]
            if nxt[i] in eos:
                alive[i] = False
        lengths = lengths + alive
        if not alive.any():
            break
    return out


def responses(traj):
    return [traj.response_ids[b, : traj.response_length[b]].tolist() for b in range(traj.batch_size)]


@functools.lru_cache(maxsize=None)
def reference(steps=MAX_DECODE, seed=0):
    return tuple(map(tuple, greedy_recompute(params(seed), PROMPTS, steps)))


# --------------------------------------------------------------------------- exactness


# 2 slots for 5 prompts (slots refilled) in the default run; one slot per prompt and more slots
# than prompts with the slow tests: the default run still decodes with 5 and 16 slots against the
# learner's forward (test_rollout_logp_equals_learner_logp, 5 slots) and against 2 slots
# (test_same_seed_uid_session_same_tokens_with_2_and_16_slots).
@pytest.mark.parametrize("slots", [2, pytest.param(5, marks=pytest.mark.slow), pytest.param(16, marks=pytest.mark.slow)])
def test_greedy_kv_cache_equals_full_recompute(slots):
    ref = reference()
    assert len({r[:6] for r in ref}) == len(ref)  # the prompts lead to different continuations
    sampler = Sampler(engine(slots), params(), steps_per_sync=5)
    traj = sampler.generate(PROMPTS, uids=UIDS, decode=DecodeParams(temperature=0.0, max_new_tokens=MAX_DECODE, eos_ids=()))
    assert responses(traj) == [list(r) for r in ref]
    assert traj.response_length.tolist() == [MAX_DECODE] * len(PROMPTS)
    assert traj.truncated.all()


def test_greedy_with_eos_stops_rows_at_different_lengths():
    ref = reference()
    eos = (ref[0][4], ref[2][9])  # two ids that end rows part-way
    expected = []
    for r in ref:
        cut = next((i + 1 for i, t in enumerate(r) if t in eos), len(r))
        expected.append(list(r[:cut]))
    assert len({len(e) for e in expected}) > 1
    traj = Sampler(engine(2), params()).generate(
        PROMPTS, uids=UIDS, decode=DecodeParams(temperature=0.0, max_new_tokens=MAX_DECODE, eos_ids=eos)
    )
    assert responses(traj) == expected
    assert traj.truncated.tolist() == [len(e) == MAX_DECODE and e[-1] not in eos for e in expected]
    np.testing.assert_array_equal(traj.response_mask.sum(1), [len(e) for e in expected])


def test_rollout_logp_equals_learner_logp():
    temperature = 0.7
    decode = DecodeParams(temperature=temperature, top_k=20, top_p=0.9, max_new_tokens=16, seed=3)
    traj = Sampler(engine(5), params(), steps_per_sync=4).generate(PROMPTS, uids=UIDS, n=2, decode=decode)
    ids, mask = traj.sequences()
    logits = np.asarray(_forward_fn()(params(), jnp.asarray(ids), jnp.asarray(mask)), np.float64)
    s = traj.prompt_ids.shape[1]
    # logits at position s-1+t predict response token t.
    pred = logits[:, s - 1 : s - 1 + traj.response_ids.shape[1]]
    tempered = jax.nn.log_softmax(jnp.asarray(pred / temperature, jnp.float32), -1)
    learner = np.take_along_axis(np.asarray(tempered), traj.response_ids[..., None], -1)[..., 0]
    m = traj.response_mask
    assert m.sum() > 50
    np.testing.assert_allclose(traj.rollout_logp[m], learner[m], atol=1e-4, rtol=0)
    assert (traj.rollout_logp[~m] == 0).all()
    # the sampled tokens lie inside the top-k / top-p set of the learner's distribution
    trunc = np.asarray(truncate_logits(jnp.asarray(pred / temperature, jnp.float32), 20, 0.9))
    chosen = np.take_along_axis(trunc, traj.response_ids[..., None], -1)[..., 0]
    assert np.isfinite(chosen[m]).all()


def test_truncated_logprob_mode_records_renormalised_distribution():
    temperature, top_k = 1.3, 5
    decode = DecodeParams(temperature=temperature, top_k=top_k, max_new_tokens=8, logprobs="truncated", seed=1)
    traj = Sampler(engine(5), params()).generate(PROMPTS[:3], uids=UIDS[:3], decode=decode)
    ids, mask = traj.sequences()
    logits = np.asarray(_forward_fn()(params(), jnp.asarray(ids), jnp.asarray(mask)))
    s = traj.prompt_ids.shape[1]
    pred = jnp.asarray(logits[:, s - 1 : s - 1 + 8] / temperature)
    lp = np.asarray(jax.nn.log_softmax(truncate_logits(pred, top_k, 1.0), -1))
    learner = np.take_along_axis(lp, traj.response_ids[..., None], -1)[..., 0]
    m = traj.response_mask
    np.testing.assert_allclose(traj.rollout_logp[m], learner[m], atol=1e-4)


# --------------------------------------------------------------------------- reproducibility


def test_same_seed_uid_session_same_tokens_with_2_and_16_slots():
    decode = DecodeParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=11)
    a = Sampler(engine(2), params(), steps_per_sync=3).generate(PROMPTS[:4], uids=UIDS[:4], n=3, decode=decode)
    b = Sampler(engine(16), params(), steps_per_sync=7).generate(PROMPTS[:4], uids=UIDS[:4], n=3, decode=decode)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_array_equal(a.response_length, b.response_length)
    np.testing.assert_allclose(a.rollout_logp, b.rollout_logp, atol=1e-5)
    # The order of the prompts in the call does not matter either (keys come from the uid).
    c = Sampler(engine(16), params()).generate(PROMPTS[:4][::-1], uids=UIDS[:4][::-1], n=3, decode=decode)
    np.testing.assert_array_equal(c.response_ids.reshape(4, 3, -1)[::-1].reshape(12, -1), a.response_ids)
    # ... while the sessions of one group, and another seed, give other samples.
    assert len({tuple(r) for r in a.response_ids[:3]}) == 3
    d = Sampler(engine(16), params()).generate(PROMPTS[:4], uids=UIDS[:4], n=3, decode=decode.replace(seed=12))
    assert not np.array_equal(a.response_ids, d.response_ids)


# --------------------------------------------------------------------------- versions


def _scaled(p, factor):
    return jax.tree.map(lambda x: x * factor, p)


def test_versions_between_calls_and_non_increasing_versions_raise():
    sampler = Sampler(engine(5), params(), version=3)
    greedy = DecodeParams(temperature=0.0, max_new_tokens=8, eos_ids=())
    t0 = sampler.generate(PROMPTS, uids=UIDS, decode=greedy)
    assert (t0.min_version == 3).all() and (t0.max_version == 3).all()
    new = params(1)
    took = sampler.update_weights(new, 4)
    assert took > 0 and sampler.last_weight_sync_s == took and sampler.version == 4
    t1 = sampler.generate(PROMPTS, uids=UIDS, decode=greedy)
    assert (t1.min_version == 4).all() and (t1.max_version == 4).all()
    assert responses(t1) == [list(r) for r in greedy_recompute(new, PROMPTS, 8)]
    for bad in (4, 2, 4.5, "5"):
        with pytest.raises(ValueError, match="version"):
            sampler.update_weights(params(), bad)
    assert sampler.version == 4
    with pytest.raises(ValueError, match="shape"):
        sampler.update_weights({**new, "embed": new["embed"][:, :8]}, 5)
    assert sampler.version == 4


def test_released_weights_raise_until_new_ones_are_installed():
    """release_weights (the synchronous trainer, once generation ends): the sampler drops its copy,
    keeps its version, refuses to generate, and generates with the next update_weights' weights."""
    sampler = Sampler(engine(5), params(), version=3)
    greedy = DecodeParams(temperature=0.0, max_new_tokens=8, eos_ids=())
    sampler.release_weights()
    assert sampler.params is None and sampler.version == 3
    with pytest.raises(RuntimeError, match=r"weights \(version 3\) were released"):
        sampler.generate(PROMPTS, uids=UIDS, decode=greedy)
    sampler.update_weights(params(1), 4)
    t = sampler.generate(PROMPTS, uids=UIDS, decode=greedy)
    assert (t.min_version == 4).all() and responses(t) == [list(r) for r in greedy_recompute(params(1), PROMPTS, 8)]


def test_sampler_owns_its_weights():
    """The learner may donate / delete its arrays after a sync, even when the layouts coincide."""
    mine = jax.tree.map(jnp.copy, params())
    sampler = Sampler(engine(5), mine)
    greedy = DecodeParams(temperature=0.0, max_new_tokens=4, eos_ids=())
    for x in jax.tree.leaves(mine):
        x.delete()
    traj = sampler.generate(PROMPTS, uids=UIDS, decode=greedy)
    assert responses(traj) == [list(r[:4]) for r in reference()]


def test_update_in_the_middle_of_generation_records_min_and_max_version():
    steps = MAX_DECODE
    greedy = DecodeParams(temperature=0.0, max_new_tokens=steps, eos_ids=())
    v1, v2 = params(0), params(1)
    sampler = Sampler(engine(2), v1, version=1, steps_per_sync=4)
    seen = []

    def on_chunk(info):
        seen.append(info)
        if info.chunk == 1:
            sampler.update_weights(v2, 2)

    traj = sampler.generate(PROMPTS[:4], uids=UIDS[:4], decode=greedy, on_chunk=on_chunk)
    # Two slots: prompts 0, 1 run first and see the update after 2 chunks; 2, 3 start on v2.
    assert traj.min_version.tolist() == [1, 1, 2, 2]
    assert traj.max_version.tolist() == [1 + 1, 2, 2, 2]
    assert traj.stats.version_start == 1 and traj.stats.version_end == 2 and traj.stats.weight_sync_s > 0
    assert seen[0].waiting == 2 and seen[0].active == 2 and seen[-1].finished == 4
    out, ref1, ref2 = responses(traj), greedy_recompute(v1, PROMPTS[:4], steps), greedy_recompute(v2, PROMPTS[:4], steps)
    # 1 token from the prefill + 2 chunks of 4 steps under v1, the rest under v2.
    for b in (0, 1):
        assert out[b][:9] == ref1[b][:9] and out[b] != ref1[b]
    assert out[2:] == ref2[2:]


def test_update_from_another_thread_applies_from_the_next_chunk():
    v1, v2 = params(0), params(1)
    sampler = Sampler(engine(2), v1, version=1, steps_per_sync=4)
    go, synced = threading.Event(), threading.Event()

    def learner():  # an async trainer publishing weights while the sampler decodes
        go.wait(timeout=60)
        sampler.update_weights(v2, 2)
        synced.set()

    thread = threading.Thread(target=learner)
    thread.start()

    def on_chunk(info):
        if info.chunk == 0:
            go.set()
            synced.wait(timeout=60)

    greedy = DecodeParams(temperature=0.0, max_new_tokens=12, eos_ids=())
    traj = sampler.generate(PROMPTS[:2], uids=UIDS[:2], decode=greedy, on_chunk=on_chunk)
    thread.join()
    assert traj.min_version.tolist() == [1, 1] and traj.max_version.tolist() == [2, 2]
    ref1 = greedy_recompute(v1, PROMPTS[:2], 12)
    assert [r[:5] for r in responses(traj)] == [r[:5] for r in ref1]  # prefill token + 1 chunk on v1


def test_weights_from_learner_layout_reshard_to_tp_sampler():
    """Learner params on dp8 are resharded onto a dp4,tp2 sampler mesh; results match one device."""
    from rljax.sharding import make_mesh

    learner = jax.device_put(params(), F.param_shardings(CFG, make_mesh("dp8")))
    eng = engine(8, mesh_tp=2)
    sampler = Sampler(eng, learner)
    leaf = sampler.params["layers"]["attn"]["q_proj"]
    assert leaf.sharding.mesh.shape["tp"] == 2 and "tp" in str(leaf.sharding.spec)
    greedy = DecodeParams(temperature=0.0, max_new_tokens=10, eos_ids=())
    traj = sampler.generate(PROMPTS, uids=UIDS, decode=greedy)
    assert responses(traj) == [list(r[:10]) for r in reference()]
    # The memory ledger lowers the decode chunk with eng.abstract_decode_state: the engine's own
    # layouts, so it finds the program generate compiled instead of compiling a second one.
    layouts = lambda tree: [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(tree)]
    assert layouts(eng.abstract_decode_state(greedy)) == layouts(eng.init_decode_state(greedy))
    compiles = []
    listener = lambda event, secs, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        lowered = eng.lower_chunk(sampler.params, greedy)
        assert lowered.compile().memory_analysis() is not None
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == [], "lowering with the abstract decode state compiled a second decode program"


# --------------------------------------------------------------------------- groups and batching


def test_group_prefix_is_prefilled_once_for_n_samples():
    for slots in (16, 2):
        eng = engine(slots)
        before = dict(eng.stats)
        traj = Sampler(eng, params()).generate(PROMPTS[:3], uids=UIDS[:3], n=4, decode=DecodeParams(max_new_tokens=6))
        assert eng.stats["prefill_rows"] - before.get("prefill_rows", 0) == 3
        assert eng.stats["inserted_slots"] - before.get("inserted_slots", 0) == 12
        assert traj.stats.prefill_rows == 3
        assert traj.session == (0, 1, 2, 3) * 3 and traj.group_id.tolist() == [g for g in range(3) for _ in range(4)]


def test_finished_slots_are_refilled_while_others_decode():
    # Frequent EOS ids make lengths ragged; with 2 slots, static batching would wait for
    # the longer row of each pair.
    eos = tuple(range(0, CFG.vocab_size, 17))  # 8 ids
    decode = DecodeParams(temperature=1.0, max_new_tokens=MAX_DECODE, eos_ids=eos, seed=5)
    infos = []
    prompts = PROMPTS * 2
    uids = [f"q{i}" for i in range(len(prompts))]
    traj = Sampler(engine(2), params(), steps_per_sync=8, refill_batch=1).generate(
        prompts, uids=uids, decode=decode, on_chunk=infos.append
    )
    lengths = traj.response_length
    assert lengths.min() < lengths.max()
    static = sum(max(lengths[i : i + 2]) for i in range(0, len(lengths), 2))
    steps = sum(i.steps for i in infos)
    assert steps < static
    # some chunk ended with both a waiting request and a slot still decoding
    assert any(i.waiting > 0 and i.active > 0 for i in infos)


def test_compacting_finished_rows_away_keeps_every_token(temperature=0.0):
    """Once nothing waits and the live rows fit a smaller decode state, they move into it
    (16 -> 8 -> 4 -> 2 slots here): same tokens and log-probs as without (greedy; sampling: below)."""
    eos = tuple(range(0, CFG.vocab_size, 13))  # frequent EOS: ragged lengths, most rows end early
    decode = DecodeParams(temperature=temperature, max_new_tokens=MAX_DECODE, eos_ids=eos, seed=3)
    prompts, uids = PROMPTS[:4], UIDS[:4]
    eng = engine(16)
    before = eng.stats["compactions"]
    on = Sampler(eng, params(), steps_per_sync=4, compact_min_slots=2).generate(prompts, uids=uids, n=4, decode=decode)
    compactions = eng.stats["compactions"] - before
    off = Sampler(eng, params(), steps_per_sync=4, compact=False).generate(prompts, uids=uids, n=4, decode=decode)
    assert eng.stats["compactions"] - before == compactions >= 1
    # no row can decode a whole chunk more after the first: compacting would not pay, none happens
    whole = Sampler(eng, params(), steps_per_sync=MAX_DECODE, compact_min_slots=2).generate(
        prompts, uids=uids, n=4, decode=decode)
    assert eng.stats["compactions"] - before == compactions
    np.testing.assert_array_equal(whole.response_ids, off.response_ids)
    assert off.response_length.min() < off.response_length.max()
    np.testing.assert_array_equal(on.response_length, off.response_length)
    np.testing.assert_array_equal(on.response_ids, off.response_ids)
    np.testing.assert_allclose(on.rollout_logp, off.rollout_logp, atol=1e-6)


def test_compaction_ladder_sizes():
    assert [compact_size(n, 4) for n in (1, 3, 5, 8, 9, 17, 25, 33, 57, 65, 81, 97, 129)] == [
        1, 4, 8, 8, 16, 24, 32, 40, 64, 80, 96, 112, 160]
    assert compact_sizes(64, 8, 4) == (8, 16, 24, 32, 40, 48, 56, 64)
    assert compact_sizes(64, 8, 2) == (8, 16, 24, 32, 48, 64)
    assert compact_sizes(64, 8, 1) == (8, 16, 32, 64)
    assert compact_sizes(100, 8, 4)[-3:] == (80, 96, 100)  # capped at the engine's slots
    with pytest.raises(ValueError, match="per_octave is 3"):
        compact_size(5, 3)
    with pytest.raises(ValueError, match="compact_per_octave is 3"):
        Sampler(engine(5), params(), compact_per_octave=3)


@pytest.mark.slow  # compiles three more chunk sizes of a 32-slot engine (the default run keeps the greedy case above)
def test_compaction_into_sizes_finer_than_powers_of_two_keeps_every_token():
    """32 slots, four sizes an octave, at least 16: the live rows move 32 -> 24 -> 16 (a
    power-of-two ladder waits for 16); same tokens and log-probs as without compaction (sampling)."""
    eos = tuple(range(0, CFG.vocab_size, 13))
    decode = DecodeParams(temperature=1.0, max_new_tokens=MAX_DECODE, eos_ids=eos, seed=4)
    prompts, uids = PROMPTS[:4], UIDS[:4]
    eng = engine(32)
    infos = []
    on = Sampler(eng, params(), steps_per_sync=4, compact_min_slots=16).generate(
        prompts, uids=uids, n=8, decode=decode, on_chunk=infos.append)
    off = Sampler(eng, params(), steps_per_sync=4, compact=False).generate(prompts, uids=uids, n=8, decode=decode)
    sizes = [i.slots for i in infos]
    assert sizes == sorted(sizes, reverse=True) and {24, 16} <= set(sizes) <= {16, 24, 32}, sizes
    # a chunk ends once the live rows fit the next smaller size: each state is the smallest that holds them
    for before, after in zip(infos, infos[1:]):
        if after.slots < before.slots:
            assert after.slots == min(c for c in (16, 24, 32) if c >= before.active)
    np.testing.assert_array_equal(on.response_length, off.response_length)
    np.testing.assert_array_equal(on.response_ids, off.response_ids)
    np.testing.assert_allclose(on.rollout_logp, off.rollout_logp, atol=1e-6)


def test_engine_compact_moves_slots_and_checks_them():
    eng = engine(5)
    state = eng.init_decode_state(DecodeParams(max_new_tokens=4, temperature=0.0))
    prefix = eng.prefill_batch(params(), PROMPTS[:3])
    state = eng.insert_many(prefix, state, rows=[0, 1, 2], slots=[4, 1, 2], keys=np.arange(6).reshape(3, 2))
    small = eng.compact(state, [2, 4, 1])  # 3 slots -> a state of 4
    assert small.tokens.shape == (4,) and small.cache.k[0].shape[0] == 4
    np.testing.assert_array_equal(np.asarray(small.keys)[:3], np.asarray(state.keys)[[2, 4, 1]])
    np.testing.assert_array_equal(np.asarray(small.active), [True, True, True, False])
    np.testing.assert_array_equal(np.asarray(small.cache.v[1])[:3], np.asarray(state.cache.v[1])[[2, 4, 1]])
    assert eng.compact(state, [2], min_slots=4).tokens.shape == (4,)
    for bad in ([], [1, 1], [5], [-1]):
        with pytest.raises(ValueError, match="compact: slots must be"):
            eng.compact(state, bad)


# --------------------------------------------------------------------------- data contract


def test_trajectories_follow_the_data_contract():
    decode = DecodeParams(temperature=1.0, max_new_tokens=10, eos_ids=(7, 9), seed=2)
    traj = Sampler(engine(5), params()).generate(PROMPTS, uids=UIDS, n=2, decode=decode, pad_to_multiple=4)
    b, real = traj.batch_size, len(PROMPTS) * 2
    assert b == 12 and traj.is_padding.tolist() == [False] * real + [True] * 2
    shapes = {
        "prompt_ids": ((b, MAX_PREFILL), np.int32), "prompt_mask": ((b, MAX_PREFILL), np.bool_),
        "response_ids": ((b, 10), np.int32), "response_mask": ((b, 10), np.bool_), "loss_mask": ((b, 10), np.bool_),
        "rollout_logp": ((b, 10), np.float32), "response_length": ((b,), np.int32), "min_version": ((b,), np.int32),
        "max_version": ((b,), np.int32), "is_padding": ((b,), np.bool_), "group_id": ((b,), np.int32),
    }
    for name, (shape, dtype) in shapes.items():
        x = getattr(traj, name)
        assert x.shape == shape and x.dtype == dtype, name
    length = traj.response_length
    np.testing.assert_array_equal(traj.response_mask, np.arange(10)[None] < length[:, None])
    np.testing.assert_array_equal(traj.loss_mask, traj.response_mask & ~traj.is_padding[:, None])
    assert not traj.response_mask[real:].any() and not traj.prompt_mask[real:].any()
    assert (traj.rollout_logp[traj.response_mask] < 0).all() and (traj.rollout_logp[~traj.response_mask] == 0).all()
    for i in range(real):
        p = PROMPTS[i // 2]
        assert traj.prompt_ids[i, -len(p):].tolist() == p and traj.prompt_mask[i].sum() == len(p)  # left-padded
        resp = traj.response_ids[i, : length[i]].tolist()
        assert (resp[-1] in (7, 9)) != traj.truncated[i] and not set(resp[:-1]) & {7, 9}
    assert traj.trajectory_keys[:3] == ("p0_0_0", "p0_1_0", "p1_0_0") and traj.trajectory_keys[-1] == "_-1_-1"
    assert traj.decode == decode and traj.num_groups == len(PROMPTS)
    st = traj.stats
    assert st.generated_tokens == length.sum() and st.prefill_rows == len(PROMPTS) and st.tokens_per_s > 0
    assert st.wall_s >= st.prefill_s + st.decode_s > 0
    assert (traj.queue_s[:real] >= 0).all() and (traj.decode_s[:real] > 0).all() and (traj.prefill_s[:real] > 0).all()
    leaves = jax.tree.leaves(traj)
    assert len(leaves) == len(traj.arrays()) and all(isinstance(x, np.ndarray) for x in leaves)


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([], {}, "prompts is empty"),
        ([[1, 2], []], {}, "prompt 1 .* is empty"),
        ([[1] * (MAX_PREFILL + 1)], {}, "more than the engine's max_prefill_length"),
        ([[1, CFG.vocab_size]], {}, "outside the vocabulary"),
        ([[-1, 3]], {}, "outside the vocabulary"),
        ([[1.5, 2.0]], {}, "integer token ids"),
        ([[1, 2]], {"n": 0}, "n is 0"),
        ([[1, 2]], {"n": 2.0}, "n is 2.0"),
        ([[1, 2], [3]], {"uids": ["a", "a"]}, "appears more than once"),
        ([[1, 2], [3]], {"uids": ["a"]}, "one uid per prompt"),
        ([[1, 2]], {"decode": DecodeParams(max_new_tokens=MAX_DECODE + 1)}, "max_decode_length"),
        ([[1, 2]], {"decode": DecodeParams(max_new_tokens=4, eos_ids=(CFG.vocab_size,))}, "eos_ids"),
        ([[1, 2]], {"decode": {"temperature": 1.0}}, "DecodeParams"),
        ("abc", {}, "sequence of token-id sequences"),
    ],
)
def test_bad_input_raises_before_generating(prompts, kwargs, match):
    eng = engine(5)
    sampler = Sampler(eng, params())
    kwargs = {"uids": [str(i) for i in range(len(prompts))], "decode": DecodeParams(max_new_tokens=4), **kwargs}
    before = dict(eng.stats)
    with pytest.raises(ValueError, match=match):
        sampler.generate(prompts, **kwargs)
    assert dict(eng.stats) == before  # nothing was prefilled or decoded


def test_long_prompts_truncate_when_configured():
    long = list(range(3, 3 + MAX_PREFILL + 5))
    for mode, kept, new in (("left", long[-MAX_PREFILL:], 2), ("right", long[:MAX_PREFILL], 1)):
        sampler = Sampler(engine(5), params(), truncation=mode)
        traj = sampler.generate([long], uids=["x"], decode=DecodeParams(max_new_tokens=new))
        assert traj.prompt_ids[0].tolist() == kept and traj.prompt_length[0] == MAX_PREFILL
        assert traj.response_length.tolist() == [new] and traj.truncated.all()
    with pytest.raises(ValueError, match="truncation"):
        Sampler(engine(5), params(), truncation="middle")
    with pytest.raises(ValueError, match="compact_min_slots is 0"):
        Sampler(engine(5), params(), compact_min_slots=0)


# --------------------------------------------------------------------------- slower checks


@pytest.mark.slow
def test_greedy_exact_with_one_slot():
    traj = Sampler(engine(1), params(), steps_per_sync=7).generate(
        PROMPTS, uids=UIDS, decode=DecodeParams(temperature=0.0, max_new_tokens=MAX_DECODE, eos_ids=())
    )
    assert responses(traj) == [list(r) for r in reference()]


@pytest.mark.slow
def test_sampling_on_a_tp_mesh_reproduces_single_device_tokens():
    decode = DecodeParams(temperature=1.0, top_k=40, max_new_tokens=12, seed=4)
    a = Sampler(engine(8, mesh_tp=2), params()).generate(PROMPTS, uids=UIDS, n=2, decode=decode)
    b = Sampler(engine(2), params()).generate(PROMPTS, uids=UIDS, n=2, decode=decode)
    np.testing.assert_array_equal(a.response_ids, b.response_ids)
    np.testing.assert_allclose(a.rollout_logp, b.rollout_logp, atol=1e-4)
