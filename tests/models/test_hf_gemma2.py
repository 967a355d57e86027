"""Gemma 2 parity with transformers, as tests/models/test_hf.py proves Gemma 3's: a tiny random
Gemma2ForCausalLM (offset norms before and after attention and the MLP, embeddings scaled by
sqrt(hidden), GeGLU, query_pre_attn_scalar apart from head_dim, tied embeddings, sliding-window
layers every other one) gives the same logits and greedy tokens in rljax, and its export reloads in
transformers. Here soft-capping is off; tests/models/test_hf_gemma2_softcap.py proves the capped model
(attention scores and output logits, as every real Gemma 2 checkpoint sets them)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.hf
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import _batch, _hf_logits, _logits, _max_diff_on_real_tokens, _ours, _randomise, _save  # noqa: E402

from rljax import models  # noqa: E402
from rljax import sharding as sh  # noqa: E402


def _gemma2(tmp_path, **kw):
    cfg = transformers.Gemma2Config(**{
        **dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=16, sliding_window=64,
               max_position_embeddings=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               rms_norm_eps=1e-6, tie_word_embeddings=True,
               attn_logit_softcapping=None, final_logit_softcapping=None),  # capped: test_hf_gemma2_softcap.py
        **kw})
    return _save(_randomise(transformers.Gemma2ForCausalLM(cfg), 5), tmp_path / "gemma2")


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    return _gemma2(tmp_path_factory.mktemp("hf"))


def test_gemma2_loads_as_transformers_computes(gemma2):
    hf_model, path = gemma2
    config, params, graphdef = _ours(path)
    assert config.architecture == "gemma2" and config.tie_embeddings and not config.qk_norm
    assert (config.norm_offset, config.sandwich_norm, config.embed_scale, config.query_scale) == (1.0, True, True, 16)
    assert config.local_layers == (True, False, True) and config.sliding_window == 64
    assert config.rope_local_theta == config.rope_theta == 10000.0
    toks, mask, pos = _batch(config.vocab_size)
    ours = _logits(graphdef, params, toks, mask, pos)
    assert _max_diff_on_real_tokens(ours, _hf_logits(hf_model, toks, mask, pos), mask) <= 1e-4


def test_gemma2_on_a_mesh(gemma2, devices):
    hf_model, path = gemma2
    mesh = sh.make_mesh("dp2,tp2,sp2")
    config, params, graphdef = _ours(path, mesh=mesh)
    toks, mask, pos = _batch(config.vocab_size, seed=1)
    fwd = jax.jit(lambda p, t, m, pos: models.compute_logits(p, models.forward(graphdef, p, t, mask=m, positions=pos,
                                                                               mesh=mesh)))
    assert _max_diff_on_real_tokens(fwd(params, toks, mask, pos), _hf_logits(hf_model, toks, mask, pos), mask) <= 1e-4


def test_gemma2_greedy_decode_matches_generate(gemma2):
    hf_model, path = gemma2
    config, params, graphdef = _ours(path)
    prompt = np.array([[5, 17, 42, 3, 88]], np.int64)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    hidden, kv = models.prefill(graphdef, params, jnp.asarray(prompt, jnp.int32))
    cache = models.insert_kv(models.init_kv_cache(config, 1, 16), kv, jnp.array([0]))
    tok = int(jnp.argmax(models.compute_logits(params, hidden[0, -1])))
    out, length = [tok], 5
    step = jax.jit(lambda c, t, i: models.decode(graphdef, params, c, t, cache_index=i))
    for _ in range(5):
        h, cache = step(cache, jnp.array([tok], jnp.int32), jnp.array([length], jnp.int32))
        tok = int(jnp.argmax(models.compute_logits(params, h[0])))
        out.append(tok)
        length += 1
    assert out == ref


def test_gemma2_export_reloads_in_transformers(gemma2, tmp_path):
    hf_model, path = gemma2
    config, params, _ = _ours(path)
    out = str(tmp_path / "export")
    models.save_hf_checkpoint(out, config, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(reloaded).__name__ == "Gemma2ForCausalLM"
    assert reloaded.config.layer_types == hf_model.config.layer_types
    toks, mask, pos = _batch(config.vocab_size, seed=2)
    np.testing.assert_allclose(_hf_logits(reloaded, toks, mask, pos)[mask], _hf_logits(hf_model, toks, mask, pos)[mask],
                               rtol=0, atol=1e-5)
    config2, params2, _ = _ours(out)
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, params)
