"""LoRA adapters for the policy: low-rank updates ``W + scale * A @ B`` on chosen projections.

::

    lcfg = LoRAConfig(rank=8, alpha=16.0)                     # scale = alpha / rank
    adapters = init_adapters(model_config, lcfg, seed=0, mesh=mesh)   # B = 0: equals the base
    params = LoRAParams(base=base_params, adapters=adapters, config=lcfg)
    hidden = models.forward(graphdef, params, tokens, mask=mask, mesh=mesh)   # adapted model
    hidden = models.forward(graphdef, disable(params), tokens, ...)          # the base model
    merged = merge(params)                                     # plain params for the sampler / HF

A :class:`LoRAParams` is accepted wherever the model takes ``params`` for a full forward
(``forward``, ``unembedding``, ``compute_logits``, the trainer's log-prob functions); the
KV-cached decode path takes merged weights. The trainer differentiates and optimises the
``adapters`` only (:mod:`rljax.trainer.step`), so gradients and optimizer state are the
adapters' size; the frozen ``base`` may be bfloat16 while the adapters are float32.

Layout. For a base projection ``W`` with input dims ``I`` and output dims ``O`` (ours are
``[in..., out...]``, stacked on a leading ``layers`` axis), ``A`` is ``[L, *I, r]`` and
``B`` is ``[L, r, *O]``; each takes the base weight's logical axes for its ``I`` / ``O``
dims and ``lora_rank`` (replicated) for ``r``, so the adapters shard with the base on every
mesh (``q_proj``'s ``B`` is split over heads on ``tp``, ``down_proj``'s ``A`` over the MLP
hidden dim). ``adapters["layers"]["attn"]["q_proj"] = {"a": ..., "b": ...}`` mirrors the
base tree. Initialisation follows PEFT: ``A`` uniform in ``±1/sqrt(fan_in)``, ``B = 0``.

Dropout (``LoRAConfig.dropout``) applies to the adapter input in the update pass only:
the trainer sets :attr:`LoRAParams.dropout_key`; without a key the forward is
deterministic (old / reference log-probs, validation).

Layering: the adapter types and the per-layer hook (:class:`LoRAConfig`, :class:`LoRAParams`,
:class:`LayerLoRA`) live in :mod:`rljax.models.adapters`, below the model that runs them; this
module builds adapter trees from the model's parameter shapes (:mod:`rljax.models.params`), so it
sits above the model, and re-exports those names.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rljax.models.adapters import (ALL_LINEAR, NO_LORA, SAVE_MODULES, TARGETS, LayerLoRA,  # noqa: F401
                                   LoRAConfig, LoRAParams, delta, disable, effective_base, layer_inputs)
from rljax.models.config import ModelConfig
from rljax.models.params import abstract_params, param_logical_axes
from rljax.sharding import tree_logical_shardings


# --------------------------------------------------------------------------- shapes / axes


def _base_entry(tree, name):
    module, _ = TARGETS[name]
    return tree["layers"][module][name]


@functools.lru_cache(maxsize=32)
def _abstract(model_config: ModelConfig, lora_config: LoRAConfig, dtype) -> tuple[dict, dict]:
    _, base_shapes = abstract_params(model_config)
    base_axes = param_logical_axes(model_config)
    shapes: dict = {}
    axes: dict = {}
    r = lora_config.rank
    for name in lora_config.target_modules:
        module, n_in = TARGETS[name]
        shape, ax = _base_entry(base_shapes, name).shape, _base_entry(base_axes, name)
        layers, ins, outs = shape[:1], shape[1:1 + n_in], shape[1 + n_in:]
        a_ax, b_ax = ax[:1 + n_in] + ("lora_rank",), ax[:1] + ("lora_rank",) + ax[1 + n_in:]
        shapes.setdefault("layers", {}).setdefault(module, {})[name] = {
            "a": jax.ShapeDtypeStruct(layers + ins + (r,), dtype), "b": jax.ShapeDtypeStruct(layers + (r,) + outs, dtype)}
        axes.setdefault("layers", {}).setdefault(module, {})[name] = {"a": a_ax, "b": b_ax}
    if lora_config.modules_to_save and model_config.tie_embeddings:
        raise ValueError(f"LoRA modules_to_save={list(lora_config.modules_to_save)} needs untied embeddings; this model "
                         "ties lm_head to embed_tokens (tie_word_embeddings: true)")
    for name in lora_config.modules_to_save:
        key = SAVE_MODULES[name]
        shapes.setdefault("modules_to_save", {})[name] = jax.ShapeDtypeStruct(base_shapes[key].shape, dtype)
        axes.setdefault("modules_to_save", {})[name] = base_axes[key]
    return shapes, axes


def abstract_adapters(model_config: ModelConfig, lora_config: LoRAConfig, *, dtype=jnp.float32) -> dict:
    """The adapter tree with ``jax.ShapeDtypeStruct`` leaves; allocates nothing."""
    return _abstract(model_config, lora_config, jnp.dtype(dtype))[0]


def adapter_logical_axes(model_config: ModelConfig, lora_config: LoRAConfig) -> dict:
    """The adapter tree with the logical axis names of each leaf, e.g. ``("layers", "embed", "lora_rank")``."""
    return _abstract(model_config, lora_config, jnp.dtype(jnp.float32))[1]


def adapter_shardings(model_config: ModelConfig, lora_config: LoRAConfig, mesh: Mesh, *, rules=None,
                      dtype=jnp.float32) -> dict:
    """A ``NamedSharding`` per adapter leaf, from the same logical-axis rules as the base."""
    shapes, axes = _abstract(model_config, lora_config, jnp.dtype(dtype))
    return tree_logical_shardings(axes, shapes, mesh, rules=rules)


def init_adapters(model_config: ModelConfig, lora_config: LoRAConfig, *, seed: int = 0, mesh: Mesh | None = None,
                  rules=None, dtype=jnp.float32, base: dict | None = None) -> dict:
    """Fresh adapters in their sharded layout: ``A`` uniform ``±1/sqrt(fan_in)``, ``B = 0``.

    With ``B = 0`` the adapted model equals the base exactly. The values do not depend on
    the mesh. With ``modules_to_save``, ``adapters["modules_to_save"][name]`` starts as a copy
    of ``base``'s module in ``dtype`` (``base`` is then required).
    """
    rules = tuple(rules.items()) if isinstance(rules, dict) else (None if rules is None else tuple(rules))
    out = _jitted_init(model_config, lora_config, jnp.dtype(dtype), mesh, rules)(jnp.asarray(seed, jnp.uint32))
    if lora_config.modules_to_save:
        if base is None:
            raise ValueError(f"init_adapters: modules_to_save={list(lora_config.modules_to_save)} copies the base's "
                             "modules; pass base=")
        shardings = None if mesh is None else adapter_shardings(model_config, lora_config, mesh, rules=rules, dtype=dtype)
        out["modules_to_save"] = {
            name: _copy(base[SAVE_MODULES[name]], jnp.dtype(dtype),
                        None if shardings is None else shardings["modules_to_save"][name])
            for name in lora_config.modules_to_save}
    return out


def _copy(x, dtype, sharding):
    """A new array equal to ``x`` in ``dtype`` (never an alias of the frozen base's buffer)."""
    return jax.jit(lambda v: v.astype(dtype) + jnp.zeros((), dtype), out_shardings=sharding)(x)


@functools.lru_cache(maxsize=16)
def _jitted_init(model_config, lora_config, dtype, mesh, rules):
    shapes, axes = _abstract(model_config, lora_config, dtype)

    def init(seed):
        key = jax.random.key(seed)
        out: dict = {}
        for i, name in enumerate(lora_config.target_modules):
            module, n_in = TARGETS[name]
            a, b = shapes["layers"][module][name]["a"], shapes["layers"][module][name]["b"]
            bound = 1.0 / math.sqrt(math.prod(a.shape[1:1 + n_in]))
            out.setdefault("layers", {}).setdefault(module, {})[name] = {
                "a": jax.random.uniform(jax.random.fold_in(key, i), a.shape, dtype, -bound, bound),
                "b": jnp.zeros(b.shape, dtype)}
        return out

    shapes, axes = {"layers": shapes["layers"]}, {"layers": axes["layers"]}  # modules_to_save: copied by the caller
    shardings = None if mesh is None else tree_logical_shardings(axes, shapes, mesh, rules=rules)
    return jax.jit(init, out_shardings=shardings)


def num_adapter_params(model_config: ModelConfig, lora_config: LoRAConfig) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract_adapters(model_config, lora_config)))


