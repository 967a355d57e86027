"""Hugging Face parity: tiny random Llama / Qwen2 / Qwen3 / Mistral built with transformers, loaded by rljax."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.hf
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rljax import models  # noqa: E402
from rljax import sharding as sh  # noqa: E402

_logits = jax.jit(
    lambda gd, p, t, m, pos: models.compute_logits(p, models.forward(gd, p, t, mask=m, positions=pos)),
    static_argnums=0,
)


def _randomise(model, seed):
    """Random norms and biases too, so a swapped or missing tensor cannot go unnoticed."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.ndim == 1 and p.shape[0] == model.config.hidden_size else 0.0))
    return model


def _llama(tmp_path, **kw):
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rope_theta=50000.0, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16),
        tie_word_embeddings=False, **kw,
    )
    return _save(_randomise(transformers.LlamaForCausalLM(cfg), 0), tmp_path / "llama")


def _qwen2(tmp_path, **kw):
    cfg = transformers.Qwen2Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, rope_theta=1000000.0, max_position_embeddings=128, rms_norm_eps=1e-6,
        tie_word_embeddings=True, **kw,
    )
    return _save(_randomise(transformers.Qwen2ForCausalLM(cfg), 1), tmp_path / "qwen2")


def _qwen3(tmp_path, **kw):
    """Qwen3 (dense): QK-norm, no QKV bias, head_dim apart from hidden_size / heads, untied."""
    cfg = transformers.Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=1000000.0, max_position_embeddings=128, rms_norm_eps=1e-6,
        tie_word_embeddings=False, **kw,
    )
    return _save(_randomise(transformers.Qwen3ForCausalLM(cfg), 2), tmp_path / "qwen3")


def _mistral(tmp_path, **kw):
    """Mistral with a sliding window longer than every test sequence (exact there)."""
    cfg = transformers.MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, rope_theta=1000000.0, max_position_embeddings=128, rms_norm_eps=1e-5,
        sliding_window=64, tie_word_embeddings=False, **kw,
    )
    return _save(_randomise(transformers.MistralForCausalLM(cfg), 3), tmp_path / "mistral")


