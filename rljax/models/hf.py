"""Hugging Face checkpoint import/export for ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``MistralForCausalLM``, ``Gemma2ForCausalLM`` (with its soft-capping of the
attention scores and output logits) and ``Gemma3ForCausalLM`` (:data:`rljax.hf_config.SUPPORTED_ARCHITECTURES`).

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or several
``*.safetensors`` listed in ``model.safetensors.index.json``. Tensors are memory-mapped and
each device reads only its own shard (``jax.make_array_from_callback``), so loading onto a
mesh never builds a full copy of the model per device. Needs neither torch nor the
``safetensors`` package (see :mod:`rljax.models.safetensors_io`).

Layout differences from HF (``nn.Linear`` stores ``[out, in]``): our projections are
``[in, ...out]`` with heads split out, e.g. ``q_proj`` is ``[H, N, D]``, ``o_proj``
``[N, D, H]``, ``lm_head`` ``[H, V]``, and per-layer tensors are stacked on a leading
``[L]`` axis (``params["layers"]["attn"]["q_proj"]`` is ``[L, H, N, D]``). Rotary embedding uses the same rotate-half
convention as HF, so no permutation of q/k is needed.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding

from rljax.hf_config import SUPPORTED_ARCHITECTURES, model_fields
from rljax.models.config import ModelConfig
from rljax.models.functional import abstract_params, param_shardings
from rljax.models.safetensors_io import read_safetensors, write_safetensors
from rljax.sharding import host_array

_ARCH_NAMES = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}


# --------------------------------------------------------------------------- config


def config_from_hf(cfg: dict, *, dtype=None) -> ModelConfig:
    """A :class:`ModelConfig` from a parsed HF ``config.json`` dict (:func:`rljax.hf_config.model_fields`:
    a ValueError names an unsupported architecture or option)."""
    return ModelConfig(**model_fields(cfg, dtype=dtype))


def config_to_hf(config: ModelConfig) -> dict:
    """The HF ``config.json`` dict for ``config``."""
    out = {
        "architectures": [_ARCH_NAMES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling_dict,
        # transformers >= 5 reads rope_parameters; older releases rope_theta / rope_scaling.
        "rope_parameters": {"rope_theta": config.rope_theta, "rope_type": "default", **(config.rope_scaling_dict or {})},
        "tie_word_embeddings": config.tie_embeddings,
        "torch_dtype": config.param_dtype,
        "dtype": config.param_dtype,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if config.architecture in ("gemma2", "gemma3"):
        out.update(_gemma_json(config))
    elif config.architecture == "llama":
        out.update(attention_bias=config.qkv_bias, mlp_bias=False, pretraining_tp=1)
    elif config.architecture == "mistral":
        out.update(sliding_window=config.sliding_window)
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers)
        if config.architecture == "qwen3":
            out.update(attention_bias=False, layer_types=["full_attention"] * config.num_layers)
    return out


def _gemma_json(config: ModelConfig) -> dict:
    """Gemma 2's and 3's own ``config.json`` fields, in transformers 5's form and 4's (both read them),
    with the model's soft-capping values (null: none)."""
    types = ["sliding_attention" if local else "full_attention" for local in config.local_layers]
    full = {"rope_type": "default", "rope_theta": config.rope_theta, **(config.rope_scaling_dict or {})}
    out = {"hidden_activation": "gelu_pytorch_tanh", "hidden_act": "gelu_pytorch_tanh",
           "query_pre_attn_scalar": config.query_scale, "sliding_window": config.sliding_window,
           "layer_types": types, "attention_bias": False, "attn_logit_softcapping": config.attn_logit_softcapping,
           "final_logit_softcapping": config.final_logit_softcapping, "use_bidirectional_attention": False}
    if config.architecture == "gemma2":
        return {**out, "model_type": "gemma2", "rope_parameters": full}
    return {**out, "model_type": "gemma3_text", "rope_local_base_freq": config.rope_local_theta,
            "rope_parameters": {"full_attention": full, "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": config.rope_local_theta}}}


# --------------------------------------------------------------------------- tensor map

# (hf name, our path, layer index or None, hf -> ours, ours -> hf); conversions are numpy
# views/reshapes of one tensor. Layer tensors are stacked on a leading axis in our tree.
_Entry = tuple[str, tuple, "int | None", Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], np.ndarray]]


