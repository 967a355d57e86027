"""Mesh specs (``dp8``, ``fsdp8``, ``dp2,fsdp4``, ``dp2,tp2,sp2``), mesh construction and the topology report.

Mesh axes have fixed names: ``dp`` (data: the batch, training state replicated), ``fsdp``
(fully sharded data: the batch too, and the training state -- parameters, gradients,
optimizer moments -- split along one dimension of each array, gathered per layer),
``tp`` (tensor: attention heads, MLP hidden, vocabulary) and ``sp`` (sequence). A spec
names each axis at most once with its size; missing axes have size 1; the product must
equal the number of devices.

Axis types. :func:`make_mesh` builds every axis as :attr:`jax.sharding.AxisType.Auto`
(JAX 0.10+ defaults ``jax.make_mesh`` to ``Explicit``). With ``Auto`` axes the model code
only names *logical* axes at a few boundaries (``with_sharding_constraint`` through
:mod:`rljax.sharding.rules`) and XLA's partitioner propagates the rest, MaxText style;
sequence-parallel attention runs inside ``jax.shard_map`` over the same mesh. ``Explicit``
axes would make every ``einsum`` in the model spell out its output sharding, tying the
model to one parallelism, which is what the logical-axis table exists to avoid.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from rljax._meshspec import BATCH_AXES, MESH_AXES, batch_shards, parse_mesh_sizes


def _device_summary(devices: Sequence[Any]) -> str:
    kinds = sorted({getattr(d, "platform", str(d)) for d in devices})
    return ", ".join(kinds) if kinds else "none"


def _check_axis_sizes(spec: str, sizes: Mapping[str, int], devices) -> dict[str, int]:
    out = {a: int(sizes.get(a, 1)) for a in MESH_AXES}
    if devices is None:
        devices = jax.devices()
    if isinstance(devices, int):
        n, where = devices, "given"
    else:
        devices = list(devices)
        n, where = len(devices), _device_summary(devices)
    need = math.prod(out.values())
    if need != n:
        raise ValueError(
            f"mesh {spec} needs {need} device{'s' if need != 1 else ''}, found {n} ({where})"
        )
    return out


def parse_mesh(spec: str | Mapping[str, int], devices: Sequence[Any] | int | None = None) -> dict[str, int]:
    """Parses a mesh spec into ``{"dp": n, "fsdp": n, "tp": n, "sp": n}``.

    Args:
      spec: comma-separated ``<axis><size>`` items in any order, e.g. ``"dp8"``,
        ``"fsdp4,tp2"``, ``"sp4,dp2"``; axes are ``dp``, ``fsdp``, ``tp``, ``sp``; missing
        axes are 1. A mapping ``{"dp": 2, "tp": 4}`` is accepted too.
      devices: the devices the mesh must cover (default ``jax.devices()``), or their count.

    Returns:
      A dict with all four axes, in the order ``dp, fsdp, tp, sp``.

    Raises:
      ValueError: in one sentence, for an unknown axis, a size that is not a positive
        integer, a repeated axis, an empty spec, or a product that differs from the
        device count.
    """
    text, sizes = parse_mesh_sizes(spec)
    return _check_axis_sizes(text, sizes, devices)


def split_devices(devices: Sequence[Any], rollout_per_process: int = 0) -> tuple[list, list]:
    """``(learner devices, sampler devices)`` of ``devices`` under the placement rule: on every
    process the sampler takes the last ``rollout_per_process`` local devices and the learner the
    rest (``rollout.placement=disaggregated``); with 0 (colocated) both share every device.

    Pass ``jax.devices()`` for the learner mesh's devices (all processes), ``jax.local_devices()``
    for this process's sampler devices.
    """
    devices = list(devices)
    n = int(rollout_per_process)
    if n == 0:
        return devices, devices
    learner, sampler = [], []
    for p in sorted({d.process_index for d in devices}):
        local = [d for d in devices if d.process_index == p]
        if len(local) <= n:
            raise ValueError(f"rollout.num_devices={n} leaves no device for the learner: process {p} has "
                             f"{len(local)}")
        learner += local[: len(local) - n]
        sampler += local[len(local) - n:]
    return learner, sampler


def spec_device_count(spec: str | Mapping[str, int]) -> int:
    """The number of devices ``spec`` needs, checking only its syntax (never touches JAX).

    The launcher calls this before JAX initialises, to create that many virtual CPU devices.
    """
    _, sizes = parse_mesh_sizes(spec)
    return math.prod(sizes.values())


def make_mesh(spec: str | Mapping[str, int], devices: Sequence[Any] | None = None) -> Mesh:
    """Builds the ``("dp", "fsdp", "tp", "sp")`` mesh for ``spec`` over ``devices``.

    Devices are laid out with ``jax.make_mesh`` (which follows the physical topology on
    TPU/GPU) in the order ``dp, fsdp, sp, tp`` so that ``tp`` is innermost -- its groups are
    the fastest-connected devices -- then ``sp``, then ``fsdp`` (its per-layer weight
    gathers are the next heaviest traffic), then ``dp`` (one gradient all-reduce per
    step: the axis to put across hosts); the axes are then listed as
    ``("dp", "fsdp", "tp", "sp")``. A spec without ``fsdp`` (size 1) gives a mesh without
    that axis, ``("dp", "tp", "sp")``, so such runs lay out and compute exactly as before
    the axis existed. All axes are ``AxisType.Auto`` (see the module docstring).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh(spec, devices)
    physical_axes = tuple(a for a in ("dp", "fsdp", "sp", "tp") if a != "fsdp" or sizes["fsdp"] > 1)
    auto = (AxisType.Auto,) * len(physical_axes)
    physical = jax.make_mesh(tuple(sizes[a] for a in physical_axes), physical_axes, axis_types=auto, devices=devices)
    names = tuple(a for a in MESH_AXES if a in physical_axes)
    order = [physical_axes.index(a) for a in names]
    return Mesh(physical.devices.transpose(order), names, axis_types=auto)


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """``{"dp", "fsdp", "tp", "sp"}`` sizes of ``mesh`` (axes it lacks count as 1)."""
    shape = dict(mesh.shape)
    return {a: int(shape.get(a, 1)) for a in MESH_AXES}


