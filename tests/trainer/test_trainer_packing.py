"""Packed learner batches: packing plans, packed == padded log-probs and updates (on meshes too)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax.models import functional as F
from rljax.models.config import get_config
from rljax.sharding import make_mesh
from rljax.trainer import StepConfig, init_state, make_logprob_fn, make_train_step
from rljax.trainer import packing as P
from rljax.trainer.step import PackedLogprob

S, T = 8, 8
CFG = get_config("tiny")


def _batch(seed: int, b: int):
    """Left-padded prompts, ragged responses, a tool-observation token, old log-probs."""
    rng = np.random.default_rng(seed)
    plen = rng.integers(2, S + 1, b)
    rlen = rng.integers(1, T + 1, b)
    prompt_mask = np.arange(S)[None, :] >= (S - plen)[:, None]
    resp_mask = np.arange(T)[None, :] < rlen[:, None]
    attn = np.concatenate([prompt_mask, resp_mask], axis=1)
    ids = np.where(attn, rng.integers(3, CFG.vocab_size, (b, S + T)), 0).astype(np.int32)
    loss_mask = resp_mask.copy()
    loss_mask[:, 1] &= rng.random(b) > 0.5
    batch = {
        "input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(attn),
        "positions": F.default_positions(jnp.asarray(attn)),
        "loss_mask": jnp.asarray(loss_mask, jnp.float32),
        "advantages": jnp.asarray(rng.normal(0, 1, (b, T)) * loss_mask, jnp.float32),
    }
    # near the model's log-probs at init (~ -log V), so some ratios clip and some do not
    batch["old_logp"] = jnp.asarray(-np.log(CFG.vocab_size) + rng.normal(0, 0.3, (b, T)), jnp.float32)
    return batch


def _host(batch):
    return tuple(np.asarray(batch[k]) for k in ("input_ids", "attention_mask", "positions"))


@pytest.fixture(scope="module")
def model():
    return F.init_params(CFG, seed=0)


@pytest.fixture(scope="module")
def batch(model):
    return _batch(0, 8)


# ------------------------------------------------------------------ host planning


def test_bucket_and_first_fit():
    assert [P.bucket(n) for n in (0, 1, 2, 3, 4, 5, 7, 9, 13, 17)] == [1, 1, 2, 3, 4, 6, 8, 12, 16, 24]
    bins = P.first_fit_decreasing([5, 3, 4, 2, 6], 8)
    assert sorted(sorted(b) for b in bins) == [[0, 1], [2], [3, 4]]  # 6+2, 5+3, 4
    with pytest.raises(ValueError, match="does not fit a packed row of 4"):
        P.first_fit_decreasing([5], 4)


def test_balanced_assignment_equalises_loads():
    loads = [9, 8, 7, 1, 1, 0, 0, 0]
    group = P.balanced_assignment(loads, 4)
    assert np.bincount(group, minlength=4).tolist() == [2, 2, 2, 2]
    totals = np.bincount(group, weights=loads, minlength=4)
    assert totals.max() == 9 and P.imbalance(totals) == pytest.approx(9 / 6.5)


def test_pack_layout_restarts_positions_and_maps_back(batch):
    ids, attn, pos = _host(batch)
    cfg = P.PackConfig(row_len=32, micro_batch_size=8)
    arrays, stats = P.pack(ids, attn, pos, T, [np.arange(8)], mini_batch_size=8, cfg=cfg)
    assert stats["real_tokens"] == attn.sum() and stats["packed_tokens"] < stats["padded_tokens"]
    seg, tok, posn, tgt = (arrays[k][0, 0] for k in ("segment_ids", "tokens", "positions", "targets"))
    assert (tok[seg == 0] == 0).all() and (seg.max(axis=1) >= 2).any()  # some row holds two trajectories
    seen = set()
    for slot, t in enumerate(arrays["traj_index"][0, 0]):
        if t == 8:
            continue
        seen.add(int(t))
        flat = arrays["gather"][0, 0, slot]
        row = int(flat[0]) // 32  # every trajectory sits in one row
        segment = seg[row, int(flat[0]) % 32]
        where = seg[row] == segment
        np.testing.assert_array_equal(tok[row, where], ids[t, attn[t]])
        np.testing.assert_array_equal(posn[row, where], np.arange(attn[t].sum()))  # restarts at 0
        for j in np.flatnonzero(np.asarray(batch["loss_mask"])[t]):
            r, c = divmod(int(flat[j]), 32)
            assert r == row and tgt[r, c] == ids[t, S + j]  # the packed position predicts response token j
    assert seen == set(range(8))


def test_pack_rejects_budget_below_a_row():
    with pytest.raises(ValueError, match="max_token_len_per_device=4 holds less than one packed row"):
        P.PackConfig(row_len=16, use_dynamic_bsz=True, max_token_len_per_device=4)
    with pytest.raises(ValueError, match="multiple of sp=2"):
        P.PackConfig(row_len=15, sp=2, micro_batch_size=2)


@pytest.mark.parametrize("spec", ["dp8", "dp2,tp2,sp2"])
def test_plan_reads_spans_only_and_tokens_are_taken_on_the_mesh(batch, devices, spec):
    """The packing plan needs every row's real-token span, not its tokens: the spans read back from
    the batch where it lies (``host_spans``: three [B] int arrays; several processes all-gather
    just those) give the plan of the host packing, and the packed rows taken on the devices from
    the global batch equal the host packing's arrays, laid out with rows on dp and columns on sp."""
    from rljax.sharding import place_batch
    from rljax.trainer.step import host_spans

    mesh = make_mesh(spec)
    ids, attn, pos = _host(batch)
    glob = place_batch({"input_ids": ids, "attention_mask": attn, "positions": pos}, mesh)
    first, count, nbytes = host_spans(glob["attention_mask"])
    assert nbytes == 0  # one process: nothing all-gathered
    np.testing.assert_array_equal(first, S - attn[:, :S].sum(axis=1))
    np.testing.assert_array_equal(count, attn.sum(axis=1))
    sizes = dict(mesh.shape)
    cfg = P.PackConfig(row_len=32, dp=sizes["dp"], sp=sizes["sp"], use_dynamic_bsz=True,
                       max_token_len_per_device=32 // sizes["sp"], balance=True)
    orders = [np.random.default_rng(1).permutation(8), np.arange(8)]
    want, stats = P.pack(ids, attn, pos, T, orders, mini_batch_size=4, cfg=cfg)
    index, planned = P.plan(first, count, S + T, T, orders, mini_batch_size=4, cfg=cfg)
    assert planned == stats
    got = P.take_rows_on_mesh(glob["input_ids"], glob["positions"], index, mesh)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(got[k]), v, err_msg=k)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, None, "dp", "sp"))
    for k in P.ROW_FIELDS:
        assert got[k].sharding.is_equivalent_to(rows, 4), (k, got[k].sharding)


