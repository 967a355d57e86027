"""Gemma 2's soft-capping, proven equal to transformers: ``cap * tanh(x / cap)`` of the attention scores
(``attn_logit_softcapping``) and of the output logits (``final_logit_softcapping``).

A tiny random Gemma2ForCausalLM with both caps set gives, in rljax, the same logits (dense and blockwise
attention, and on a dp2,tp2,sp2 mesh: sequence-parallel attention), the same greedy tokens and rollout
log-probs through the sampler (cached decode), an export that transformers reloads as an equal model, and
the learner's fused log-probs equal to ``log_softmax`` of transformers' capped logits. The caps here (1 and
2) are far below a real checkpoint's (50 and 30) so that every tanh bends its input: each check fails when
one cap is dropped (a real model's scores and logits rarely reach the bend). The attention kernels, the
fused log-prob / top-k / log-prob-at paths and their custom backward passes are checked against the
capped dense reference; the Pallas log-prob kernels refuse a cap in one line.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.hf
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import _batch, _hf_logits, _max_diff_on_real_tokens, _ours, _randomise, _save  # noqa: E402

from rljax import models  # noqa: E402
from rljax import pallas  # noqa: E402
from rljax import sharding as sh  # noqa: E402
from rljax.models.attention import (block_sparse_attention, blockwise_attention, dense_attention,  # noqa: E402
                                    live_decode_attention, slot_cache_attention)

ATTN_CAP, FINAL_CAP = 1.0, 2.0


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    cfg = transformers.Gemma2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=16, sliding_window=64, max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6, tie_word_embeddings=True,
        attn_logit_softcapping=ATTN_CAP, final_logit_softcapping=FINAL_CAP)
    return _save(_randomise(transformers.Gemma2ForCausalLM(cfg), 5), tmp_path_factory.mktemp("hf") / "gemma2")


def _capped_logits(graphdef, params, toks, mask, pos, mesh=None):
    hidden = models.forward(graphdef, params, toks, mask=mask, positions=pos, mesh=mesh)
    return models.compute_logits(params, hidden, softcap=models.logit_softcap(graphdef))


def test_capped_gemma2_logits_match_transformers(gemma2):
    hf_model, path = gemma2
    config, params, graphdef = _ours(path)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)
    toks, mask, pos = _batch(config.vocab_size)
    ref = _hf_logits(hf_model, toks, mask, pos)
    assert _max_diff_on_real_tokens(_capped_logits(graphdef, params, toks, mask, pos), ref, mask) <= 1e-4
    blockwise = models.abstract_params(config.replace(attn_block_size=4))[0]  # 12 keys in blocks of 4: _flash
    assert _max_diff_on_real_tokens(_capped_logits(blockwise, params, toks, mask, pos), ref, mask) <= 1e-4
    # the caps bend these numbers: without either one the logits are far off
    uncapped = models.compute_logits(params, models.forward(graphdef, params, toks, mask=mask, positions=pos))
    assert _max_diff_on_real_tokens(uncapped, ref, mask) > 0.5
    no_attn_cap = models.abstract_params(config.replace(attn_logit_softcapping=None))[0]
    assert _max_diff_on_real_tokens(_capped_logits(no_attn_cap, params, toks, mask, pos), ref, mask) > 0.1


def test_capped_gemma2_sequence_parallel_on_a_mesh(gemma2, devices):
    hf_model, path = gemma2
    mesh = sh.make_mesh("dp2,tp2,sp2")
    config, params, graphdef = _ours(path, mesh=mesh)
    toks, mask, pos = _batch(config.vocab_size, seed=1)
    fwd = jax.jit(lambda p, t, m, q: _capped_logits(graphdef, p, t, m, q, mesh=mesh))
    assert _max_diff_on_real_tokens(fwd(params, toks, mask, pos), _hf_logits(hf_model, toks, mask, pos), mask) <= 1e-4


def test_capped_gemma2_sampler_matches_generate(gemma2):
    """Greedy tokens (attention caps in prefill and cached decode) and the log-probs the sampler records
    (the capped logits: greedy argmax alone cannot see the final cap) equal transformers'."""
    from rljax.rollout import DecodeParams, RljaxEngine, Sampler

    hf_model, path = gemma2
    config, params, _ = _ours(path)
    prompts, steps = [[5, 17, 42, 3, 88], [9, 1, 60]], 6
    eng = RljaxEngine(config, num_slots=2, max_prefill_length=8, max_decode_length=steps)
    traj = Sampler(eng, params).generate(prompts, uids=["a", "b"],
                                         decode=DecodeParams(temperature=0.0, max_new_tokens=steps, eos_ids=()))
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0,
                                    output_logits=True, return_dict_in_generate=True)
        ref = out.sequences[0, len(prompt):].tolist()
        assert traj.response_ids[row, :steps].tolist() == ref
        ref_logp = [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(out.logits, ref)]
        np.testing.assert_allclose(traj.rollout_logp[row, :steps], ref_logp, rtol=0, atol=1e-4)


