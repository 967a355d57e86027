"""The shared-prefix learner layout (rljax.trainer.prefix): each group's prompt laid once, its
responses after it; log-probs and the update equal the unshared packed layout's."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax.models import functional as F
from rljax.models.attention import block_sparse_attention, branch_ids, dense_attention
from rljax.models.config import get_config
from rljax.trainer import StepConfig, init_state, make_train_step
from rljax.trainer import packing as P, prefix as X
from rljax.trainer.step import make_packed_logprob_fn

S, T = 8, 8
CFG = get_config("tiny")
GROUPS, N = 3, 4


def _group_batch(seed: int, groups: int = GROUPS, n: int = N):
    """``groups`` prompts x ``n`` responses: left-padded prompts equal within a group, ragged responses,
    a loss mask with a hole (a tool observation), GRPO-like advantages and old log-probs."""
    rng = np.random.default_rng(seed)
    b = groups * n
    plen = np.repeat(rng.integers(2, S + 1, groups), n)
    rlen = rng.integers(1, T + 1, b)
    prompt_mask = np.arange(S)[None] >= (S - plen)[:, None]
    resp_mask = np.arange(T)[None] < rlen[:, None]
    attn = np.concatenate([prompt_mask, resp_mask], 1)
    tokens = np.concatenate([np.repeat(rng.integers(3, CFG.vocab_size, (groups, S)), n, 0),
                             rng.integers(3, CFG.vocab_size, (b, T))], 1)
    ids = np.where(attn, tokens, 0).astype(np.int32)
    loss_mask = resp_mask.copy()
    loss_mask[:, 1] &= rng.random(b) > 0.5
    return {
        "input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(attn),
        "positions": F.default_positions(jnp.asarray(attn)),
        "loss_mask": jnp.asarray(loss_mask, jnp.float32),
        "advantages": jnp.asarray(np.repeat(rng.normal(0, 1, (groups, 1)), n, 0) * loss_mask, jnp.float32),
        "old_logp": jnp.asarray(-np.log(CFG.vocab_size) + rng.normal(0, 0.3, (b, T)), jnp.float32),
    }


def _host(batch):
    return tuple(np.asarray(batch[k]) for k in ("input_ids", "attention_mask", "positions"))


@pytest.fixture(scope="module")
def model():
    return F.init_params(CFG, seed=0)


@pytest.fixture(scope="module")
def batch():
    return _group_batch(0)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 16 tokens, so the tiny rows have several and the key-block lists skip some."""
    monkeypatch.setattr(X, "SPARSE_BLOCK", 16)


def _attention_case():
    rng = np.random.default_rng(0)
    b, t, n, kh, d = 2, 40, 4, 2, 8
    seg = np.zeros((b, t), np.int32)
    seg[0, :10], seg[0, 10:18], seg[0, 18:30], seg[0, 30:36] = (branch_ids(1, k) for k in (0, 1, 2, 3))
    seg[1, :12], seg[1, 12:20], seg[1, 20:33] = 1, branch_ids(2, 0), branch_ids(2, 1)
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for h in (n, kh, kh))
    idx = jnp.broadcast_to(jnp.arange(t), (b, t))
    valid, seg = jnp.asarray(seg > 0), jnp.asarray(seg)
    blocks = jnp.asarray(X.key_block_lists(np.asarray(seg), block=8))
    assert blocks.shape[-1] < blocks.shape[1]  # some key blocks are skipped
    return q, k, v, idx, valid, seg, blocks