# --------------------------------------------------------------------------- merge


def merge(params: LoRAParams) -> dict:
    """Plain params with every adapted weight replaced by ``W + scale * A @ B`` (jit-able).

    The sum is formed in float32 and stored in ``W``'s dtype (a bfloat16 base rounds it);
    ``modules_to_save`` replace the base's modules (in their dtype). What the sampler decodes
    with, and what :func:`rljax.models.save_hf_checkpoint` exports.
    """
    if not isinstance(params, LoRAParams):
        raise ValueError(f"merge takes LoRAParams, got {type(params).__name__}")
    lcfg = params.config
    out = jax.tree.map(lambda x: x, effective_base(params))
    for name in lcfg.target_modules:
        module, n_in = TARGETS[name]
        w = params.base["layers"][module][name]
        ad = params.adapters["layers"][module][name]
        merged = w.astype(jnp.float32) + delta(ad["a"], ad["b"], n_in, lcfg.scale)
        out["layers"][module] = dict(out["layers"][module], **{name: merged.astype(w.dtype)})
    return out


# --------------------------------------------------------------------------- base identity


def _leaf_stats(x):
    """``(sum x*w, sum x^2)`` in float32 with fixed pseudo-random weights ``w`` in ``[-1, 1)`` per
    element (an integer hash of its flat index: the same on every mesh)."""
    x = x.astype(jnp.float32)
    idx = jax.lax.broadcasted_iota(jnp.uint32, (x.size,), 0).reshape(x.shape)
    w = ((idx * jnp.uint32(2654435761)) >> 8).astype(jnp.float32) / float(1 << 23) - 1.0
    return jnp.stack([jnp.sum(x * w), jnp.sum(x * x)])