def tensor_map(config: ModelConfig) -> list[_Entry]:
    """Every HF tensor name with its place in our params tree and the layout conversions."""
    n, k, d, h = config.num_heads, config.num_kv_heads, config.head_dim, config.hidden_size
    ident = lambda w: w
    tr = lambda w: w.T

    def qkv(heads):
        return (lambda w: w.reshape(heads, d, h).transpose(2, 0, 1), lambda x: x.transpose(1, 2, 0).reshape(heads * d, h))

    def bias(heads):
        return (lambda w: w.reshape(heads, d), lambda x: x.reshape(heads * d))

    o = (lambda w: w.reshape(h, n, d).transpose(1, 2, 0), lambda x: x.transpose(2, 0, 1).reshape(h, n * d))
    entries: list[_Entry] = [("model.embed_tokens.weight", ("embed",), None, ident, ident)]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        entries += [
            (p + "input_layernorm.weight", ("layers", "attn_norm", "scale"), i, ident, ident),
            (p + "self_attn.q_proj.weight", ("layers", "attn", "q_proj"), i, *qkv(n)),
            (p + "self_attn.k_proj.weight", ("layers", "attn", "k_proj"), i, *qkv(k)),
            (p + "self_attn.v_proj.weight", ("layers", "attn", "v_proj"), i, *qkv(k)),
            (p + "self_attn.o_proj.weight", ("layers", "attn", "o_proj"), i, *o),
            *([(p + "post_attention_layernorm.weight", ("layers", "post_attn_norm", "scale"), i, ident, ident),
               (p + "pre_feedforward_layernorm.weight", ("layers", "mlp_norm", "scale"), i, ident, ident),
               (p + "post_feedforward_layernorm.weight", ("layers", "post_mlp_norm", "scale"), i, ident, ident)]
              if config.sandwich_norm else
              [(p + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), i, ident, ident)]),
            *([(p + "self_attn.q_norm.weight", ("layers", "attn", "q_norm", "scale"), i, ident, ident),
               (p + "self_attn.k_norm.weight", ("layers", "attn", "k_norm", "scale"), i, ident, ident)]
              if config.qk_norm else []),
            (p + "mlp.gate_proj.weight", ("layers", "mlp", "gate_proj"), i, tr, tr),
            (p + "mlp.up_proj.weight", ("layers", "mlp", "up_proj"), i, tr, tr),
            (p + "mlp.down_proj.weight", ("layers", "mlp", "down_proj"), i, tr, tr),
        ]
        if config.qkv_bias:
            entries += [
                (p + "self_attn.q_proj.bias", ("layers", "attn", "q_bias"), i, *bias(n)),
                (p + "self_attn.k_proj.bias", ("layers", "attn", "k_bias"), i, *bias(k)),
                (p + "self_attn.v_proj.bias", ("layers", "attn", "v_bias"), i, *bias(k)),
            ]
    entries.append(("model.norm.weight", ("final_norm", "scale"), None, ident, ident))
    if not config.tie_embeddings:
        entries.append(("lm_head.weight", ("lm_head",), None, tr, tr))
    return entries


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


# --------------------------------------------------------------------------- load / save


def open_tensors(path: str) -> dict[str, np.ndarray]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(path, name) for name in files]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise ValueError(f"{index} lists shard files that are missing: {', '.join(os.path.basename(m) for m in missing)}")
    else:
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {path} (expected model.safetensors or a sharded set with model.safetensors.index.json)")
    tensors: dict[str, np.ndarray] = {}
    for file in files:
        tensors.update(read_safetensors(file))
    return tensors


