"""Hugging Face PEFT export / import of LoRA adapters (no torch or peft needed here).

:func:`save_peft_adapter` writes ``adapter_config.json`` + ``adapter_model.safetensors``
that ``peft.PeftModel.from_pretrained(base_model, path)`` loads onto the transformers base
(``LlamaForCausalLM`` / ``Qwen2ForCausalLM``) with the same logits as rljax. The merged
model is :func:`rljax.models.save_hf_checkpoint` of :func:`rljax.models.lora.merge`.

Layout: PEFT's ``lora_A.weight`` is ``[r, in]`` and ``lora_B.weight`` ``[out, r]`` over the
HF ``nn.Linear`` (``W_hf`` is ``[out, in]``, ``ΔW_hf = scale · B_hf A_hf``); ours are
``A [L, *I, r]`` and ``B [L, r, *O]`` with ``ΔW = scale · A B`` in our ``[*I, *O]``
layout, whose flattened ``I`` / ``O`` are HF's ``in`` / ``out`` (heads-major, as in
:mod:`rljax.models.hf`). So ``A_hf = A[i].reshape(-1, r).T`` and ``B_hf = B[i].reshape(r, -1).T``.

``modules_to_save`` (``lm_head``, ``embed_tokens``) are stored whole, under the names PEFT
(0.21) writes for them: ``base_model.model.lm_head.weight`` (``[V, H]``, our ``lm_head.T``)
and ``base_model.model.model.embed_tokens.weight`` (``[V, H]``, our ``embed``).
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
from jax.sharding import Mesh

from rljax.models.config import ModelConfig
from rljax.sharding import host_array
from rljax.models.lora import (ALL_LINEAR, SAVE_MODULES, TARGETS, LoRAConfig, LoRAParams, abstract_adapters,
                               adapter_shardings)
from rljax.models.safetensors_io import read_safetensors, write_safetensors

_HF_MODULE = {"attn": "self_attn", "mlp": "mlp"}
_CONFIG = "adapter_config.json"
_WEIGHTS = "adapter_model.safetensors"
#: modules_to_save: PEFT's tensor name and whether ours is its transpose.
_SAVED = {"lm_head": ("base_model.model.lm_head.weight", True),
          "embed_tokens": ("base_model.model.model.embed_tokens.weight", False)}


def _name(layer: int, target: str, ab: str) -> str:
    module = _HF_MODULE[TARGETS[target][0]]
    return f"base_model.model.model.layers.{layer}.{module}.{target}.lora_{ab.upper()}.weight"


def save_peft_adapter(path: str, params: LoRAParams, *, base_model_name_or_path: str | None = None) -> None:
    """Writes ``params``' adapters as a PEFT LoRA adapter directory (multi-host: process 0 writes).

    Tensors keep the adapters' dtype. ``base_model_name_or_path`` goes into the config
    (what ``AutoPeftModelForCausalLM`` would load as the base).
    """
    if not isinstance(params, LoRAParams):
        raise ValueError(f"save_peft_adapter takes LoRAParams, got {type(params).__name__}")
    lcfg = params.config
    tensors: dict[str, np.ndarray] = {}
    for target in lcfg.target_modules:
        module = TARGETS[target][0]
        ad = params.adapters["layers"][module][target]
        a, b = host_array(ad["a"]), host_array(ad["b"])
        for i in range(a.shape[0]):
            tensors[_name(i, target, "a")] = np.ascontiguousarray(a[i].reshape(-1, lcfg.rank).T)
            tensors[_name(i, target, "b")] = np.ascontiguousarray(b[i].reshape(lcfg.rank, -1).T)
    for module in lcfg.modules_to_save:
        name, transposed = _SAVED[module]
        value = host_array(params.adapters["modules_to_save"][module])
        tensors[name] = np.ascontiguousarray(value.T if transposed else value)
    if jax.process_index() != 0:
        return
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lcfg.rank, "lora_alpha": lcfg.alpha,
        "lora_dropout": lcfg.dropout, "target_modules": list(lcfg.target_modules), "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": list(lcfg.modules_to_save) or None, "base_model_name_or_path": base_model_name_or_path,
    }
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, _CONFIG), "w") as f:
        json.dump(config, f, indent=2)
    write_safetensors(os.path.join(path, _WEIGHTS), tensors)


def load_peft_adapter(path: str, model_config: ModelConfig, *, mesh: Mesh | None = None, dtype=np.float32
                      ) -> tuple[LoRAConfig, dict]:
    """``(LoRAConfig, adapters)`` from a PEFT LoRA directory written by PEFT or :func:`save_peft_adapter`.

    Accepts plain LoRA (no rsLoRA, DoRA, bias or rank / alpha patterns) on every layer of the
    projections in :data:`rljax.models.lora.TARGETS`, with ``modules_to_save`` among
    :data:`rljax.models.lora.SAVE_MODULES` (a model with untied embeddings).
    """
    cfg_path = os.path.join(path, _CONFIG)
    if not os.path.exists(cfg_path):
        raise ValueError(f"{path} is not a PEFT adapter directory: {_CONFIG} is missing")
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type is {cfg.get('peft_type')!r}; accepted: 'LORA'")
    unsupported = {"use_rslora": bool(cfg.get("use_rslora")), "use_dora": bool(cfg.get("use_dora")),
                   "bias": cfg.get("bias", "none") != "none",
                   "rank_pattern": bool(cfg.get("rank_pattern")), "alpha_pattern": bool(cfg.get("alpha_pattern")),
                   "layers_to_transform": cfg.get("layers_to_transform") is not None}
    for key, bad in unsupported.items():
        if bad:
            raise ValueError(f"{cfg_path}: {key}={cfg[key]!r} is not supported (plain LoRA on every layer only)")
    targets = cfg["target_modules"]
    targets = ALL_LINEAR if targets == "all-linear" else ([targets] if isinstance(targets, str) else list(targets))
    saved = [str(m).rsplit(".", 1)[-1] for m in cfg.get("modules_to_save") or ()]
    if any(m not in SAVE_MODULES for m in saved):
        raise ValueError(f"{cfg_path}: modules_to_save={cfg['modules_to_save']!r} is not supported; "
                         f"accepted: {', '.join(SAVE_MODULES)}")
    lcfg = LoRAConfig(rank=int(cfg["r"]), alpha=float(cfg["lora_alpha"]), target_modules=tuple(targets),
                      dropout=float(cfg.get("lora_dropout") or 0.0), modules_to_save=tuple(saved))
    tensors = read_safetensors(os.path.join(path, _WEIGHTS))
    shapes = abstract_adapters(model_config, lcfg, dtype=dtype)
    shardings = adapter_shardings(model_config, lcfg, mesh, dtype=dtype) if mesh is not None else None
    adapters: dict = {}
    for target in lcfg.target_modules:
        module = TARGETS[target][0]
        entry = {}
        for ab in ("a", "b"):
            shape = shapes["layers"][module][target][ab].shape
            layers = []
            for i in range(model_config.num_layers):
                name = _name(i, target, ab)
                if name not in tensors:
                    raise ValueError(f"{path}: adapter tensor {name} is missing")
                hf = np.asarray(tensors[name], dtype)
                layers.append(hf.T.reshape(shape[1:]))
            value = np.stack(layers)
            sharding = None if shardings is None else shardings["layers"][module][target][ab]
            entry[ab] = jax.device_put(value, sharding)
        adapters.setdefault("layers", {}).setdefault(module, {})[target] = entry
    for module in lcfg.modules_to_save:
        name, transposed = _SAVED[module]
        if name not in tensors:
            raise ValueError(f"{path}: modules_to_save tensor {name} is missing")
        value = np.asarray(tensors[name], dtype)
        sharding = None if shardings is None else shardings["modules_to_save"][module]
        adapters.setdefault("modules_to_save", {})[module] = jax.device_put(value.T if transposed else value, sharding)
    return lcfg, adapters