def test_block_sparse_attention_equals_dense_on_a_shared_layout():
    q, k, v, idx, valid, seg, blocks = _attention_case()
    want = dense_attention(q, k, v, idx, idx, valid, seg, seg)
    got = block_sparse_attention(q, k, v, idx, idx, valid, seg, seg, blocks)
    live = np.asarray(valid)[..., None, None]
    np.testing.assert_allclose(np.where(live, got, 0), np.where(live, want, 0), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_block_sparse_attention_gradients_equal_dense():
    """The blockwise kernel's backward through the gathered key blocks."""
    q, k, v, idx, valid, seg, blocks = _attention_case()
    loss = lambda f: lambda q, k, v: jnp.sum(jnp.where(valid[..., None, None], f(q, k, v), 0.0) ** 2)  # noqa: E731
    gd = jax.grad(loss(lambda q, k, v: dense_attention(q, k, v, idx, idx, valid, seg, seg)), (0, 1, 2))(q, k, v)
    gs = jax.grad(loss(lambda q, k, v: block_sparse_attention(q, k, v, idx, idx, valid, seg, seg, blocks)),
                  (0, 1, 2))(q, k, v)
    chex.assert_trees_all_close(gs, gd, rtol=1e-4, atol=1e-5)


def test_layout_lays_each_prompt_once_with_positions_continuing(batch):
    ids, attn, pos = _host(batch)
    cfg = P.PackConfig(row_len=S + T, micro_batch_size=GROUPS * N)
    arrays, stats = X.pack(ids, attn, pos, T, [np.arange(GROUPS * N)], mini_batch_size=GROUPS * N, cfg=cfg)
    plen = attn[:, :S].sum(1)
    assert stats["shared_prefix"] and stats["shared_units"] == GROUPS
    assert stats["shared_saved_tokens"] == sum((N - 1) * (plen[g * N] - 1) for g in range(GROUPS))
    seg, tok, p = (arrays[k][0, 0, 0] for k in ("segment_ids", "tokens", "positions"))
    for g in range(GROUPS):
        first = g * N
        prefix = np.flatnonzero(seg == branch_ids(g + 1, 0))
        np.testing.assert_array_equal(tok[prefix], ids[first, S - plen[first]:S - 1])  # the prompt, once
        for k in range(N):
            at = np.flatnonzero(seg == branch_ids(g + 1, k + 1))
            row = first + k
            np.testing.assert_array_equal(tok[at], ids[row][attn[row]][plen[row] - 1:])  # last prompt token, response
            np.testing.assert_array_equal(p[at], plen[row] - 1 + np.arange(at.size))  # positions go on from the prompt


def _logprobs(model, arrays, b):
    graphdef, params = model
    fn = make_packed_logprob_fn(graphdef, temperature=1.0, impl="chunked")
    return fn(params, {k: jnp.asarray(v) for k, v in arrays.items()}, b)


@pytest.mark.parametrize("blocks", [True, False], ids=["key-blocks", "mask-only"])
def test_shared_logprobs_equal_unshared(model, batch, small_blocks, blocks):
    ids, attn, pos = _host(batch)
    b = ids.shape[0]
    cfg = P.PackConfig(row_len=S + T, use_dynamic_bsz=True, max_token_len_per_device=2 * (S + T))
    shared, stats = X.pack(ids, attn, pos, T, [np.arange(b)], mini_batch_size=b, cfg=cfg)
    assert stats["shared_prefix"] and stats["laid_tokens"] < stats["real_tokens"]
    assert np.any(shared["key_blocks"] < 0)  # the lists skip blocks
    if not blocks:
        shared.pop("key_blocks")
    unshared, _ = P.pack(ids, attn, pos, T, [np.arange(b)], mini_batch_size=b, cfg=cfg)
    mask = attn[:, S:]
    for got, want in zip(_logprobs(model, shared, b), _logprobs(model, unshared, b)):
        np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, want, 0), rtol=1e-5, atol=1e-5)


def _update(model, batch, *, shared, pack_cfg, mesh=None, params=None, **kw):
    graphdef, p0 = model
    opt = optax.sgd(1.0)
    b = batch["loss_mask"].shape[0]
    cfg = StepConfig(**{"ppo_mini_batch_size": b // 2, "ppo_micro_batch_size": b // 4, "ppo_epochs": 2,
                        "logprob_impl": "chunked", **kw})
    state = init_state(jax.tree.map(jnp.copy, p0 if params is None else params), opt)
    orders = P.epoch_orders(jax.random.key(0), b, cfg.ppo_epochs)
    arrays, stats = X.pack(*_host(batch), T, orders, mini_batch_size=cfg.ppo_mini_batch_size, cfg=pack_cfg,
                           shared_prefix=shared)
    assert stats["shared_prefix"] == shared
    step = make_train_step(graphdef, opt, cfg, mesh=mesh, packed=True)
    return step(state, batch, P.place_packed(arrays, mesh))


_KEYS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm")


def assert_same_update(got, want, rtol=1e-5, atol=1e-6):
    (out, mout), (ref, mref) = got, want
    chex.assert_trees_all_close(out.params, ref.params, rtol=rtol, atol=atol)
    for k in _KEYS:
        np.testing.assert_allclose(mout[k], mref[k], rtol=rtol, atol=atol, err_msg=k)


