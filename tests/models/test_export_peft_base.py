"""A PEFT export names a base that loads from anywhere (issue 38): ``model.path`` made absolute
(written as typed before, a relative path sent a load elsewhere to the Hub), and a preset's base
exported beside the adapter (``null`` before)."""

import dataclasses
import json

import jax
import pytest

from rljax import models
from rljax.config import resolve, to_dict
from rljax.export import main
from rljax.models import lora as L
from rljax.trainer.checkpoint import Checkpointer

from hf_tiny import tokenizer_dir

pytestmark = pytest.mark.hf


def _lora_run(run, cfg, config, base):
    lc = cfg.actor.lora
    lcfg = L.LoRAConfig(rank=lc.rank, alpha=lc.alpha, target_modules=tuple(lc.target_modules))
    ad = L.init_adapters(config, lcfg, seed=0, base=base)
    name = cfg.model.path or f"{cfg.model.name}@{cfg.trainer.seed}"
    ck = Checkpointer(str(run / "checkpoints"), async_save=False, echo=lambda s: None)
    ck.save(2, {"actor": {"params": ad}}, {"step": 2, "version": 2, "data": {}, "config": to_dict(cfg),
                                           "lora": {"base": L.base_signature(base, name=name),
                                                    **dataclasses.asdict(lcfg)}})
    ck.close()


@pytest.mark.slow  # checkpoints and exports a LoRA run: ~9 s
def test_relative_model_path_is_written_absolute(tmp_path, monkeypatch):
    base_dir = tokenizer_dir(tmp_path / "qwen2")  # a checkpoint written by rljax: no torch needed
    config = models.get_config("tiny", vocab_size=320, num_layers=1, tie_embeddings=True,
                               eos_token_id=0, pad_token_id=0)
    models.save_hf_checkpoint(str(base_dir), config, models.init_params(config, seed=3)[1])
    monkeypatch.chdir(tmp_path)
    cfg = resolve(None, ["model.path=qwen2", "data.max_prompt_length=8", "data.max_response_length=8",
                         "actor.lora.rank=4"], validate=False)[0]
    config, base = models.load_hf_checkpoint(str(base_dir))
    _lora_run(tmp_path / "run", cfg, config, base)
    assert main(["run", "--to", "peft", "peft"]) == 0
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert written == str(base_dir) and written.startswith("/")


@pytest.mark.slow  # rebuilds, checkpoints and exports a preset: ~9 s
def test_a_presets_base_is_exported_beside_the_adapter(tmp_path):
    from rljax.trainer.build import policy_params, tokenizer_for
    from rljax.sharding import make_mesh

    cfg = resolve(None, ["actor.lora.rank=4"], validate=False)[0]
    mesh = make_mesh("dp1", devices=jax.devices()[:1])
    config, _, params, _ = policy_params(cfg, mesh, tokenizer_for(cfg))
    _lora_run(tmp_path / "run", cfg, config, params.base)
    out = tmp_path / "peft"
    assert main([str(tmp_path / "run"), "--to", "peft", str(out)]) == 0
    written = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert written == str(out / "base")
    reloaded, base = models.load_hf_checkpoint(written)
    assert reloaded.num_layers == config.num_layers
    jax.tree.map(lambda a, b: (a == b).all() or pytest.fail("the exported base differs"), base, params.base)
