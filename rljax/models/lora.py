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
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rljax.models.config import ModelConfig
from rljax.sharding import tree_logical_shardings, with_logical_constraint

#: Adaptable projections: name -> (module, number of leading *input* dims of its weight).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("attn", 1),
    "k_proj": ("attn", 1),
    "v_proj": ("attn", 1),
    "o_proj": ("attn", 2),  # [N, D, H]: the heads are the input
    "gate_proj": ("mlp", 1),
    "up_proj": ("mlp", 1),
    "down_proj": ("mlp", 1),
}
ALL_LINEAR = tuple(TARGETS)
#: Modules that may be trained in full beside the adapters (PEFT's ``modules_to_save``):
#: HF / PEFT name -> the key of our params tree.
SAVE_MODULES: dict[str, str] = {"lm_head": "lm_head", "embed_tokens": "embed"}


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Rank, scaling, target projections and dropout of the adapters (hashable, static).

    ``scale = alpha / rank`` (PEFT's default, not rsLoRA). ``target_modules`` are names of
    :data:`TARGETS` (HF / PEFT names: ``q_proj`` ... ``down_proj``). ``modules_to_save`` are
    names of :data:`SAVE_MODULES` trained in full beside the adapters (PEFT's option).
    """

    rank: int
    alpha: float = 16.0
    target_modules: tuple[str, ...] = ALL_LINEAR
    dropout: float = 0.0
    modules_to_save: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRAConfig.rank is {self.rank!r}; it must be a positive integer")
        if not self.alpha > 0:
            raise ValueError(f"LoRAConfig.alpha is {self.alpha!r}; it must be positive")
        targets = tuple(self.target_modules)
        bad = [t for t in targets if t not in TARGETS]
        if bad or not targets or len(set(targets)) != len(targets):
            raise ValueError(f"LoRAConfig.target_modules is {targets!r}; accepted: a non-empty set of {', '.join(TARGETS)}")
        object.__setattr__(self, "target_modules", tuple(t for t in TARGETS if t in targets))  # canonical order
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout is {self.dropout!r}; accepted: 0 <= dropout < 1")
        saved = tuple(self.modules_to_save)
        if any(m not in SAVE_MODULES for m in saved) or len(set(saved)) != len(saved):
            raise ValueError(f"LoRAConfig.modules_to_save is {saved!r}; accepted: a set of {', '.join(SAVE_MODULES)}")
        object.__setattr__(self, "modules_to_save", tuple(m for m in SAVE_MODULES if m in saved))

    @property
    def scale(self) -> float:
        return float(self.alpha) / self.rank


@flax.struct.dataclass
class LoRAParams:
    """A frozen base (the plain params dict) with trainable adapters: a pytree.

    ``dropout_key`` is set by the trainer in the update pass only (``None``: no dropout).
    """

    base: Any
    adapters: Any
    config: LoRAConfig = flax.struct.field(pytree_node=False)
    dropout_key: Optional[jax.Array] = None


def disable(params):
    """The same parameters with the adapters off: the base model (a plain params dict).

    As in PEFT, the modules in ``modules_to_save`` are the base's originals then.
    """
    return params.base if isinstance(params, LoRAParams) else params


def effective_base(params: LoRAParams) -> dict:
    """The base with the trained copies of ``modules_to_save`` in place of the originals (each
    in the original's dtype); what the model runs its adapted layers on."""
    saved = params.adapters.get("modules_to_save")
    if not saved:
        return params.base
    out = dict(params.base)
    for name, value in saved.items():
        key = SAVE_MODULES[name]
        out[key] = value.astype(params.base[key].dtype)
    return out


# --------------------------------------------------------------------------- shapes / axes


def _base_entry(tree, name):
    module, _ = TARGETS[name]
    return tree["layers"][module][name]


@functools.lru_cache(maxsize=32)
def _abstract(model_config: ModelConfig, lora_config: LoRAConfig, dtype) -> tuple[dict, dict]:
    from rljax.models import functional as F

    _, base_shapes = F.abstract_params(model_config)
    base_axes = F.param_logical_axes(model_config)
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


def delta(a: jax.Array, b: jax.Array, n_in: int, scale: float) -> jax.Array:
    """``scale * A @ B`` in the base weight's layout ``[*lead, *I, *O]`` (float32).

    ``a`` is ``[*lead, *I, r]`` and ``b`` ``[*lead, r, *O]`` with ``len(I) == n_in``; ``lead``
    is the stacked ``layers`` axis (or nothing for one layer).
    """
    lead = a.ndim - n_in - 1
    a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
    a_flat = a32.reshape(a.shape[:lead] + (-1, a.shape[-1]))
    b_flat = b32.reshape(b.shape[:lead + 1] + (-1,))
    d = jnp.einsum("...ir,...ro->...io", a_flat, b_flat, preferred_element_type=jnp.float32)
    return scale * d.reshape(a.shape[:-1] + b.shape[lead + 1:])


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


# --------------------------------------------------------------------------- forward hook


class LayerLoRA:
    """One layer's adapters inside the model's layer scan; ``add`` is the forward hook.

    ``adapters`` is one layer's slice of the adapter tree (``{"attn": {"q_proj": {"a", "b"}}}``),
    ``key`` that layer's dropout key or ``None``.
    """

    def __init__(self, adapters: dict, key, config: LoRAConfig, mesh: Mesh | None):
        self.adapters, self.key, self.config, self.mesh = adapters, key, config, mesh

    def add(self, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
        """``y + scale * dropout(x) @ A @ B`` when ``name`` is adapted, else ``y``.

        ``x [..., *I]`` is the projection's input and ``y [..., *O]`` its base output.
        """
        module, n_in = TARGETS[name]
        ad = self.adapters.get(module, {}).get(name)
        if ad is None:
            return y
        dt = x.dtype
        p = self.config.dropout
        if p > 0 and self.key is not None:
            keep = jax.random.bernoulli(jax.random.fold_in(self.key, list(TARGETS).index(name)), 1.0 - p, x.shape)
            x = jnp.where(keep, x / (1.0 - p), 0).astype(dt)
        xa = jnp.tensordot(x, ad["a"].astype(dt), axes=n_in)  # [..., r]
        if self.mesh is not None and xa.ndim == 3:
            xa = with_logical_constraint(xa, ("batch", "length", "lora_rank"), self.mesh)
        out = jnp.tensordot(xa, ad["b"].astype(dt), axes=1)  # [..., *O]
        return y + (self.config.scale * out).astype(y.dtype)


class _NoLoRA:
    """The hook of a model without adapters: every projection is the base one."""

    @staticmethod
    def add(name, x, y):
        return y


NO_LORA = _NoLoRA()


def layer_inputs(params: LoRAParams, num_layers: int):
    """What the layer scan carries per layer: the adapters' layer slices and dropout keys."""
    keys = None
    if params.dropout_key is not None and params.config.dropout > 0:
        keys = jax.random.split(params.dropout_key, num_layers)
    return params.adapters["layers"], keys


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
