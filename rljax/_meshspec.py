"""Mesh-spec syntax (``dp8``, ``dp2,tp2,sp2``, ``dp2,fsdp4``), in pure Python.

Shared by :mod:`rljax.sharding` (which adds the device checks) and :mod:`rljax.config`
(which validates ``trainer.mesh`` before JAX is imported), so both say the same thing about
the same mistake.
"""

from __future__ import annotations

import numbers
import re
from collections.abc import Mapping

#: Mesh axis names, in the order meshes list them.
MESH_AXES: tuple[str, ...] = ("dp", "fsdp", "tp", "sp")

#: The mesh axes the batch is split over: ``dp`` (replicated training state) and ``fsdp``
#: (training state sharded over the same devices, gathered per layer).
BATCH_AXES: tuple[str, ...] = ("dp", "fsdp")

_AXES_TEXT = ", ".join(MESH_AXES)


def batch_shards(sizes: Mapping[str, int]) -> int:
    """How many ways the batch is split: ``dp * fsdp`` of ``sizes`` (missing axes are 1)."""
    out = 1
    for axis in BATCH_AXES:
        out *= int(sizes.get(axis, 1))
    return out

_ITEM = re.compile(r"^([a-z]+)(.*)$")


def parse_mesh_sizes(spec: str | Mapping[str, int]) -> tuple[str, dict[str, int]]:
    """Syntax check of a mesh spec: ``(normalised text, {axis: size})`` for the axes it names."""
    if isinstance(spec, Mapping):
        items = list(spec.items())
        text = ",".join(f"{k}{v}" for k, v in items)
    elif isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise ValueError(f"mesh spec is empty; expected items like 'dp8' or 'dp2,fsdp4' over axes {_AXES_TEXT}")
        items = []
        for raw in text.split(","):
            item = raw.strip().lower()
            known = [a for a in MESH_AXES if item.startswith(a)]  # no axis name is a prefix of another
            if known:
                items.append((known[0], item[len(known[0]):]))
                continue
            m = _ITEM.match(item)
            if not m:
                raise ValueError(
                    f"mesh spec {text!r}: item {raw.strip()!r} is not <axis><size>; "
                    f"expected e.g. 'dp8' or 'dp2,tp2,sp2' over axes {_AXES_TEXT}"
                )
            items.append((m.group(1), m.group(2)))
    else:
        raise ValueError(f"mesh spec must be a string like 'dp2,tp2,sp2' or a dict, got {type(spec).__name__}")

    sizes: dict[str, int] = {}
    for axis, size in items:
        if axis not in MESH_AXES:
            raise ValueError(f"mesh spec {text!r}: unknown axis {axis!r}; accepted axes are {_AXES_TEXT}")
        if axis in sizes:
            raise ValueError(f"mesh spec {text!r}: axis {axis!r} is repeated; name each of {_AXES_TEXT} at most once")
        if isinstance(size, str):
            s = size.strip()
            if not s:
                raise ValueError(f"mesh spec {text!r}: axis {axis!r} has no size; write e.g. '{axis}2'")
            if not re.fullmatch(r"[+-]?\d+", s):
                raise ValueError(
                    f"mesh spec {text!r}: size of {axis!r} is {s!r}, not a number; write e.g. '{axis}2'"
                )
            size = int(s)
        if isinstance(size, bool) or not isinstance(size, numbers.Integral):
            raise ValueError(f"mesh spec {text!r}: size of {axis!r} is {size!r}, not an integer")
        if size <= 0:
            raise ValueError(f"mesh spec {text!r}: size of {axis!r} is {size}; sizes must be positive integers")
        sizes[axis] = int(size)
    return text, sizes

