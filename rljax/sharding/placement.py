"""Where the learner and the sampler run: a :class:`Placement`, computed once from the resolved
config's plain values (``rollout.placement``, ``rollout.num_devices``, ``trainer.mesh``) and the
devices, then handed on: the launcher builds the learner mesh on :attr:`Placement.learner`, build
puts the sampler on :attr:`Placement.sampler`, ``topology.json`` records both
(:meth:`Placement.describe`).

The placement rule, written here only: colocated, the learner and the sampler take turns on every
device; disaggregated, on every process the sampler holds the last ``rollout.num_devices`` local
devices and the learner mesh the rest (:func:`rljax.sharding.split_devices`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Optional

from rljax.sharding.mesh import mesh_sizes, spec_device_count, split_devices

DISAGGREGATED = "disaggregated"


def sampler_devices_per_process(mode: str, num_devices: Optional[int]) -> int:
    """The devices per process the sampler holds on its own: ``rollout.num_devices`` when
    ``rollout.placement=disaggregated``, else 0 (colocated: it shares the learner's)."""
    return int(num_devices or 0) if mode == DISAGGREGATED else 0


def device_ratio(rollout: int, learner: int, *, shared: bool) -> dict:
    """The rollout:learner device ratio (``topology.json``'s ``placement.device_ratio``), in lowest terms."""
    g = math.gcd(rollout, learner) or 1
    return {"rollout": rollout, "learner": learner, "ratio": f"{rollout // g}:{learner // g}",
            "shared": shared, "note": "colocated: the same devices take turns" if shared else
            "disaggregated: disjoint device groups"}


@dataclasses.dataclass(frozen=True)
class Placement:
    """The two device groups of a run.

    Attributes:
      mode: ``rollout.placement`` (``colocated`` or ``disaggregated``).
      per_process: the sampler's own devices per process (0 when colocated).
      learner: the learner mesh's devices, over every process.
      sampler: this process's sampler devices (the sampler mesh is process-local).
      processes: the process count.
      mesh_spec: the learner mesh's spec (``trainer.mesh``, or dp over the learner devices).
    """

    mode: str
    per_process: int
    learner: tuple
    sampler: tuple
    processes: int
    mesh_spec: str

    @classmethod
    def compute(cls, *, mode: str, num_devices: Optional[int], mesh_spec: Optional[str], devices: Sequence[Any],
                local_devices: Sequence[Any], processes: int) -> "Placement":
        """The placement over ``devices`` (every process's; ``local_devices`` this process's).

        Raises:
          ValueError: in one line, when the devices are not what ``mesh_spec`` plus the sampler's
            need, or the sampler would leave a process no learner device.
        """
        n = sampler_devices_per_process(mode, num_devices)
        devices, local_devices = list(devices), list(local_devices)
        platform = devices[0].platform if devices else "none"
        need = None if mesh_spec is None else spec_device_count(mesh_spec)
        extra = n * processes
        if need is not None and len(devices) != need + extra:
            more = f" + {extra} for the sampler (rollout.num_devices={n} per process)" if extra else ""
            raise ValueError(f"mesh {mesh_spec} needs {need} devices{more}, found {len(devices)} ({platform})")
        if need is None and n and len(local_devices) <= n:
            raise ValueError(f"rollout.num_devices={n} leaves no device for the learner: this process has "
                             f"{len(local_devices)} ({platform})")
        learner = split_devices(devices, n)[0]
        return cls(mode=mode, per_process=n, learner=tuple(learner), sampler=tuple(split_devices(local_devices, n)[1]),
                   processes=processes, mesh_spec=mesh_spec or f"dp{len(learner)}")

    @classmethod
    def around(cls, mesh, *, mode: str, num_devices: Optional[int], local_devices: Sequence[Any],
               processes: int) -> "Placement":
        """The placement of a learner ``mesh`` built elsewhere (``Trainer(cfg, mesh, ...)`` in a
        program): the sampler takes its devices by the same rule and must not share the mesh's.

        Raises:
          ValueError: the sampler's devices are in ``mesh`` (disaggregated).
        """
        n = sampler_devices_per_process(mode, num_devices)
        learner = tuple(mesh.devices.flat)
        sampler = tuple(split_devices(local_devices, n)[1])
        shared = {d.id for d in learner} & {d.id for d in sampler} if n else set()
        if shared:
            raise ValueError(f"rollout.num_devices={n}: the sampler's devices {sorted(shared)} are in the learner "
                             "mesh; the learner takes all but the last rollout.num_devices local devices")
        spec = ",".join(f"{a}{s}" for a, s in mesh_sizes(mesh).items() if s > 1) or "dp1"  # the axes it splits
        return cls(mode=mode, per_process=n, learner=learner, sampler=sampler, processes=processes, mesh_spec=spec)

    def describe(self, mesh, *, rollout_tp: int, trainer_mode: str) -> dict:
        """``topology.json``'s ``placement``: both device groups, their meshes, whether they are disjoint."""
        learner = [d.id for d in mesh.devices.flat]
        sampler = [d.id for d in self.sampler]
        n = len(sampler)
        shared = bool(set(learner) & set(sampler))
        return {"mode": self.mode, "trainer_mode": trainer_mode,
                "learner": {"devices": learner, "mesh": dict(mesh.shape)},
                "rollout": {"devices": sampler, "devices_per_process": n, "mesh": {"dp": n // rollout_tp,
                                                                                   "tp": rollout_tp},
                            "tp": rollout_tp, "replicas_per_process": n // rollout_tp,
                            "replicas_derivation": f"sampler devices per process / rollout.tp = {n} / {rollout_tp}",
                            "processes": self.processes},
                "disjoint": not shared,
                "device_ratio": device_ratio(n * self.processes, len(learner), shared=shared)}