def test_packing_refuses_a_row_with_gaps(batch):
    ids, attn, pos = _host(batch)
    attn = attn.copy()
    attn[3, S + 1] = False  # a hole in row 3's response
    attn[3, S + 2] = True
    with pytest.raises(ValueError, match="row 3 of the learner batch has gaps in its attention mask"):
        P.pack(ids, attn, pos, T, [np.arange(8)], mini_batch_size=8, cfg=P.PackConfig(row_len=32, micro_batch_size=8))
    from rljax.trainer.step import host_spans

    with pytest.raises(ValueError, match="row 3 of the learner batch has gaps"):
        host_spans(jnp.asarray(attn))


# ------------------------------------------------------------------ numbers


@pytest.fixture(scope="module")
def logprob_fns(model):
    graphdef, _ = model
    padded = make_logprob_fn(graphdef, response_len=T, temperature=1.0, impl="chunked")
    packed = PackedLogprob(graphdef, P.PackConfig(row_len=32, use_dynamic_bsz=True, max_token_len_per_device=32),
                           response_len=T, temperature=1.0, impl="chunked")
    return padded, packed


def test_packed_logprobs_equal_padded(model, batch, logprob_fns):
    _, params = model
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "positions")}
    ref = logprob_fns[0](params, inputs)
    out = logprob_fns[1](params, inputs)
    assert logprob_fns[1].stats["shape"][1] == 1  # one 32-token row per chunk
    m = np.asarray(batch["loss_mask"]) > 0
    for a, b in zip(out, ref):
        np.testing.assert_allclose(np.asarray(a)[m], np.asarray(b)[m], rtol=1e-5, atol=1e-5)


