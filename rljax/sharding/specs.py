"""Partition specs for the trajectory batch and the KV cache, and :func:`reshard`.

Parameter specs come from the model's logical axes through
:func:`rljax.sharding.rules.tree_logical_shardings` (``rljax.models.param_shardings``).
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from rljax.sharding.rules import KV_CACHE_AXES, logical_sharding, logical_to_spec

try:  # jax.core.Tracer moves as jax.core is slimmed down
    from jax.core import Tracer as _Tracer
except ImportError:  # pragma: no cover
    from jax._src.core import Tracer as _Tracer


def batch_logical_axes(ndim: int) -> tuple[str | None, ...]:
    """Logical axes of a trajectory-batch field of rank ``ndim``: ``[B]``, ``[B,T]``, ``[B,T,...]``."""
    if ndim == 0:
        return ()
    if ndim == 1:
        return ("batch",)
    return ("batch", "length") + (None,) * (ndim - 2)


def batch_spec(shape, mesh: Mesh | None = None, *, rules=None) -> PartitionSpec:
    """``dp`` x ``fsdp`` on the batch dimension, ``sp`` on the sequence dimension (replicated where a size does not divide)."""
    shape = tuple(shape)
    return logical_to_spec(batch_logical_axes(len(shape)), rules=rules, mesh=mesh, shape=shape if mesh is not None else None)


def batch_shardings(tree: Any, mesh: Mesh, *, rules=None) -> Any:
    """A ``NamedSharding`` per array leaf of a trajectory batch (dataclass, dict, ...)."""
    return jax.tree.map(lambda x: NamedSharding(mesh, batch_spec(x.shape, mesh, rules=rules)), tree)


def kv_cache_spec(shape=None, mesh: Mesh | None = None, *, rules=None) -> PartitionSpec:
    """Spec of a KV-cache array ``[layers, slots, max_len, kv_heads, head_dim]``: slots on ``dp`` x ``fsdp``, kv heads on ``tp``."""
    return logical_to_spec(KV_CACHE_AXES, rules=rules, mesh=mesh, shape=None if shape is None else tuple(shape))


def kv_cache_sharding(shape, mesh: Mesh, *, rules=None) -> NamedSharding:
    return logical_sharding(KV_CACHE_AXES, mesh, shape=tuple(shape), rules=rules)


def reshard(tree: Any, target_shardings: Any, *, donate: bool = False) -> Any:
    """Moves ``tree`` to ``target_shardings``; the one function that changes a pytree's layout.

    Used to move weights between the learner's layout and another (the sampler's, another
    mesh over the same or other devices). ``target_shardings`` is one ``Sharding`` for every
    leaf, or a pytree of ``Sharding`` with the structure of ``tree`` (or a prefix of it).
    Inside ``jit`` (traced leaves) it is a sharding constraint on the current mesh.

    Args:
      tree: a pytree of arrays.
      target_shardings: see above.
      donate: let JAX free the source buffers (host level only).
    """
    if isinstance(target_shardings, Sharding):
        targets = jax.tree.map(lambda _: target_shardings, tree)
    else:
        try:
            targets = jax.tree.map(
                lambda s, sub: jax.tree.map(lambda _: s, sub),
                target_shardings,
                tree,
                is_leaf=lambda s: isinstance(s, Sharding) or s is None,
            )
        except ValueError as e:
            raise ValueError(
                "reshard: target_shardings must be one Sharding or a pytree of Shardings matching the tree "
                f"(got tree {jax.tree.structure(tree)} vs targets {jax.tree.structure(target_shardings, is_leaf=lambda s: isinstance(s, Sharding))}): {e}"
            ) from None
    leaves, treedef = jax.tree.flatten(tree)
    tleaves = treedef.flatten_up_to(targets)
    for t in tleaves:
        if not isinstance(t, Sharding):
            raise ValueError(f"reshard: every target must be a jax.sharding.Sharding, got {type(t).__name__}")
    if any(isinstance(x, _Tracer) for x in leaves):
        out = [jax.lax.with_sharding_constraint(x, t) for x, t in zip(leaves, tleaves)]
    else:
        out = jax.device_put(leaves, tleaves, donate=donate)
    return jax.tree.unflatten(treedef, out)
