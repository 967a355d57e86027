"""The one table from logical axis names to mesh axes, and helpers that apply it.

Model, batch and cache code name *logical* axes only (``("batch", "length", "embed")``);
this table decides which mesh axis, if any, each one is split over. Changing the
parallelism changes the table, never the model (MaxText's ``logical_axis_rules``).

Megatron-style tensor parallelism: attention heads, key/value heads, the MLP hidden
dimension and the vocabulary are split over ``tp``; the model dimension (``embed``) is
replicated over ``tp``. The batch is split over ``dp`` and the sequence over ``sp``.

Fully sharded data parallelism (ZeRO-3 / FSDP, MaxText's ``fsdp`` axis): the batch is
split over ``dp`` *and* ``fsdp``, and every parameter with a model dimension (``embed``)
is split along it over ``fsdp`` -- so its gradient and both AdamW moments are too, and
so are the reference model and the critic, which are laid out by the same table.
Nothing else in the code knows about ``fsdp``: XLA's SPMD partitioner all-gathers each
layer's weights where the scanned forward and backward use them and reduce-scatters the
gradients back to the shards. An activation naming ``embed`` keeps it replicated
whenever the batch has taken ``fsdp`` (a mesh axis is used once per array).

Megatron sequence parallelism: between the tensor-parallel regions (the residual stream
that the norms, the residual adds and the layer boundaries see, logical axis
``residual_length``) the sequence is split over ``sp`` *and* ``tp``, so ``tp`` divides
activation memory instead of replicating it; XLA all-gathers the sequence over ``tp``
before the q/k/v and MLP-in projections and reduce-scatters after the output
projections (the same bytes as the all-reduce it replaces).

A dimension whose size does not divide its mesh axis is replicated instead (for example
Qwen2.5-0.5B's 2 key/value heads on ``tp4``), so every valid mesh runs every model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = Union[str, tuple[str, ...], None]

#: Logical axis -> mesh axis (or tuple of mesh axes, or None for replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, MeshAxes], ...] = (
    # activations and trajectory batches
    ("batch", ("dp", "fsdp")),
    ("length", "sp"),
    ("residual_length", ("sp", "tp")),
    # parameters (and the matching activation dimensions)
    ("embed", "fsdp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("vocab", "tp"),
    ("norm", None),
    ("layers", None),
    ("lora_rank", None),  # LoRA adapters: A [.., in, r], B [r, out..] shard with the base weight's in / out axes
    # KV cache [layers, slots, max_len, kv_heads, head_dim]
    ("cache_batch", ("dp", "fsdp")),
    ("cache_length", None),
)

#: Logical axes of the KV cache arrays ``k`` and ``v``: ``[layers, slots, max_len, kv_heads, head_dim]``.
KV_CACHE_AXES: tuple[str, ...] = ("layers", "cache_batch", "cache_length", "kv_heads", "head_dim")


def _rules_dict(rules) -> dict[str, MeshAxes]:
    if rules is None:
        rules = LOGICAL_AXIS_RULES
    return dict(rules.items()) if isinstance(rules, Mapping) else dict(rules)


def logical_to_spec(
    logical_axes: Sequence[str | None],
    *,
    rules=None,
    mesh: Mesh | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """Maps logical axis names to a :class:`PartitionSpec` through ``rules``.

    Args:
      logical_axes: one name (or None) per array dimension.
      rules: ``(logical, mesh_axes)`` pairs or a dict; default :data:`LOGICAL_AXIS_RULES`.
      mesh: when given, mesh axes the mesh lacks are dropped (a mesh without an ``fsdp``
        split has no ``fsdp`` axis: :func:`rljax.sharding.make_mesh`), and (with ``shape``) a
        dimension whose size is not divisible by its mesh axes is replicated.
      shape: the array shape, used with ``mesh`` for the divisibility fallback.

    A mesh axis is used at most once per spec; a later dimension mapping to an axis
    already used is replicated. A dimension mapped to several mesh axes keeps the longest
    leading run of them whose product divides its size.
    """
    table = _rules_dict(rules)
    if shape is not None and len(shape) != len(logical_axes):
        raise ValueError(f"logical axes {tuple(logical_axes)} have rank {len(logical_axes)} but the array shape is {tuple(shape)}")
    mesh_shape = dict(mesh.shape) if mesh is not None else None
    used: set[str] = set()
    out: list[MeshAxes] = []
    for i, name in enumerate(logical_axes):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(f"unknown logical axis {name!r}; the rules define {sorted(table)}")
        target = table[name]
        axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
        if mesh_shape is not None:
            axes = tuple(a for a in axes if a in mesh_shape)
        axes = tuple(a for a in axes if a not in used)
        if mesh_shape is not None and shape is not None:
            while axes and shape[i] % _product(mesh_shape[a] for a in axes):
                axes = axes[:-1]
        used.update(axes)
        out.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def _product(sizes) -> int:
    out = 1
    for s in sizes:
        out *= s
    return out


def logical_sharding(logical_axes, mesh: Mesh, *, shape=None, rules=None) -> NamedSharding:
    """``NamedSharding`` on ``mesh`` for an array with ``logical_axes`` (see :func:`logical_to_spec`)."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, rules=rules, mesh=mesh, shape=shape))


def with_logical_constraint(x: jax.Array, logical_axes, mesh: Mesh | None, *, rules=None) -> jax.Array:
    """``jax.lax.with_sharding_constraint`` by logical names; identity when ``mesh`` is None."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_sharding(logical_axes, mesh, shape=x.shape, rules=rules))


def tree_logical_shardings(logical_tree: Any, shapes_tree: Any, mesh: Mesh, *, rules=None) -> Any:
    """Maps a tree of logical-axis tuples and a matching tree of arrays/shapes to ``NamedSharding``s."""
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)
    flat_axes, treedef = jax.tree.flatten(logical_tree, is_leaf=is_axes)
    flat_shapes = treedef.flatten_up_to(shapes_tree)
    out = [
        logical_sharding(ax, mesh, shape=getattr(s, "shape", s), rules=rules) for ax, s in zip(flat_axes, flat_shapes)
    ]
    return jax.tree.unflatten(treedef, out)