def base_signature(base: dict, *, name: str) -> dict:
    """What an adapter checkpoint records about the base it belongs to (JSON-able).

    ``name`` (a preset with its seed, or the HF checkpoint path) and, per base tensor, its
    shape, dtype and two content statistics. :func:`check_base` compares them with a
    tolerance that absorbs float summation order (another mesh), not another base.
    """
    stats = jax.device_get(jax.jit(lambda p: jax.tree.map(_leaf_stats, p))(base))
    leaves = {jax.tree_util.keystr(path): {"shape": list(x.shape), "dtype": str(x.dtype),
                                           "stats": [float(v) for v in s]}
              for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(base), jax.tree.leaves(stats))}
    return {"name": name, "leaves": leaves}


def check_base(saved: dict, current: dict) -> None:
    """``ValueError`` unless ``current`` (:func:`base_signature`) is the base ``saved`` was trained on."""
    where = f"the adapters were trained on base {saved.get('name')!r}, this run's base is {current.get('name')!r}"
    if saved["leaves"].keys() != current["leaves"].keys():
        raise ValueError(f"adapter checkpoint does not fit this base model ({where}): different parameter trees")
    for key, s in saved["leaves"].items():
        c = current["leaves"][key]
        if s["shape"] != c["shape"] or s["dtype"] != c["dtype"]:
            raise ValueError(f"adapter checkpoint does not fit this base model ({where}): base{key} is "
                             f"{c['dtype']}{c['shape']}, was {s['dtype']}{s['shape']}")
        (ws, ss), (wc, sc) = s["stats"], c["stats"]
        if abs(ss - sc) > 1e-4 * max(ss, 1e-30) or abs(ws - wc) > 1e-2 * math.sqrt(max(ss, 1e-30)):
            raise ValueError(f"adapter checkpoint does not fit this base model ({where}): base{key} has other values")