def test_auto_packing_chooses_by_fill_and_matches_both(model, batch, logprob_fns):
    """use_remove_padding=auto: packed when the real tokens fill at most max_fill of [B, S+T]."""
    _, params = model
    fill = float(np.mean(np.asarray(batch["attention_mask"])))
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "positions")}
    m = np.asarray(batch["loss_mask"]) > 0
    outs = {}
    for max_fill, packed in ((fill, True), (fill - 0.01, False)):
        auto = P.AutoPacking(*logprob_fns, max_fill=max_fill)
        outs[packed] = auto(params, inputs)
        assert auto.last_packed is packed and auto.fill == pytest.approx(fill)
        assert auto.compiles == (logprob_fns[1].compiles if packed else logprob_fns[1].compiles + 1)
        assert ("dp_token_imbalance" in auto.stats) is packed
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_allclose(np.asarray(a)[m], np.asarray(b)[m], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="max_fill=1.5 must be in"):
        P.AutoPacking(*logprob_fns, max_fill=1.5)


def test_use_remove_padding_accepts_auto_and_bools():
    from rljax.config import ConfigError, resolve

    assert resolve()[0].actor.use_remove_padding == "auto"
    for text, value in (("true", "true"), ("false", "false"), ("auto", "auto")):
        assert resolve(None, [f"actor.use_remove_padding={text}"])[0].actor.use_remove_padding == value
    with pytest.raises(ConfigError, match="use_remove_padding='sometimes' is not accepted; accepted: auto, true, false$"):
        resolve(None, ["actor.use_remove_padding=sometimes"])
    with pytest.raises(ConfigError, match="does not apply LoRA dropout"):
        resolve(None, ["actor.use_remove_padding=true", "actor.lora.rank=4", "actor.lora.dropout=0.1"])
    resolve(None, ["actor.use_remove_padding=auto", "actor.lora.rank=4", "actor.lora.dropout=0.1"])  # runs padded


def test_default_token_budget_is_the_padded_micro_batch():
    from rljax.config import ConfigError, resolve

    cfg = resolve()[0]
    assert cfg.actor.use_dynamic_bsz  # the default: packed micro-batches by tokens (README: 2.3x vs 1.2x fixed)
    with pytest.raises(ConfigError, match="ppo_max_token_len_per_device=64 sizes packed micro-batches; it needs"):
        resolve(None, ["actor.use_remove_padding=false", "actor.ppo_max_token_len_per_device=64"])
    resolve(None, ["actor.use_remove_padding=false"])  # use_dynamic_bsz=true (default) only applies when packed
    update, logprob = P.pack_configs(cfg, dp=2, sp=2, row_len=24, micro_batch_size=8)
    assert update.max_token_len_per_device == logprob.max_token_len_per_device == 4 * 12  # 8/2 rows of 24/2
    assert update.rows_per_device == 4


def _update(graphdef, params, batch, *, mesh=None, pack_cfg=None, **kw):
    opt = optax.sgd(1.0)
    cfg = StepConfig(**{"ppo_mini_batch_size": 4, "ppo_micro_batch_size": 2, "ppo_epochs": 2,
                        "logprob_impl": "chunked", **kw})
    state = init_state(jax.tree.map(jnp.copy, params), opt)
    key = jax.random.key(0)
    if pack_cfg is None:
        return make_train_step(graphdef, opt, cfg, mesh=mesh)(state, batch, key)
    arrays, _ = P.pack(*_host(batch), T, P.epoch_orders(key, 8, cfg.ppo_epochs), mini_batch_size=cfg.ppo_mini_batch_size, cfg=pack_cfg)
    step = make_train_step(graphdef, opt, cfg, mesh=mesh, packed=True)
    return step(state, batch, P.place_packed(arrays, mesh))


@pytest.fixture(scope="module")
def padded_update(model, batch):
    return _update(*model, batch)


_KEYS = ("loss", "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm")


