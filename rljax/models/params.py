"""Parameter trees of the NNX model: create, split / merge, abstract shapes, logical axes.

``graphdef, params = split(model)``: ``params`` is a plain nested dict of arrays
(``nnx.State.to_pure_dict()``). :func:`abstract_params` and :func:`param_logical_axes` give
the tree's shapes and logical axis names without allocating; :mod:`rljax.models.lora` builds
its adapter trees from them, and :mod:`rljax.models.functional` (which runs the model on
base or LoRA params) re-exports these names.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh

from rljax.models.config import ModelConfig
from rljax.models.transformer import Transformer
from rljax.sharding import tree_logical_shardings


def create_model(config: ModelConfig, *, rngs: nnx.Rngs | None = None, seed: int = 0) -> Transformer:
    """A freshly initialised :class:`Transformer` (on the default device, unsharded)."""
    return Transformer(config, rngs=rngs if rngs is not None else nnx.Rngs(seed))


def split(model: Transformer) -> tuple[nnx.GraphDef, dict]:
    """``(graphdef, params)``: the static structure and a pure dict of parameter arrays."""
    graphdef, state = nnx.split(model)
    return graphdef, nnx.to_pure_dict(state)


def merge(graphdef: nnx.GraphDef, params: dict) -> Transformer:
    """Inverse of :func:`split`."""
    return nnx.merge(graphdef, params)


def _nested(pairs) -> dict:
    out: dict = {}
    for path, value in pairs:
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


@functools.lru_cache(maxsize=32)
def _abstract(config: ModelConfig):
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    flat = list(nnx.to_flat_state(state))
    shapes = _nested((p, jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype)) for p, v in flat)
    axes = _nested((p, tuple(v.get_metadata()["out_sharding"])) for p, v in flat)
    return graphdef, shapes, axes


def abstract_params(config: ModelConfig) -> tuple[nnx.GraphDef, dict]:
    """``(graphdef, params)`` with ``jax.ShapeDtypeStruct`` leaves; allocates nothing."""
    graphdef, shapes, _ = _abstract(config)
    return graphdef, shapes


def param_logical_axes(config: ModelConfig) -> dict:
    """The params tree with a tuple of logical axis names per leaf, e.g. ``("embed", "mlp")``."""
    return _abstract(config)[2]


def param_shardings(config: ModelConfig, mesh: Mesh, *, rules=None) -> dict:
    """A ``NamedSharding`` per parameter: heads, MLP hidden and vocab on ``tp`` (Megatron)."""
    _, shapes, axes = _abstract(config)
    return tree_logical_shardings(axes, shapes, mesh, rules=rules)
