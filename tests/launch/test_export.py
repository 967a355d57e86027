"""python -m rljax.export (issue 25, friction 2): a run's checkpoint as a transformers
directory, a PEFT adapter or a LoRA-merged model, with the run's logits; bad input exits 2 in
one line and writes nothing."""

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

pytestmark = pytest.mark.hf
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from rljax import models  # noqa: E402
from rljax.config import resolve, to_dict  # noqa: E402
from rljax.export import main  # noqa: E402
from rljax.models import lora as L  # noqa: E402
from rljax.trainer.checkpoint import DIGEST_FILE, Checkpointer  # noqa: E402

from hf_tiny import qwen2_dir  # noqa: E402

TOKS = np.random.default_rng(0).integers(0, 300, (3, 10)).astype(np.int32)
MASK = np.arange(10)[None] >= np.array([0, 3, 6])[:, None]  # left padding


def _hf_logits(model):
    pos = np.maximum(np.cumsum(MASK, -1) - 1, 0)
    with torch.no_grad():
        out = model(input_ids=torch.tensor(TOKS, dtype=torch.long), attention_mask=torch.tensor(MASK, dtype=torch.long),
                    position_ids=torch.tensor(pos, dtype=torch.long))
    return out.logits.float().numpy()[MASK]


def _ours(config, params, base):
    graphdef = models.abstract_params(config)[0]
    return np.asarray(models.compute_logits(base, models.forward(graphdef, params, TOKS, mask=MASK)))[MASK]


def _save(run, cfg, step, actor_params, lora=None):
    ck = Checkpointer(str(run / "checkpoints"), async_save=False, echo=lambda s: None)
    meta = {"step": step, "version": step, "data": {}, "config": to_dict(cfg)}
    if lora is not None:
        meta["lora"] = lora
    ck.save(step, {"actor": {"params": actor_params}}, meta)
    ck.close()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return qwen2_dir(tmp_path_factory.mktemp("base") / "qwen2", max_position_embeddings=64)


def _cfg(base, *over):
    return resolve(None, [f"model.path={base}", "data.max_prompt_length=8", "data.max_response_length=8", *over],
                   validate=False)[0]


@pytest.fixture(scope="module")
def full_run(base_dir, tmp_path_factory):
    """A full run's checkpoint: the base's parameters moved by training (here: noise)."""
    config, base = models.load_hf_checkpoint(str(base_dir))
    trained = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(1), x.shape, x.dtype), base)
    run = tmp_path_factory.mktemp("full") / "run"
    _save(run, _cfg(base_dir), 4, trained)
    return run, config, trained


@pytest.fixture(scope="module")
def lora_run(base_dir, tmp_path_factory):
    cfg = _cfg(base_dir, "actor.lora.rank=4", "actor.lora.alpha=8")
    config, base = models.load_hf_checkpoint(str(base_dir))
    lc = cfg.actor.lora
    lcfg = L.LoRAConfig(rank=lc.rank, alpha=lc.alpha, target_modules=tuple(lc.target_modules), dropout=lc.dropout,
                        modules_to_save=tuple(lc.modules_to_save))
    ad = L.init_adapters(config, lcfg, seed=0, base=base)
    ad = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape, x.dtype), ad)  # B != 0
    run = tmp_path_factory.mktemp("lora") / "run"
    _save(run, cfg, 6, ad, lora={"base": L.base_signature(base, name=str(base_dir)), **dataclasses.asdict(lcfg)})
    return run, config, L.LoRAParams(base=base, adapters=ad, config=lcfg), base


@pytest.mark.slow  # a transformers load per export: ~20 s each here
def test_full_run_to_hf_loads_in_transformers_with_the_runs_logits(full_run, base_dir, tmp_path, capsys):
    run, config, trained = full_run
    out = tmp_path / "hf"
    assert main([str(run), "--to", "hf", str(out)]) == 0
    assert "exported checkpoint 4" in capsys.readouterr().out
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    np.testing.assert_allclose(_hf_logits(hf), _ours(config, trained, trained), atol=1e-4)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))  # the run's tokenizer, chat template included
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False).startswith("<|im_start|>")