def _gemma3(tmp_path, **kw):
    """Gemma 3 (text): offset norms, sandwich norms, scaled embeddings, GeGLU, QK-norm, a query scale
    apart from head_dim, and sliding-window layers (every other one here) with their own rotary base."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=16, sliding_window=64, max_position_embeddings=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
        rms_norm_eps=1e-6, tie_word_embeddings=True, **kw,
    )
    return _save(_randomise(transformers.Gemma3ForCausalLM(cfg), 4), tmp_path / "gemma3")


def _save(model, path, **kw):
    model.eval()
    model.save_pretrained(str(path), safe_serialization=True, **kw)
    return model, str(path)


def _batch(vocab, seed=0):
    rng = np.random.default_rng(seed)
    b, t = 4, 12
    toks = rng.integers(0, vocab, (b, t)).astype(np.int32)
    lengths = np.array([12, 7, 10, 3])
    mask = np.arange(t)[None, :] >= (t - lengths)[:, None]  # left-padded prompts
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0).astype(np.int32)
    return toks, mask, pos


def _hf_logits(model, toks, mask, pos):
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(toks, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
            position_ids=torch.tensor(pos, dtype=torch.long),
        )
    return out.logits.float().numpy()


def _ours(path, mesh=None, dtype=None):
    config, params = models.load_hf_checkpoint(path, mesh=mesh, dtype=dtype)
    return config, params, models.abstract_params(config)[0]


def _max_diff_on_real_tokens(a, b, mask):
    return float(np.max(np.abs(np.asarray(a) - np.asarray(b))[mask]))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    return {"llama": _llama(tmp), "qwen2": _qwen2(tmp), "qwen3": _qwen3(tmp), "mistral": _mistral(tmp),
            "gemma3": _gemma3(tmp)}


ARCHS = ["llama", "qwen2", "qwen3", "mistral", "gemma3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_load_matches_transformers(arch, checkpoints):
    hf_model, path = checkpoints[arch]
    config, params, graphdef = _ours(path)
    assert config.architecture == arch
    assert config.tie_embeddings == (arch in ("qwen2", "gemma3")) and config.qkv_bias == (arch == "qwen2")
    assert config.qk_norm == (arch in ("qwen3", "gemma3"))
    assert config.sliding_window == (64 if arch in ("mistral", "gemma3") else None)
    if arch == "llama":
        assert config.rope_scaling_dict["rope_type"] == "llama3"
    toks, mask, pos = _batch(config.vocab_size)
    ours = _logits(graphdef, params, toks, mask, pos)
    ref = _hf_logits(hf_model, toks, mask, pos)
    assert _max_diff_on_real_tokens(ours, ref, mask) <= 1e-4


@pytest.mark.parametrize("arch, spec", [("llama", "dp2,tp2,sp2"), ("qwen2", "tp4,dp2"), ("llama", "tp2,sp4"),
                                        ("qwen3", "dp2,tp2,sp2"), ("gemma3", "dp2,tp2,sp2")])
def test_load_onto_mesh_matches_transformers(arch, spec, checkpoints, devices):
    hf_model, path = checkpoints[arch]
    mesh = sh.make_mesh(spec)
    config, params, graphdef = _ours(path, mesh=mesh)
    expect = models.param_shardings(config, mesh)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expect)):
        assert got.sharding == want
    q = params["layers"]["attn"]["q_proj"]  # [L, H, N, D]
    assert q.addressable_shards[0].data.shape[2] == config.num_heads // mesh.shape["tp"]
    toks, mask, pos = _batch(config.vocab_size, seed=1)
    fwd = jax.jit(lambda p, t, m, pos: models.compute_logits(p, models.forward(graphdef, p, t, mask=m, positions=pos, mesh=mesh)))
    ours = fwd(params, toks, mask, pos)
    ref = _hf_logits(hf_model, toks, mask, pos)
    assert _max_diff_on_real_tokens(ours, ref, mask) <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_save_roundtrip_reloads_in_transformers(arch, checkpoints, tmp_path):
    hf_model, path = checkpoints[arch]
    config, params, graphdef = _ours(path)
    out = str(tmp_path / "export")
    models.save_hf_checkpoint(out, config, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(reloaded).__name__ == type(hf_model).__name__
    toks, mask, pos = _batch(config.vocab_size, seed=2)
    ref = _hf_logits(hf_model, toks, mask, pos)
    np.testing.assert_allclose(_hf_logits(reloaded, toks, mask, pos)[mask], ref[mask], rtol=0, atol=1e-5)
    # and back into rljax: the same config and bit-identical parameters
    config2, params2, _ = _ours(out)
    assert config2 == config
    jax.tree.map(np.testing.assert_array_equal, params2, params)


def test_sharded_checkpoint_with_index(tmp_path, checkpoints):
    hf_model, path = checkpoints["llama"]
    config, params, graphdef = _ours(path)
    out = str(tmp_path / "sharded")
    models.save_hf_checkpoint(out, config, params, max_shard_bytes=40_000)
    files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
    assert len(files) > 1
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"].values()) == set(files)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    toks, mask, pos = _batch(config.vocab_size, seed=3)
    np.testing.assert_allclose(_hf_logits(reloaded, toks, mask, pos)[mask], _hf_logits(hf_model, toks, mask, pos)[mask], atol=1e-5)
    # transformers' own sharded layout loads too
    _, hf_sharded = _save(hf_model, tmp_path / "hf_sharded", max_shard_size="20KB")
    assert os.path.exists(os.path.join(hf_sharded, "model.safetensors.index.json"))
    _, params3, _ = _ours(hf_sharded)
    jax.tree.map(np.testing.assert_array_equal, params3, params)


def test_bfloat16_checkpoint(tmp_path, checkpoints):
    hf_model, _ = checkpoints["qwen2"]
    _, path = _save(hf_model.to(torch.bfloat16), tmp_path / "bf16")
    hf_model.to(torch.float32)
    with open(os.path.join(path, "config.json")) as f:
        stored = json.load(f)
    assert "bfloat16" in (stored.get("torch_dtype"), stored.get("dtype"))
    config, params, graphdef = _ours(path)
    assert config.param_dtype == "bfloat16" and all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    config32, params32, _ = _ours(path, dtype="float32")
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params32))
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a.astype(jnp.float32), b), params, params32)
    toks, mask, pos = _batch(config.vocab_size, seed=4)
    ours = _logits(graphdef, params, toks, mask, pos)
    ref = _hf_logits(hf_model.to(torch.bfloat16), toks, mask, pos)
    hf_model.to(torch.float32)
    assert _max_diff_on_real_tokens(ours, ref, mask) <= 0.1 * float(np.abs(ref).max())
    # bfloat16 export: transformers reads back the same bits
    out = str(tmp_path / "bf16_export")
    models.save_hf_checkpoint(out, config, params)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert reloaded.dtype == torch.bfloat16
    for name, tensor in hf_model.to(torch.bfloat16).state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    hf_model.to(torch.float32)


def test_unsupported_architecture(tmp_path):
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    _, path = _save(transformers.GPT2LMHeadModel(cfg), tmp_path / "gpt2")
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"):
        models.load_hf_checkpoint(path)


def test_missing_tensor_is_named(tmp_path, checkpoints):
    from rljax.models.safetensors_io import read_safetensors, write_safetensors

    _, path = checkpoints["llama"]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(open(os.path.join(path, "config.json")).read())
    tensors = {k: np.array(v) for k, v in read_safetensors(os.path.join(path, "model.safetensors")).items()}
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_safetensors(str(broken / "model.safetensors"), tensors)
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\) for LlamaForCausalLM: model.layers.1.mlp.up_proj.weight"):
        models.load_hf_checkpoint(str(broken))
    tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    write_safetensors(str(broken / "model.safetensors"), tensors)
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight has shape"):
        models.load_hf_checkpoint(str(broken))
    with pytest.raises(ValueError, match="config.json is missing"):
        models.load_hf_checkpoint(str(tmp_path))


def test_unsupported_options_are_named():
    base = dict(architectures=["Qwen2ForCausalLM"], vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="use_sliding_window"):
        models.config_from_hf(base | {"use_sliding_window": True})
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        models.config_from_hf(base | {"hidden_act": "gelu"})
    with pytest.raises(ValueError, match="rope_scaling type 'yarn'"):
        models.config_from_hf(base | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_safetensors_io_is_readable_by_the_safetensors_package(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    import ml_dtypes

    from rljax.models.safetensors_io import read_safetensors, write_safetensors

    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1.5, -2.0], ml_dtypes.bfloat16), "c": np.arange(3, dtype=np.int64)}
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, arrays)
    loaded = st.load_file(path)
    np.testing.assert_array_equal(loaded["a"].numpy(), arrays["a"])
    np.testing.assert_array_equal(loaded["b"].float().numpy(), arrays["b"].astype(np.float32))
    back = read_safetensors(path)
    assert back["b"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back["c"], arrays["c"])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decode_matches_transformers_generate(arch, checkpoints):
    hf_model, path = checkpoints[arch]
    config, params, graphdef = _ours(path)
    prompt = np.array([[5, 17, 42, 3, 88]], np.int64)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor(prompt), max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 5:].tolist()
    cache = models.init_kv_cache(config, 1, 16)
    hidden, kv = models.prefill(graphdef, params, jnp.asarray(prompt, jnp.int32))
    cache = models.insert_kv(cache, kv, jnp.array([0]))
    tok = int(jnp.argmax(models.compute_logits(params, hidden[0, -1])))
    out, length = [tok], 5
    step = jax.jit(lambda c, t, i: models.decode(graphdef, params, c, t, cache_index=i))
    for _ in range(5):
        h, cache = step(cache, jnp.array([tok], jnp.int32), jnp.array([length], jnp.int32))
        tok = int(jnp.argmax(models.compute_logits(params, h[0])))
        out.append(tok)
        length += 1
    assert out == ref


def test_sequence_longer_than_the_sliding_window_is_refused(checkpoints):
    """Mistral's window is exact only while a sequence fits it; a longer one is a ValueError, not other numbers."""
    _, path = checkpoints["mistral"]
    config, params, graphdef = _ours(path)
    toks = np.zeros((1, config.sliding_window + 1), np.int32)
    with pytest.raises(ValueError, match="65 tokens is longer than the model's sliding_window=64"):
        models.forward(graphdef, params, toks)
    with pytest.raises(ValueError, match="KV cache of 80 tokens"):
        models.decode(graphdef, params, models.init_kv_cache(config, 1, 80), jnp.array([1], jnp.int32),
                      cache_index=jnp.array([0], jnp.int32))