def test_capped_gemma2_export_reloads_in_transformers(gemma2, tmp_path):
    hf_model, path = gemma2
    config, params, _ = _ours(path)
    out = str(tmp_path / "export")
    models.save_hf_checkpoint(out, config, params)
    written = json.loads(open(f"{out}/config.json").read())
    assert (written["attn_logit_softcapping"], written["final_logit_softcapping"]) == (ATTN_CAP, FINAL_CAP)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert (reloaded.config.attn_logit_softcapping, reloaded.config.final_logit_softcapping) == (ATTN_CAP, FINAL_CAP)
    toks, mask, pos = _batch(config.vocab_size, seed=2)
    np.testing.assert_allclose(_hf_logits(reloaded, toks, mask, pos)[mask], _hf_logits(hf_model, toks, mask, pos)[mask],
                               rtol=0, atol=1e-5)
    assert _ours(out)[0] == config


def test_capped_gemma2_learner_logprobs_match_transformers(gemma2):
    """The learner's fused log-probs (padded batch; with ``at_ids`` the log-probs at given ids too), at a
    temperature: ``log_softmax(capped logits / T)`` of transformers."""
    from rljax.trainer.heads import response_logprobs

    hf_model, path = gemma2
    config, params, graphdef = _ours(path)
    toks, mask, pos = _batch(config.vocab_size, seed=3)
    resp, temp = 5, 0.7
    at_ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (toks.shape[0], resp, 3)), jnp.int32)
    batch = {"input_ids": jnp.asarray(toks), "attention_mask": jnp.asarray(mask), "positions": jnp.asarray(pos)}
    logp, entropy, logp_at = response_logprobs(graphdef, params, batch, response_len=resp, temperature=temp,
                                               at_ids=at_ids)
    ref = torch.log_softmax(torch.tensor(_hf_logits(hf_model, toks, mask, pos)) / temp, -1).numpy()
    ref = ref[:, -resp - 1:-1]  # position S - 1 + t predicts response token t
    targets = toks[:, -resp:]
    np.testing.assert_allclose(logp, np.take_along_axis(ref, targets[..., None], -1)[..., 0], rtol=0, atol=1e-4)
    np.testing.assert_allclose(entropy, -(np.exp(ref) * ref).sum(-1), rtol=0, atol=1e-4)
    np.testing.assert_allclose(logp_at, np.take_along_axis(ref, np.asarray(at_ids), -1), rtol=0, atol=1e-4)


# --------------------------------------------------------------------------- the kernels against the reference