def topology(mesh: Mesh) -> dict[str, Any]:
    """The learner's layout as a JSON-serialisable dict.

    ``actor_dp = world_size / (tp * sp) = dp * fsdp`` is the learner's data-parallel degree
    (the batch's shards); ``state_shards`` is ``fsdp``, the ways the training state is
    split besides ``tp``. The sampler's layout is reported separately; actor DP is never
    derived from it.
    """
    devs = list(mesh.devices.flat)
    sizes = mesh_sizes(mesh)
    world = len(devs)
    processes = sorted({d.process_index for d in devs})
    local = [d for d in devs if d.process_index == jax.process_index()]
    return {
        "platform": devs[0].platform,
        "device_kind": devs[0].device_kind,
        "process_count": len(processes),
        "process_index": jax.process_index(),
        "devices_per_process": len(local),
        "world_size": world,
        "mesh": sizes,
        "mesh_axis_names": list(mesh.axis_names),
        "actor_dp": world // (sizes["tp"] * sizes["sp"]),
        "batch_axes": [a for a in BATCH_AXES if a in sizes],
        "state_shards": sizes["fsdp"],
    }


def mesh_batch_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes that split the batch on ``mesh``: those of :data:`BATCH_AXES` it has with
    size > 1 (``("dp",)`` on ``dp8``, ``("dp", "fsdp")`` on ``dp2,fsdp4``, ``()`` on ``tp8``)."""
    shape = dict(mesh.shape)
    return tuple(a for a in BATCH_AXES if shape.get(a, 1) > 1)


def data_shards(mesh: Mesh | Mapping[str, int] | None) -> int:
    """The batch's shards on ``mesh`` (a mesh or its sizes): ``dp * fsdp``; 1 without a mesh."""
    if mesh is None:
        return 1
    return batch_shards(dict(mesh.shape) if isinstance(mesh, Mesh) else mesh)
