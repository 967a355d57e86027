"""The LoRA adapter types and the per-layer hook the model runs (see :mod:`rljax.models.lora`).

:class:`LoRAConfig`, :class:`LoRAParams` and :class:`LayerLoRA` (``y + scale * dropout(x) @ A @ B``
inside the layer scan) sit below the model (:mod:`rljax.models.transformer` and
:mod:`rljax.models.functional` run them); :mod:`rljax.models.lora`, which builds adapter trees
from the model's parameter shapes, sits above it and re-exports these names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import flax
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from rljax.sharding import with_logical_constraint

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