def _capped_reference(q, k, v, mask, cap):
    """Attention with the scores capped, then masked, written out: ``[B,Tq,N,D]``."""
    b, tq, n, d = q.shape
    kk, vv = (jnp.repeat(x, n // x.shape[2], axis=2) for x in (k, v))
    s = jnp.einsum("btnd,bsnd->bnts", q, kk) / np.sqrt(d)
    s = jnp.where(mask[:, None], cap * jnp.tanh(s / cap), -1e30)
    return jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(s, -1), vv)


def test_every_attention_path_caps_its_scores():
    rng = np.random.default_rng(0)
    b, t, n, kh, d, cap = 2, 10, 4, 2, 8, 0.5
    q, k, v = (jnp.asarray(rng.normal(size=(b, t, h, d)) * 2, jnp.float32) for h in (n, kh, kh))
    idx = jnp.broadcast_to(jnp.arange(t), (b, t))
    valid = jnp.asarray(np.arange(t)[None, :] >= np.array([[0], [3]]))  # row 1 left-padded
    mask = (idx[:, None, :] <= idx[:, :, None]) & valid[:, None, :]
    ref = _capped_reference(q, k, v, mask, cap)
    real = np.asarray(valid)
    close = lambda out: np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], rtol=0, atol=2e-5)
    close(dense_attention(q, k, v, idx, idx, valid, softcap=cap))
    close(blockwise_attention(q, k, v, idx, idx, valid, block_size=4, softcap=cap))
    seg = jnp.ones((b, t), jnp.int32)
    every_block = jnp.broadcast_to(jnp.arange(3)[None, None], (b, 3, 3)).astype(jnp.int32)  # 3 blocks of 4: all
    close(block_sparse_attention(q, k, v, idx, idx, valid, seg, seg, every_block, softcap=cap))
    # decode: query t of a full cache (row 0: no padding) sees keys 0..t
    qi = jnp.full((b, 1), t - 1, jnp.int32)
    last = ref[:1, -1:]
    cache = lambda x: x[None]  # [L=1,S,M,K,D]
    np.testing.assert_allclose(live_decode_attention(q[:1, -1:], cache(k[:1]), cache(v[:1]), 0, qi[:1], block_size=4,
                                                       softcap=cap), last, rtol=0, atol=2e-5)
    slots = lambda x: jnp.swapaxes(x[:1], 1, 2)  # [S,K,M,D]
    np.testing.assert_allclose(slot_cache_attention(q[:1, -1:], slots(k), slots(v), qi[:1], block_size=4, softcap=cap),
                               last, rtol=0, atol=2e-5)
    # the blockwise custom backward (the cap's 1 - tanh^2) equals autodiff of the dense reference
    loss = lambda fn: lambda q, k, v: jnp.sum(jnp.where(valid[..., None, None], fn(q, k, v), 0.0) ** 2)
    want = jax.grad(loss(lambda q, k, v: dense_attention(q, k, v, idx, idx, valid, softcap=cap)), (0, 1, 2))(q, k, v)
    got = jax.grad(loss(lambda q, k, v: blockwise_attention(q, k, v, idx, idx, valid, block_size=4, softcap=cap)),
                   (0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-5)


def test_fused_logprob_paths_cap_the_logits():
    """chunked (tiles smaller than the problem), naive, top-k and log-prob-at, forward and backward, against
    ``log_softmax(cap * tanh(h @ w / cap) / T)`` and its autodiff."""
    rng = np.random.default_rng(1)
    n, h, v, cap, temp = 12, 16, 40, 1.5, 0.8
    hid = jnp.asarray(rng.normal(size=(n, h)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(h, v)), jnp.float32)
    y = jnp.asarray(rng.integers(0, v, n), jnp.int32)

    def ref_all(hid, w):
        return jax.nn.log_softmax(cap * jnp.tanh(hid @ w / cap) / temp, -1)

    def ref(hid, w):
        lp = ref_all(hid, w)
        return jnp.take_along_axis(lp, y[:, None], -1)[:, 0], -(jnp.exp(lp) * lp).sum(-1)

    def objective(fn):
        def f(hid, w):
            logp, entropy = fn(hid, w)
            return jnp.sum(logp * 1.3 + entropy * 0.7)
        return f

    want, want_grads = ref(hid, w), jax.grad(objective(ref), (0, 1))(hid, w)
    for impl, blocks in (("chunked", dict(block_t=5, block_v=16)), ("naive", {})):
        fn = lambda hid, w: pallas.fused_logprob(hid, w, y, temperature=temp, impl=impl, softcap=cap, **blocks)  # noqa: B023
        for got, exp in zip(fn(hid, w), want):
            np.testing.assert_allclose(got, exp, rtol=0, atol=1e-5)
        for got, exp in zip(jax.grad(objective(fn), (0, 1))(hid, w), want_grads):
            np.testing.assert_allclose(got, exp, rtol=1e-4, atol=1e-5)
    ids, logp = pallas.fused_topk_logprob(hid, w, 4, temperature=temp, block_t=5, block_v=16, softcap=cap)
    top = jax.lax.top_k(ref_all(hid, w), 4)
    np.testing.assert_array_equal(ids, top[1])
    np.testing.assert_allclose(logp, top[0], rtol=0, atol=1e-5)
    at = jnp.asarray(rng.integers(0, v, (n, 3)), jnp.int32)
    at_fn = lambda hid, w: pallas.fused_logprob_at(hid, w, at, temperature=temp, block_t=5, block_v=16, softcap=cap)
    at_ref = lambda hid, w: jnp.take_along_axis(ref_all(hid, w), at, -1)
    np.testing.assert_allclose(at_fn(hid, w), at_ref(hid, w), rtol=0, atol=1e-5)
    for got, exp in zip(jax.grad(lambda a, b: jnp.sum(at_fn(a, b) ** 2), (0, 1))(hid, w),
                        jax.grad(lambda a, b: jnp.sum(at_ref(a, b) ** 2), (0, 1))(hid, w)):
        np.testing.assert_allclose(got, exp, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl", ["pallas", "pallas_tpu", "pallas_gpu"])
def test_pallas_logprob_kernels_refuse_a_cap_in_one_line(impl):
    hid, w, y = jnp.ones((4, 8)), jnp.ones((8, 128)), jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match=r"^fused_logprob: softcap=30.0 \(final-logit soft-capping, Gemma 2\) is not "
                                         r"implemented in the Pallas kernels \(impl='pallas(_tpu|_gpu)?'\); accepted "
                                         r"with impl='chunked', 'naive' or 'auto' \(which then runs chunked\)$"):
        pallas.fused_logprob(hid, w, y, impl=impl, softcap=30.0)


def test_bad_caps_are_refused_in_one_line(gemma2, tmp_path):
    _, path = gemma2
    cfg = json.loads(open(f"{path}/config.json").read())
    with pytest.raises(ValueError, match=r"^unsupported config.json: Gemma 2 attn_logit_softcapping=-1.0; accepted: "
                                         r"null or a positive number$"):
        models.config_from_hf(cfg | {"attn_logit_softcapping": -1.0})
    with pytest.raises(ValueError, match=r"^ModelConfig.final_logit_softcapping=30.0 needs architecture 'gemma2' or "
                                         r"'gemma3' \(whose config.json carries it\), not 'qwen2'$"):
        models.get_config("tiny", final_logit_softcapping=30.0)
    with pytest.raises(ValueError, match=r"^fused_logprob: softcap=0; accepted: None or a concrete finite number > 0$"):
        pallas.fused_logprob(jnp.ones((2, 4)), jnp.ones((4, 8)), jnp.zeros((2,), jnp.int32), softcap=0)
    # a real Gemma 2 config.json (50, 30) passes the launcher's preflight, unless its log-probs would go to
    # the Pallas kernels (exit 2 before anything is written)
    from rljax.config import ConfigError, resolve
    from rljax.preflight import check_architecture

    d = tmp_path / "real_caps"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg | {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}))
    check_architecture(resolve(None, [f"model.path={d}"], validate=False)[0])
    with pytest.raises(ConfigError, match=r"^actor.logprob_impl=pallas: model.path's final_logit_softcapping=30.0 "
                                          r"\(config.json\) is not implemented in the Pallas log-prob kernels; accepted: "
                                          r"actor.logprob_impl=auto \(runs chunked for this model\), chunked or naive$"):
        check_architecture(resolve(None, [f"model.path={d}", "actor.logprob_impl=pallas"], validate=False)[0])
    # and as a distillation teacher (its log-probs take the actor's impl)
    from rljax.trainer import check

    (d / "model.safetensors").write_bytes(b"")  # the preflight only looks for the file
    teacher = ["distillation.enabled=true", f"distillation.teacher_model.model_path={d}"]
    with pytest.raises(ConfigError, match="has a vocabulary of 96 tokens"):  # the cap passes; the next check speaks
        check(resolve("default", teacher)[0])
    with pytest.raises(ConfigError, match=r"^actor.logprob_impl=pallas: distillation.teacher_model.model_path=.* has "
                                          r"final_logit_softcapping=30.0 \(config.json\), which the Pallas log-prob "
                                          r"kernels do not implement; accepted: actor.logprob_impl=auto"):
        check(resolve("default", [*teacher, "actor.logprob_impl=pallas"])[0])
    assert models.config_from_hf(cfg | {"attn_logit_softcapping": 50, "final_logit_softcapping": 30}
                                 ).final_logit_softcapping == 30.0
