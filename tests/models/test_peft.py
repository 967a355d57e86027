"""PEFT export: transformers + peft load rljax's LoRA adapters with rljax's logits; merged export."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytestmark = pytest.mark.hf
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from rljax import models  # noqa: E402
from rljax.models import lora as L  # noqa: E402
from rljax.models.peft import load_peft_adapter, save_peft_adapter  # noqa: E402


def _qwen2(path, tie=True):
    cfg = transformers.Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _hf_logits(model, toks, mask):
    pos = np.maximum(np.cumsum(mask, -1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(toks, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                    position_ids=torch.tensor(pos, dtype=torch.long))
    return out.logits.float().numpy()


def test_peft_loads_rljax_adapters_with_equal_logits(tmp_path):
    base_path = _qwen2(tmp_path / "base")
    config, base = models.load_hf_checkpoint(base_path)
    graphdef = models.abstract_params(config)[0]
    lcfg = L.LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"))
    ad = L.init_adapters(config, lcfg, seed=1)
    ad = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape), ad)  # B != 0
    params = L.LoRAParams(base=base, adapters=ad, config=lcfg)
    out = str(tmp_path / "adapter")
    save_peft_adapter(out, params, base_model_name_or_path=base_path)
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert json.load(open(os.path.join(out, "adapter_config.json")))["r"] == 4

    rng = np.random.default_rng(0)
    toks = rng.integers(0, 96, (3, 10)).astype(np.int32)
    mask = np.arange(10)[None] >= np.array([0, 3, 6])[:, None]  # left padding
    ours = np.asarray(models.compute_logits(base, models.forward(graphdef, params, toks, mask=mask)))
    plain = np.asarray(models.compute_logits(base, models.forward(graphdef, base, toks, mask=mask)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    np.testing.assert_allclose(_hf_logits(hf, toks, mask)[mask], plain[mask], atol=1e-4)
    peft_model = peft.PeftModel.from_pretrained(hf, out).eval()
    theirs = _hf_logits(peft_model, toks, mask)
    assert np.abs(ours - plain)[mask].max() > 1e-2  # the adapters change the logits
    np.testing.assert_allclose(theirs[mask], ours[mask], atol=1e-4)

    # the merged full checkpoint: transformers alone gives the same logits
    merged_path = str(tmp_path / "merged")
    models.save_hf_checkpoint(merged_path, config, L.merge(params))
    merged = transformers.AutoModelForCausalLM.from_pretrained(merged_path, dtype=torch.float32).eval()
    np.testing.assert_allclose(_hf_logits(merged, toks, mask)[mask], ours[mask], atol=1e-4)

    # and back into rljax: the same adapters
    lcfg2, ad2 = load_peft_adapter(out, config)
    assert lcfg2 == lcfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ad2, ad)


def test_peft_written_adapter_loads_into_rljax(tmp_path):
    """An adapter that PEFT itself initialised and saved reads into rljax with PEFT's logits."""
    base_path = _qwen2(tmp_path / "base")
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    pcfg = peft.LoraConfig(r=2, lora_alpha=6, target_modules=["v_proj", "down_proj", "o_proj"], init_lora_weights=False)
    torch.manual_seed(3)
    pm = peft.get_peft_model(hf, pcfg).eval()
    pm.save_pretrained(str(tmp_path / "theirs"))
    config, base = models.load_hf_checkpoint(base_path)
    lcfg, ad = load_peft_adapter(str(tmp_path / "theirs"), config)
    assert lcfg.target_modules == ("v_proj", "o_proj", "down_proj") and lcfg.scale == 3.0
    toks = np.random.default_rng(1).integers(0, 96, (2, 7)).astype(np.int32)
    mask = np.ones_like(toks, bool)
    ours = models.compute_logits(base, models.forward(models.abstract_params(config)[0],
                                                      L.LoRAParams(base=base, adapters=ad, config=lcfg), toks, mask=mask))
    np.testing.assert_allclose(_hf_logits(pm, toks, mask), np.asarray(ours), atol=1e-4)


def test_modules_to_save_export_to_peft_and_back_with_equal_logits(tmp_path):
    """``modules_to_save`` (lm_head, embed_tokens) round-trip rljax -> PEFT -> rljax with PEFT's logits."""
    base_path = _qwen2(tmp_path / "base", tie=False)
    config, base = models.load_hf_checkpoint(base_path)
    graphdef = models.abstract_params(config)[0]
    lcfg = L.LoRAConfig(rank=2, alpha=4.0, target_modules=("q_proj", "down_proj"), modules_to_save=("lm_head", "embed_tokens"))
    rng = np.random.default_rng(2)
    ad = jax.tree.map(lambda x: np.asarray(x) + 0.1 * rng.standard_normal(x.shape, np.float32),  # B != 0, copies moved
                      L.init_adapters(config, lcfg, seed=1, base=base))
    params = L.LoRAParams(base=base, adapters=ad, config=lcfg)
    out = str(tmp_path / "adapter")
    save_peft_adapter(out, params, base_model_name_or_path=base_path)
    assert json.load(open(os.path.join(out, "adapter_config.json")))["modules_to_save"] == ["lm_head", "embed_tokens"]
    toks = np.random.default_rng(0).integers(0, 96, (2, 9)).astype(np.int32)
    mask = np.arange(9)[None] >= np.array([0, 4])[:, None]
    ours = np.asarray(models.compute_logits(params, models.forward(graphdef, params, toks, mask=mask)))
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    plain = _hf_logits(hf, toks, mask)
    theirs = _hf_logits(peft.PeftModel.from_pretrained(hf, out).eval(), toks, mask)
    assert np.abs(theirs - plain)[mask].max() > 1e-2  # the adapter changes the model
    np.testing.assert_allclose(theirs[mask], ours[mask], atol=1e-4)
    lcfg2, ad2 = load_peft_adapter(out, config)
    assert lcfg2 == lcfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), ad2, ad)

    # and what PEFT itself writes for modules_to_save reads into rljax with PEFT's logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["v_proj"], init_lora_weights=False,
                                                 modules_to_save=["lm_head", "embed_tokens"]))
    with torch.no_grad():
        for name, w in pm.named_parameters():
            if "modules_to_save" in name:
                w.add_(0.1 * torch.randn_like(w))
    pm.eval().save_pretrained(str(tmp_path / "theirs"))
    lcfg3, ad3 = load_peft_adapter(str(tmp_path / "theirs"), config)
    assert lcfg3.modules_to_save == ("lm_head", "embed_tokens")
    p3 = L.LoRAParams(base=base, adapters=ad3, config=lcfg3)
    mine = models.compute_logits(p3, models.forward(graphdef, p3, toks, mask=mask))
    np.testing.assert_allclose(_hf_logits(pm, toks, mask)[mask], np.asarray(mine)[mask], atol=1e-4)
