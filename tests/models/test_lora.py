"""LoRA: init equals the base, adapters shard with the base, reference = adapters off, only
adapters train, merged weights give the sampler the learner's log-probs, adapter-only resume."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rljax.models import functional as F
from rljax.models import lora as L
from rljax.models.config import get_config
from rljax.rollout import DecodeParams, RljaxEngine, Sampler
from rljax.sharding import make_mesh
from rljax.trainer import StepConfig, init_state, make_logprob_fn, make_optimizer, make_train_step, trainable
from rljax.trainer.checkpoint import Checkpointer

CFG = get_config("tiny")
LCFG = L.LoRAConfig(rank=4, alpha=8.0)
S, T = 6, 6


@pytest.fixture(scope="module")
def base():
    return F.init_params(CFG, seed=0)


def _adapted(base_params, seed=1, scale=0.05, lcfg=LCFG):
    """Adapters with a non-zero B (as after some training)."""
    ad = L.init_adapters(CFG, lcfg, seed=seed)
    ad = jax.tree.map(lambda x: x + scale * jax.random.normal(jax.random.key(seed + 7), x.shape, x.dtype), ad)
    return L.LoRAParams(base=base_params, adapters=ad, config=lcfg)


def _batch(b, seed=0):
    rng = np.random.default_rng(seed)
    plen, rlen = rng.integers(2, S + 1, b), rng.integers(1, T + 1, b)
    attn = np.concatenate([np.arange(S)[None] >= (S - plen)[:, None], np.arange(T)[None] < rlen[:, None]], 1)
    ids = np.where(attn, rng.integers(3, CFG.vocab_size, (b, S + T)), 0).astype(np.int32)
    return {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(attn),
            "positions": F.default_positions(jnp.asarray(attn)),
            "loss_mask": jnp.asarray(attn[:, S:], jnp.float32),
            "advantages": jnp.asarray(np.repeat(rng.normal(0, 1, (b, 1)), T, 1), jnp.float32)}


_logp = make_logprob_fn(F.abstract_params(CFG)[0], response_len=T, temperature=1.0, impl="naive")


def test_init_equals_base_exactly(base):
    graphdef, params = base
    p = L.LoRAParams(base=params, adapters=L.init_adapters(CFG, LCFG, seed=3), config=LCFG)
    assert all(float(jnp.abs(x).max()) == 0 for k, x in _leaves(p.adapters) if k.endswith("'b']"))
    assert all(float(jnp.abs(x).max()) > 0 for k, x in _leaves(p.adapters) if k.endswith("'a']"))
    batch = _batch(4)
    np.testing.assert_array_equal(_logp(p, batch)[0], _logp(params, batch)[0])


def _leaves(tree):
    return [(jax.tree_util.keystr(k), x) for k, x in jax.tree_util.tree_leaves_with_path(tree)]


def test_reference_is_the_base_with_adapters_off(base):
    graphdef, params = base
    p = _adapted(params)
    batch = _batch(4, seed=1)
    adapted, base_lp = _logp(p, batch)[0], _logp(params, batch)[0]
    assert float(jnp.abs(adapted - base_lp).max()) > 1e-2  # the adapters do something
    np.testing.assert_array_equal(_logp(L.disable(p), batch)[0], base_lp)


def test_merge_equals_the_unmerged_forward(base):
    graphdef, params = base
    p = _adapted(params)
    batch = _batch(4, seed=2)
    np.testing.assert_allclose(_logp(L.merge(p), batch)[0], _logp(p, batch)[0], atol=2e-5)
    assert set(L.merge(p)) == set(params)


def test_targets_subset_and_dropout(base):
    graphdef, params = base
    lcfg = L.LoRAConfig(rank=2, target_modules=("v_proj", "q_proj"), dropout=0.5)
    assert lcfg.target_modules == ("q_proj", "v_proj")
    p = _adapted(params, lcfg=lcfg)
    assert set(p.adapters["layers"]) == {"attn"} and set(p.adapters["layers"]["attn"]) == {"q_proj", "v_proj"}
    batch = _batch(4, seed=3)
    plain = _logp(p, batch)[0]  # no dropout key: deterministic, as for old / reference log-probs
    np.testing.assert_allclose(plain, _logp(p.replace(config=L.LoRAConfig(rank=2, target_modules=("q_proj", "v_proj"))), batch)[0])
    dropped = _logp(p.replace(dropout_key=jax.random.key(0)), batch)[0]
    assert float(jnp.abs(dropped - plain).max()) > 1e-3


@pytest.mark.parametrize("bad, match", [
    (dict(rank=0), "rank"), (dict(rank=4, target_modules=("lm_head",)), "target_modules"),
    (dict(rank=4, dropout=1.0), "dropout"), (dict(rank=4, alpha=0.0), "alpha")])
def test_bad_config_is_named(bad, match):
    with pytest.raises(ValueError, match=f"LoRAConfig.{match}"):
        L.LoRAConfig(**bad)


def test_adapters_shard_with_the_base_on_a_mesh(base, devices):
    graphdef, params = base
    mesh = make_mesh("dp2,tp2,sp2")
    lcfg = L.LoRAConfig(rank=4)
    shard = L.adapter_shardings(CFG, lcfg, mesh)
    base_sh = F.param_shardings(CFG, mesh)
    pad = lambda spec, n: tuple(spec) + (None,) * (n - len(tuple(spec)))  # noqa: E731
    for name, (module, n_in) in L.TARGETS.items():
        w = pad(base_sh["layers"][module][name].spec, 4)  # [L, *in, *out]
        a = pad(shard["layers"][module][name]["a"].spec, 2 + n_in)  # [L, *in, r]
        b = pad(shard["layers"][module][name]["b"].spec, 5 - n_in)  # [L, r, *out]
        assert a[:1 + n_in] == w[:1 + n_in] and a[-1] is None, name
        assert b[2:] == w[1 + n_in:] and b[1] is None, name
    # q_proj's B is split over heads and down_proj's A over the MLP hidden dim, like their base weights
    assert shard["layers"]["attn"]["q_proj"]["b"].spec[2] == "tp" and shard["layers"]["mlp"]["down_proj"]["a"].spec[1] == "tp"
    ad = L.init_adapters(CFG, lcfg, seed=5, mesh=mesh)
    chex.assert_trees_all_equal(jax.device_get(ad), jax.device_get(L.init_adapters(CFG, lcfg, seed=5)))
    assert all(x.sharding == s for x, s in zip(jax.tree.leaves(ad), jax.tree.leaves(shard)))


def test_modules_to_save_config_is_validated(tmp_path):
    from rljax.config import ConfigError, resolve
    from rljax.preflight import check_inputs

    assert L.LoRAConfig(rank=2, modules_to_save=("embed_tokens", "lm_head")).modules_to_save == ("lm_head", "embed_tokens")
    with pytest.raises(ValueError, match="LoRAConfig.modules_to_save is .*accepted: a set of lm_head, embed_tokens"):
        L.LoRAConfig(rank=2, modules_to_save=("q_proj",))
    with pytest.raises(ConfigError, match="actor.lora.modules_to_save.*accepted.*lm_head.*embed_tokens"):
        resolve("default", ["actor.lora.rank=4", "actor.lora.modules_to_save=[norm]"])
    with pytest.raises(ConfigError, match=r"modules_to_save=\[lm_head\] is set, but actor.lora.rank=0 turns LoRA off"):
        resolve("default", ["actor.lora.modules_to_save=[lm_head]"])
    cfg, _ = resolve("default", ["actor.lora.rank=4", "actor.lora.modules_to_save=[lm_head]", "model.tie_embeddings=true"])
    with pytest.raises(ConfigError, match="needs untied embeddings, but model.name=tiny"):
        check_inputs(cfg)
    check_inputs(resolve("default", ["actor.lora.rank=4", "actor.lora.modules_to_save=[lm_head,embed_tokens]"])[0])
    with pytest.raises(ValueError, match="needs untied embeddings"):
        L.abstract_adapters(CFG.replace(tie_embeddings=True), L.LoRAConfig(rank=2, modules_to_save=("embed_tokens",)))


def test_modules_to_save_cli_error_is_one_line_exit_2(tmp_path, capsys):
    from rljax.launch import main

    assert main(["--run-dir", str(tmp_path / "run"), "actor.lora.rank=4", "actor.lora.modules_to_save=[q_proj]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "actor.lora.modules_to_save" in err[0] and "lm_head" in err[0], err
    assert not (tmp_path / "run").exists()


# --------------------------------------------------------------------------- the update


def _step(lora_params, batch, *, mesh=None, lr=1e-2):
    opt = make_optimizer(lr=lr, grad_clip=1.0)
    cfg = StepConfig(ppo_mini_batch_size=8, ppo_micro_batch_size=4, logprob_impl="chunked")
    batch = dict(batch, old_logp=_logp(lora_params, batch)[0])
    state = init_state(jax.tree.map(jnp.copy, lora_params), opt)  # the step donates its state
    return make_train_step(F.abstract_params(CFG)[0], opt, cfg, mesh=mesh)(state, batch, jax.random.key(0)), batch


def test_only_adapters_train_and_the_base_stays_bfloat16(base):
    graphdef, params = base
    base_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    p = L.LoRAParams(base=base_bf16, adapters=L.init_adapters(CFG, LCFG, seed=1), config=LCFG)
    batch = _batch(8, seed=4)
    (state, metrics), batch = _step(p, batch)
    # optimizer state: AdamW moments of the adapters only
    n_adapter = sum(x.size for x in jax.tree.leaves(p.adapters))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * n_adapter
    assert all(x.dtype == jnp.float32 for x in moments + jax.tree.leaves(state.params.adapters))
    # the frozen base is untouched, still bfloat16; B moved off zero
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.params.base))
    chex.assert_trees_all_equal(state.params.base, base_bf16)
    assert float(jnp.abs(state.params.adapters["layers"]["mlp"]["up_proj"]["b"]).max()) > 0
    assert int(state.step) == 1 and np.isfinite(float(metrics["grad_norm"]))
    assert trainable(state.params) is state.params.adapters
    # and the step did what PPO asks: positive-advantage tokens became likelier
    new = _logp(state.params, batch)[0]
    assert float(jnp.sum((new - batch["old_logp"]) * batch["advantages"] * batch["loss_mask"])) > 0


SAVE_LCFG = L.LoRAConfig(rank=4, alpha=8.0, modules_to_save=("lm_head", "embed_tokens"))


def test_modules_to_save_start_as_the_base_and_merge_into_the_sampler_weights(base):
    graphdef, params = base
    p = L.LoRAParams(base=params, adapters=L.init_adapters(CFG, SAVE_LCFG, seed=1, base=params), config=SAVE_LCFG)
    chex.assert_trees_all_equal(p.adapters["modules_to_save"], {"lm_head": params["lm_head"], "embed_tokens": params["embed"]})
    batch = _batch(4, seed=6)
    np.testing.assert_array_equal(_logp(p, batch)[0], _logp(params, batch)[0])  # init: the base exactly
    moved = p.replace(adapters=dict(p.adapters, modules_to_save=jax.tree.map(
        lambda x: x + 0.05 * jax.random.normal(jax.random.key(4), x.shape), p.adapters["modules_to_save"])))
    out = _logp(moved, batch)[0]
    assert float(jnp.abs(out - _logp(params, batch)[0]).max()) > 1e-2  # the forward uses the copies
    merged = L.merge(moved)
    np.testing.assert_allclose(_logp(merged, batch)[0], out, atol=2e-5)  # the sampler's weights
    np.testing.assert_array_equal(merged["lm_head"], moved.adapters["modules_to_save"]["lm_head"])
    np.testing.assert_array_equal(_logp(L.disable(moved), batch)[0], _logp(params, batch)[0])  # the reference


@pytest.mark.slow
def test_modules_to_save_train_in_full_beside_the_adapters(base):
    graphdef, params = base
    p = L.LoRAParams(base=params, adapters=L.init_adapters(CFG, SAVE_LCFG, seed=1, base=params), config=SAVE_LCFG)
    (state, _), batch = _step(p, _batch(8, seed=6))
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in moments) == 2 * sum(x.size for x in jax.tree.leaves(p.adapters))  # the copies' too
    new = state.params.adapters["modules_to_save"]
    assert float(jnp.abs(new["lm_head"] - params["lm_head"]).max()) > 0
    assert float(jnp.abs(new["embed_tokens"] - params["embed"]).max()) > 0
    chex.assert_trees_all_equal(state.params.base, params)  # the frozen base's own modules stay
    new_lp = _logp(state.params, batch)[0]
    assert float(jnp.sum((new_lp - batch["old_logp"]) * batch["advantages"] * batch["loss_mask"])) > 0


@pytest.mark.slow
def test_lora_update_is_mesh_invariant(base, devices):
    graphdef, params = base
    p = _adapted(params, scale=0.01)
    batch = _batch(8, seed=5)
    (ref, _), _ = _step(p, batch)
    mesh = make_mesh("dp2,tp2,sp2")
    sharded = L.LoRAParams(base=jax.device_put(params, F.param_shardings(CFG, mesh)),
                           adapters=jax.device_put(p.adapters, L.adapter_shardings(CFG, LCFG, mesh)), config=LCFG)
    (out, _), _ = _step(sharded, batch, mesh=mesh)
    chex.assert_trees_all_close(jax.device_get(out.params.adapters), jax.device_get(ref.params.adapters),
                                rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- sampler


def test_merged_sampler_logprobs_equal_the_learners(base):
    graphdef, params = base
    p = _adapted(params, scale=0.1)
    engine = RljaxEngine(CFG, num_slots=8, max_prefill_length=8, max_decode_length=8)
    sampler = Sampler(engine, params, version=0)
    sampler.update_weights(jax.jit(L.merge)(p), 1)  # the learner's sync: merged on device
    prompts = [[5, 9, 11], [17, 4, 99, 3, 2], [7]]
    traj = sampler.generate(prompts, uids=["a", "b", "c"], n=3, decode=DecodeParams(max_new_tokens=8, seed=1))
    ids, mask = traj.sequences()
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "attention_mask": jnp.asarray(mask),
             "positions": F.default_positions(jnp.asarray(mask))}
    learner = np.asarray(make_logprob_fn(graphdef, response_len=traj.response_ids.shape[1], temperature=1.0,
                                         impl="naive")(p, batch)[0])
    base_lp = np.asarray(make_logprob_fn(graphdef, response_len=traj.response_ids.shape[1], temperature=1.0,
                                         impl="naive")(params, batch)[0])
    m = traj.response_mask
    np.testing.assert_allclose(traj.rollout_logp[m], learner[m], atol=1e-4, rtol=0)
    assert np.abs(traj.rollout_logp[m] - base_lp[m]).max() > 1e-2  # the sampler did not decode the base


# --------------------------------------------------------------------------- checkpoints


def test_adapter_only_checkpoint_resumes_and_refuses_another_base(base, tmp_path):
    graphdef, params = base
    p = _adapted(params)
    opt = make_optimizer(lr=1e-3)
    state = init_state(p, opt)
    ckpt = Checkpointer(str(tmp_path / "ckpt"), async_save=False)
    saved = state.replace(params=state.params.adapters)  # what the trainer writes: no base
    sig = L.base_signature(params, name="tiny seed 0")
    ckpt.save(3, {"actor": saved}, {"lora": {"base": sig}})
    like = init_state(L.LoRAParams(base=params, adapters=L.init_adapters(CFG, LCFG, seed=9), config=LCFG), opt)
    restored, meta = ckpt.restore(3, {"actor": like.replace(params=like.params.adapters)})
    chex.assert_trees_all_equal(restored["actor"].params, p.adapters)
    stored = sum(x.nbytes for x in jax.tree.leaves(restored))
    assert jax.tree.structure(restored["actor"].params) == jax.tree.structure(p.adapters)
    assert stored < sum(x.nbytes for x in jax.tree.leaves(params)) / 2  # adapters + their moments, no base
    L.check_base(meta["lora"]["base"], L.base_signature(params, name="tiny seed 0"))
    # the same base on another mesh passes; another base is refused with both names
    mesh = make_mesh("dp2,tp4")
    L.check_base(meta["lora"]["base"], L.base_signature(jax.device_put(params, F.param_shardings(CFG, mesh)), name="x"))
    other = F.init_params(CFG, seed=1)[1]
    with pytest.raises(ValueError, match="trained on base 'tiny seed 0', this run's base is 'tiny seed 1'.*other values"):
        L.check_base(meta["lora"]["base"], L.base_signature(other, name="tiny seed 1"))
    with pytest.raises(ValueError, match="bfloat16"):
        L.check_base(meta["lora"]["base"], L.base_signature(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), name="b"))
    ckpt.close()


# --------------------------------------------------------------------------- the run


@pytest.mark.slow
def test_lora_run_resumes_from_adapters_and_refuses_another_base(tmp_path):
    from rljax.launch import main

    run = ["--mesh=dp8", "--run-dir", str(tmp_path / "run"), "actor.lora.rank=4", "actor.use_kl_loss=true",
           "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=4", "trainer.save_freq=1",
           "trainer.test_freq=-1", "trainer.val_before_train=false"]
    assert main(run + ["trainer.total_steps=2"]) == 0
    assert main(run + ["--resume", "trainer.total_steps=3"]) == 0
    # another base (the preset initialised from another seed), another rank, no LoRA: refused
    for other in ("trainer.seed=1", "actor.lora.rank=8", "actor.lora.rank=0", "actor.lora.modules_to_save=[lm_head]"):
        assert main(run + ["--resume", "trainer.total_steps=4", other]) != 0, other
    import json

    lines = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
    assert [x["step"] for x in lines if "actor/kl_loss" in x] == [1, 2, 3]
    assert max(x["timing_s/update_weights"] for x in lines if "timing_s/update_weights" in x) > 0