@pytest.mark.slow
def test_shared_update_equals_unshared(model, batch, small_blocks):
    """Two epochs of shuffled mini-batches: the groups are split between mini-batches and shared
    where their members meet (loss, metrics and the parameters after the update equal)."""
    cfg = P.PackConfig(row_len=S + T, use_dynamic_bsz=True, max_token_len_per_device=2 * (S + T))
    assert_same_update(_update(model, batch, shared=True, pack_cfg=cfg),
                       _update(model, batch, shared=False, pack_cfg=cfg))


def test_auto_shares_only_when_it_saves_enough(batch):
    ids, attn, pos = _host(batch)
    first, count = P.row_spans(attn)
    keys = X.prompt_hash(np, ids, attn, S)
    cfg = P.PackConfig(row_len=S + T, micro_batch_size=4)
    plan = lambda order, mini: X.plan_layout(first, count, S + T, T, [order], mini_batch_size=mini, cfg=cfg,  # noqa: E731
                                             shared_prefix="auto", prompt_keys=keys)[1]
    b = ids.shape[0]
    assert plan(np.arange(b), b)["shared_prefix"]  # groups meet in their micro-batches: shared
    apart = np.arange(b).reshape(GROUPS, N).T.reshape(-1)  # every micro-batch holds one member per group
    stats = plan(apart, b)
    assert not stats["shared_prefix"] and "shared_saved_tokens" not in stats


# ------------------------------------------------------------------ meshes, LoRA, multi-turn (slow)


@pytest.fixture(scope="module")
def unshared_update(model, batch):
    cfg = P.PackConfig(row_len=S + T, use_dynamic_bsz=True, max_token_len_per_device=2 * (S + T))
    return _update(model, batch, shared=False, pack_cfg=cfg)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["dp8", "dp2,tp2,sp2"])
def test_shared_update_on_a_mesh_equals_unshared(model, batch, unshared_update, devices, spec, small_blocks):
    """dp8 runs the key-block lists with rows on dp; dp2,tp2,sp2 splits the long shared rows over
    sp, where attention reads whole rows under the same mask (no lists)."""
    from rljax.sharding import make_mesh

    graphdef, params = model
    mesh = make_mesh(spec)
    sizes = dict(mesh.shape)
    cfg = P.PackConfig(row_len=S + T, dp=sizes["dp"], sp=sizes["sp"], use_dynamic_bsz=True,
                       max_token_len_per_device=2 * (S + T) // sizes["sp"], balance=True)
    got = _update(model, batch, shared=True, pack_cfg=cfg, mesh=mesh,
                  params=jax.device_put(params, F.param_shardings(CFG, mesh)))
    assert_same_update(got, unshared_update, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_multi_turn_lora_rows_share_only_the_first_prompt(model, small_blocks):
    """Episodes whose responses open with the same first turn and hold a tool observation (loss
    mask 0): only the prompt is laid once (the common first turn is each response's own), and a
    LoRA update (adapters trained, base frozen) equals the unshared layout's."""
    from rljax.models import lora as L

    lcfg = L.LoRAConfig(rank=2, alpha=4.0)
    adapters = L.init_adapters(CFG, lcfg, seed=1)
    # B = 0 at init would leave A's gradient zero: both non-zero here
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), adapters)
    lora = L.LoRAParams(base=model[1], adapters=adapters, config=lcfg)
    batch = dict(_group_batch(1))
    ids, attn, pos = _host(batch)
    turn = np.repeat(np.random.default_rng(3).integers(3, CFG.vocab_size, (GROUPS, 3)), N, 0)
    ids = ids.copy()
    ids[:, S:S + 3] = np.where(attn[:, S:S + 3], turn, 0)  # the same first turn in every member of a group
    loss_mask = np.asarray(batch["loss_mask"]).copy()
    loss_mask[:, 3:5] = 0  # a tool observation after it
    batch.update(input_ids=jnp.asarray(ids), loss_mask=jnp.asarray(loss_mask))
    _, stats = X.pack(ids, attn, pos, T, [np.arange(GROUPS * N)], mini_batch_size=GROUPS * N,
                      cfg=P.PackConfig(row_len=S + T, micro_batch_size=GROUPS * N))
    plen = attn[:, :S].sum(1)
    assert stats["shared_saved_tokens"] == sum((N - 1) * (plen[g * N] - 1) for g in range(GROUPS))
    cfg = P.PackConfig(row_len=S + T, use_dynamic_bsz=True, max_token_len_per_device=2 * (S + T))
    assert_same_update(_update(model, batch, shared=True, pack_cfg=cfg, params=lora),
                       _update(model, batch, shared=False, pack_cfg=cfg, params=lora))
