"""Explicit DP/FSDP/TP/SP meshes, the logical-axis table, partition specs and resharding.

Mesh axes are ``dp`` (batch), ``fsdp`` (batch, and the training state split along its
model dimension), ``tp`` (heads / MLP hidden / vocab) and ``sp`` (sequence).
``parse_mesh("dp2,tp2,sp2")`` -> ``{"dp": 2, "fsdp": 1, "tp": 2, "sp": 2}``; ``make_mesh(spec)``
builds the ``jax.sharding.Mesh`` (all axes ``AxisType.Auto``, ``tp`` innermost);
``topology(mesh)`` reports the layout with ``actor_dp = world / (tp * sp) = dp * fsdp``;
``data_shards(mesh)`` is that batch split (:data:`BATCH_AXES`);
``to_host`` / ``place_batch`` move batch pytrees between host and mesh (multi-process too).

Model and data code name logical axes (``batch``, ``length``, ``embed``, ``heads``,
``kv_heads``, ``head_dim``, ``mlp``, ``vocab``, ``layers``, ``cache_batch``,
``cache_length``); :data:`LOGICAL_AXIS_RULES` maps them to mesh axes.

This package imports no other rljax package.
"""

from rljax.sharding.mesh import (
    BATCH_AXES,
    MESH_AXES,
    data_shards,
    make_mesh,
    mesh_batch_axes,
    mesh_sizes,
    parse_mesh,
    spec_device_count,
    split_devices,
    topology,
)
from rljax.sharding.rules import (
    KV_CACHE_AXES,
    LOGICAL_AXIS_RULES,
    logical_sharding,
    logical_to_spec,
    tree_logical_shardings,
    with_logical_constraint,
)
from rljax.sharding.specs import (
    batch_logical_axes,
    batch_shardings,
    batch_spec,
    kv_cache_sharding,
    kv_cache_spec,
    reshard,
)
from rljax.sharding.transfer import host_array, place_batch, to_host

__all__ = [
    "BATCH_AXES",
    "KV_CACHE_AXES",
    "LOGICAL_AXIS_RULES",
    "MESH_AXES",
    "batch_logical_axes",
    "batch_shardings",
    "batch_spec",
    "data_shards",
    "host_array",
    "kv_cache_sharding",
    "kv_cache_spec",
    "logical_sharding",
    "logical_to_spec",
    "make_mesh",
    "mesh_batch_axes",
    "mesh_sizes",
    "parse_mesh",
    "place_batch",
    "reshard",
    "spec_device_count",
    "split_devices",
    "to_host",
    "topology",
    "tree_logical_shardings",
    "with_logical_constraint",
]