@pytest.mark.slow
@pytest.mark.parametrize("pack_cfg", [
    P.PackConfig(row_len=32, micro_batch_size=2),
    P.PackConfig(row_len=32, dp=2, use_dynamic_bsz=True, max_token_len_per_device=32, balance=True),
], ids=["fixed", "token-budget-balanced"])
def test_packed_update_equals_padded(model, batch, padded_update, pack_cfg):
    ref, mref = padded_update
    out, mout = _update(*model, batch, pack_cfg=pack_cfg)
    chex.assert_trees_all_close(out.params, ref.params, rtol=1e-5, atol=1e-6)
    for k in _KEYS:
        np.testing.assert_allclose(mout[k], mref[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["dp8", "dp2,tp2,sp2"])
def test_packed_update_on_a_mesh_equals_padded(model, batch, padded_update, devices, spec):
    graphdef, params = model
    mesh = make_mesh(spec)
    sizes = dict(mesh.shape)
    pack_cfg = P.PackConfig(row_len=32, dp=sizes["dp"], sp=sizes["sp"], use_dynamic_bsz=True,
                            max_token_len_per_device=32 // sizes["sp"], balance=True)
    out, mout = _update(graphdef, jax.device_put(params, F.param_shardings(CFG, mesh)), batch, mesh=mesh,
                        pack_cfg=pack_cfg)
    ref, mref = padded_update
    chex.assert_trees_all_close(out.params, ref.params, rtol=1e-4, atol=1e-5)
    for k in _KEYS:
        np.testing.assert_allclose(mout[k], mref[k], rtol=1e-4, atol=1e-6, err_msg=k)


# ------------------------------------------------------------------ end to end


@pytest.mark.slow
def test_packed_run_reports_the_padded_runs_numbers(tmp_path, gae_kl_dp2_tp2_sp2_run):
    """The first training step through the launcher, padded and packed (token budget, balance),
    on dp2,tp2,sp2: the same rollouts, so the same losses and gradient norms. The padded run is
    the slow pass's shared dp2,tp2,sp2 run (tests/conftest.py: PPO with GAE's critic and KL in the
    reward and as a loss), so the packed one packs the critic's and the reference's passes too."""
    import json

    from test_launch import GAE_KL, SMALL, launch

    runs = {"padded": gae_kl_dp2_tp2_sp2_run[0], "packed": tmp_path / "packed"}
    out = launch("--mesh=dp2,tp2,sp2", "--run-dir", str(runs["packed"]), *SMALL, *GAE_KL, "trainer.total_steps=1",
                 "actor.use_remove_padding=true", "actor.use_dynamic_bsz=true", "trainer.balance_batch=true",
                 timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {}
    for name, run in runs.items():
        recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        rows[name] = next(r for r in recs if r["step"] == 1 and "actor/pg_loss" in r)
    for k in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl", "actor/pg_clipfrac",
              "actor/kl_loss", "critic/vf_loss", "critic/grad_norm", "critic/values/mean"):
        np.testing.assert_allclose(rows["packed"][k], rows["padded"][k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert rows["packed"]["perf/learner_compiles"] >= 2 and 0 <= rows["packed"]["perf/learner_padding_frac"] < 1
    assert rows["packed"]["perf/dp_token_imbalance"] >= 1.0
    assert "perf/mfu/actor" not in rows["packed"] and rows["packed"]["perf/model_flops/actor"] > 0  # CPU: no MFU


@pytest.mark.slow
def test_packed_on_policy_update_returns_the_old_logp_it_used(model, batch):
    """StepConfig.on_policy on the packed step: one epoch over one mini-batch equals the packed
    step fed the old_logp of a separate pass with the same parameters, and the update's own
    old_logp comes back in the batch's row order (empty slots dropped)."""
    graphdef, params = model
    old, _ = make_logprob_fn(graphdef, response_len=T, temperature=1.0, impl="chunked")(params, batch)
    fed = dict(batch, old_logp=old)
    own = {k: v for k, v in batch.items() if k != "old_logp"}
    pack_cfg = P.PackConfig(row_len=32, micro_batch_size=4)
    kw = dict(pack_cfg=pack_cfg, ppo_epochs=1, ppo_mini_batch_size=8, ppo_micro_batch_size=4)
    ref, mref = _update(graphdef, params, fed, **kw)
    out, mout = _update(graphdef, params, own, on_policy=True, **kw)
    chex.assert_trees_all_close(out.params, ref.params, rtol=1e-5, atol=1e-6)
    for k in _KEYS:
        np.testing.assert_allclose(mout[k], mref[k], rtol=1e-4, atol=1e-6, err_msg=k)
    real = np.asarray(batch["attention_mask"])[:, S:]  # packed rows hold no padding: nothing to compare there
    np.testing.assert_allclose(np.where(real, mout["old_logp"], 0), np.where(real, old, 0), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------ critic (GAE)


@pytest.fixture(scope="module")
def critic_setup(model, batch):
    from rljax.trainer.critic import init_critic

    graphdef, params = model
    cp = init_critic(params)
    rng = np.random.default_rng(1)  # a non-zero head, so the values depend on every position
    cp["head"] = {"w": jnp.asarray(rng.normal(0, 0.5, cp["head"]["w"].shape), jnp.float32), "b": jnp.float32(0.1)}
    m = np.asarray(batch["loss_mask"])
    fields = {k: batch[k] for k in ("input_ids", "attention_mask", "positions", "loss_mask")}
    fields["old_values"] = jnp.asarray(rng.normal(0, 1, m.shape) * m, jnp.float32)
    fields["returns"] = jnp.asarray(rng.normal(0, 1, m.shape) * m, jnp.float32)
    return graphdef, cp, fields


@pytest.mark.slow  # two programs to compile (~5 s)
def test_packed_critic_values_equal_padded(critic_setup):
    from rljax.trainer.critic import critic_values, make_packed_values_fn

    graphdef, cp, fields = critic_setup
    inputs = {k: fields[k] for k in ("input_ids", "attention_mask", "positions")}
    ref = jax.jit(lambda p, b: critic_values(graphdef, p, b, response_len=T))(cp, inputs)
    packed = PackedLogprob(graphdef, P.PackConfig(row_len=32, use_dynamic_bsz=True, max_token_len_per_device=32),
                           response_len=T, packed_fn=make_packed_values_fn(graphdef))
    out = packed(cp, inputs)
    m = np.asarray(fields["loss_mask"]) > 0
    assert packed.stats["packed_tokens"] < packed.stats["padded_tokens"]
    np.testing.assert_allclose(np.asarray(out)[m], np.asarray(ref)[m], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_packed_critic_update_equals_padded(critic_setup):
    """The critic's clipped value loss, gradients and metrics: packed (fixed micro-batches) == padded."""
    from rljax.trainer.critic import CriticStepConfig, critic_loss
    from rljax.trainer.step import PackedTrainStep

    graphdef, cp, fields = critic_setup
    opt = optax.sgd(0.01)  # small: the value loss's gradients are large, and 1.0 sends the head to ~1e6
    cfg = CriticStepConfig(ppo_mini_batch_size=4, ppo_micro_batch_size=2, ppo_epochs=2, cliprange_value=0.2)
    key = jax.random.key(0)
    ref, mref = make_train_step(graphdef, opt, cfg, loss_fn=critic_loss)(init_state(jax.tree.map(jnp.copy, cp), opt),
                                                                         fields, key)
    step = PackedTrainStep(graphdef, opt, cfg, P.PackConfig(row_len=32, micro_batch_size=2), response_len=T,
                           loss_fn=critic_loss)
    out, mout = step(init_state(jax.tree.map(jnp.copy, cp), opt), fields, key)
    # 1e-4 / 1e-5 as the mesh case above: the value loss's gradients are large, so float32 sums in
    # another order (packed rows vs padded) move the embedding by up to 8.5e-6 on an AMD EPYC host
    # (XLA's CPU code orders reductions per CPU; 1e-6 held on the Intel hosts of earlier sessions)
    chex.assert_trees_all_close(out.params, ref.params, rtol=1e-4, atol=1e-5)
    for k in ("loss", "vf_loss", "vf_clipfrac", "grad_norm"):
        np.testing.assert_allclose(mout[k], mref[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert 0 < float(mref["vf_clipfrac"]) < 1  # the clip is exercised both ways