def load_hf_checkpoint(path: str, *, dtype=None, mesh: Mesh | None = None, rules=None) -> tuple[ModelConfig, dict]:
    """Reads a local HF Llama/Qwen2/Qwen3/Mistral/Gemma 2/Gemma 3 checkpoint into ``(ModelConfig, params)``.

    Args:
      path: a directory with ``config.json`` and the safetensors weights.
      dtype: ``"float32"`` / ``"bfloat16"`` (or a jnp dtype) for parameters and compute;
        default the checkpoint's ``torch_dtype`` (float16 checkpoints load as float32).
      mesh: place every tensor directly in its sharded layout on this mesh (each device
        reads only its shard); default one device, ``jax.devices()[0]``.

    Returns:
      ``(config, params)``; ``params`` is the pure dict of :func:`rljax.models.split`.
      The graphdef is ``rljax.models.abstract_params(config)[0]``.

    Raises:
      ValueError: an unsupported architecture or option, a missing or misshaped tensor.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise ValueError(f"{path} is not a Hugging Face checkpoint directory: config.json is missing")
    with open(cfg_path) as f:
        config = config_from_hf(json.load(f), dtype=dtype)
    return config, load_params(path, config, open_tensors(path), mesh=mesh, rules=rules)


def load_params(path: str, config: ModelConfig, tensors: dict, *, mesh: Mesh | None = None, rules=None) -> dict:
    """The transformer's params tree of ``config`` from a checkpoint's ``tensors`` (name -> array,
    memory-mapped), each placed in its sharded layout on ``mesh`` (default one device);
    ``path`` names the checkpoint in errors. Tensors outside :func:`tensor_map` are ignored."""
    entries = tensor_map(config)
    missing = [e[0] for e in entries if e[0] not in tensors]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint {path} is missing {len(missing)} tensor(s) for {_ARCH_NAMES[config.architecture]}: {shown}")
    if config.architecture == "llama" and config.qkv_bias:
        # HF Llama's attention_bias also gives o_proj a bias, which this model lacks.
        for i in range(config.num_layers):
            name = f"model.layers.{i}.self_attn.o_proj.bias"
            if name in tensors and np.any(np.asarray(tensors[name], np.float32) != 0):
                raise ValueError(f"unsupported checkpoint: {name} is non-zero (Llama attention_bias with an o_proj bias)")
    _, shapes = abstract_params(config)
    shardings = param_shardings(config, mesh, rules=rules) if mesh is not None else None
    single = SingleDeviceSharding(jax.devices()[0])
    target = np.dtype(config.jnp_param_dtype)
    views: dict[tuple, list] = {}
    for name, ours, layer, to_ours, _ in entries:
        view = to_ours(tensors[name])
        expect = _get(shapes, ours).shape[(0 if layer is None else 1):]
        if tuple(view.shape) != tuple(expect):
            hf_shape = tuple(tensors[name].shape)
            raise ValueError(f"tensor {name} has shape {hf_shape}, which does not match config.json (expected {expect} after layout change)")
        views.setdefault(ours, []).append(view)
    params: dict = {}
    for ours, parts in views.items():
        shape = tuple(_get(shapes, ours).shape)
        sharding = _get(shardings, ours) if shardings is not None else single
        if ours[0] == "layers":
            # each device reads its slice of each layer's tensor, stacked on the layer axis
            def read(idx, parts=parts):
                layers = range(len(parts))[idx[0]]
                return np.stack([np.ascontiguousarray(parts[i][idx[1:]]).astype(target, copy=False) for i in layers])
        else:
            def read(idx, view=parts[0]):
                return np.ascontiguousarray(view[idx]).astype(target, copy=False)
        _set(params, ours, jax.make_array_from_callback(shape, sharding, read))
    return params


def save_hf_checkpoint(path: str, config: ModelConfig, params: dict, *, max_shard_bytes: int = 5 * 1024**3) -> None:
    """Writes ``config.json`` and safetensors weights that ``transformers`` (and vLLM, SGLang) load.

    Tensors keep their parameter dtype. Checkpoints above ``max_shard_bytes`` are split
    into ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``.
    Multi-host: every process must call it; process 0 writes.
    """
    write_checkpoint(path, config_to_hf(config), hf_tensors(config, params), max_shard_bytes=max_shard_bytes)


def hf_tensors(config: ModelConfig, params: dict) -> dict[str, np.ndarray]:
    """HF tensor name -> host array (HF layout) of the transformer's ``params``. Multi-host:
    every process must call it (the parameters are gathered)."""
    entries = tensor_map(config)
    host: dict[str, np.ndarray] = {}
    gathered: dict[tuple, np.ndarray] = {}
    for name, ours, layer, _, to_hf in entries:
        if ours not in gathered:
            try:
                gathered[ours] = host_array(_get(params, ours))
            except (KeyError, IndexError, TypeError):
                raise ValueError(f"params has no entry {'/'.join(map(str, ours))} needed for {name}") from None
        value = gathered[ours] if layer is None else gathered[ours][layer]
        host[name] = np.ascontiguousarray(to_hf(value))
    if config.architecture == "llama" and config.qkv_bias:
        # HF Llama's attention_bias also gives o_proj a bias; ours is zero.
        for i in range(config.num_layers):
            host[f"model.layers.{i}.self_attn.o_proj.bias"] = np.zeros((config.hidden_size,), host["model.norm.weight"].dtype)
    return host


def write_checkpoint(path: str, config_json: dict, host: dict[str, np.ndarray], *,
                     max_shard_bytes: int = 5 * 1024**3) -> None:
    """Writes ``config.json`` and the safetensors shards of ``host`` (process 0 only)."""
    if jax.process_index() != 0:
        return
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_json, f, indent=2)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in host.items():
        if shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    for old in glob.glob(os.path.join(path, "*.safetensors")) + glob.glob(os.path.join(path, "model.safetensors.index.json")):
        os.remove(old)
    if len(shards) == 1:
        write_safetensors(os.path.join(path, "model.safetensors"), shards[0])
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(os.path.join(path, fname), shard)
        weight_map.update({name: fname for name in shard})
    total = sum(a.nbytes for a in host.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