@pytest.mark.slow  # a transformers load per export: ~20 s each here
def test_lora_run_to_peft_and_merged_with_the_runs_logits(lora_run, base_dir, tmp_path):
    run, config, params, base = lora_run
    ours = _ours(config, params, base)
    assert np.abs(ours - _ours(config, base, base)).max() > 1e-2  # the adapters change the logits
    assert main([str(run), "--to", "peft", str(tmp_path / "peft")]) == 0
    assert json.load(open(tmp_path / "peft" / "adapter_config.json"))["base_model_name_or_path"] == str(base_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).eval()
    np.testing.assert_allclose(_hf_logits(peft.PeftModel.from_pretrained(hf, str(tmp_path / "peft")).eval()), ours,
                               atol=1e-4)
    for to in ("merged", "hf"):
        assert main([str(run), "--to", to, str(tmp_path / to)]) == 0
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / to), dtype=torch.float32).eval()
        np.testing.assert_allclose(_hf_logits(merged), ours, atol=1e-4)


def _one_line_exit_2(capsys, argv, message, out):
    assert main(argv) == 2
    err = [l for l in capsys.readouterr().err.splitlines() if l.strip()]
    assert len(err) == 1 and err[0].startswith("python -m rljax.export: error: ") and message in err[0], err
    assert not os.path.exists(out) or not os.listdir(out)


def test_bad_input_exits_2_in_one_line_and_writes_nothing(full_run, lora_run, base_dir, tmp_path, capsys):
    run, _, _ = full_run
    out = str(tmp_path / "out")
    _one_line_exit_2(capsys, [str(tmp_path / "none"), "--to", "hf", out], "does not exist", out)
    _one_line_exit_2(capsys, [str(tmp_path), "--to", "hf", out], "has no checkpoints/ directory", out)
    _one_line_exit_2(capsys, [str(run), "--step", "9", "--to", "hf", out], "--step=9: no checkpoint 9", out)
    _one_line_exit_2(capsys, [str(run), "--to", "peft", out], "holds every parameter (actor.lora.rank=0)", out)
    _one_line_exit_2(capsys, [str(run), "--to", "merged", out], "no LoRA adapters to merge", out)
    os.makedirs(tmp_path / "busy")
    (tmp_path / "busy" / "x").write_text("keep")
    _one_line_exit_2(capsys, [str(run), "--to", "hf", str(tmp_path / "busy")], "is not an empty directory",
                     str(tmp_path / "nothing"))
    assert (tmp_path / "busy" / "x").read_text() == "keep"
    # a damaged checkpoint: one of its files changed after its digest was written
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    files = [os.path.join(r, f) for r, _, fs in os.walk(damaged / "checkpoints" / "4" / "state") for f in fs
             if os.path.getsize(os.path.join(r, f)) > 64]
    with open(files[0], "r+b") as fh:
        fh.write(b"\0" * 16)
    _one_line_exit_2(capsys, [str(damaged), "--to", "hf", out], "checkpoint 4 is damaged", out)
    # an unverified checkpoint (no digest: the run stopped before verifying it) is refused as a
    # resume refuses it, unless --unverified
    undigested = tmp_path / "undigested"
    shutil.copytree(run, undigested)
    os.remove(undigested / "checkpoints" / "4" / DIGEST_FILE)
    _one_line_exit_2(capsys, [str(undigested), "--to", "hf", out], "checkpoint 4 has no digest", out)
    assert main([str(undigested), "--to", "hf", "--unverified", out]) == 0
    assert "exporting it unverified" in capsys.readouterr().out and os.path.isfile(os.path.join(out, "config.json"))


@pytest.mark.slow  # a transformers load per export: ~20 s each here
def test_lora_run_whose_base_is_gone_or_changed(lora_run, base_dir, tmp_path, capsys):
    run, *_ = lora_run
    out = str(tmp_path / "out")
    moved = str(base_dir) + ".moved"
    os.rename(base_dir, moved)
    try:
        _one_line_exit_2(capsys, [str(run), "--to", "peft", out], "which does not exist here", out)
        qwen2_dir(base_dir, max_position_embeddings=64, seed=7)  # another base at the same path
        capsys.readouterr()  # transformers' progress bars
        _one_line_exit_2(capsys, [str(run), "--to", "peft", out], "does not fit this base model", out)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
        os.rename(moved, base_dir)
