"""The run's placement (:class:`rljax.sharding.placement.Placement`), computed once by the launcher
and handed to build: the learner's and the sampler's devices under both placements, on one and
several processes, and the one-line refusals (a device count the mesh and the sampler do not add
up to; a sampler that would take the learner's devices)."""

import dataclasses

import numpy as np
import pytest

from rljax.sharding.placement import Placement, device_ratio, sampler_devices_per_process


@dataclasses.dataclass(frozen=True)
class Dev:
    id: int
    process_index: int = 0
    platform: str = "cpu"


def devices(per_process: int, processes: int = 1) -> list:
    return [Dev(p * per_process + i, p) for p in range(processes) for i in range(per_process)]


def ids(devs) -> list:
    return [d.id for d in devs]


def test_the_rule():
    assert sampler_devices_per_process("colocated", None) == 0
    assert sampler_devices_per_process("colocated", 3) == 0  # ignored unless disaggregated
    assert sampler_devices_per_process("disaggregated", 2) == 2


def test_colocated_shares_every_device():
    devs = devices(8)
    p = Placement.compute(mode="colocated", num_devices=None, mesh_spec=None, devices=devs, local_devices=devs,
                          processes=1)
    assert ids(p.learner) == ids(p.sampler) == list(range(8)) and p.per_process == 0 and p.mesh_spec == "dp8"


def test_disaggregated_takes_the_last_local_devices_of_each_process():
    devs = devices(4, processes=2)
    local = [d for d in devs if d.process_index == 1]
    p = Placement.compute(mode="disaggregated", num_devices=1, mesh_spec="dp6", devices=devs, local_devices=local,
                          processes=2)
    assert ids(p.learner) == [0, 1, 2, 4, 5, 6] and ids(p.sampler) == [7] and p.mesh_spec == "dp6"


@pytest.mark.parametrize("mode,num,spec,n,message", [
    ("colocated", None, "dp4", 8, "mesh dp4 needs 4 devices, found 8 (cpu)"),
    ("disaggregated", 2, "dp4", 4, "mesh dp4 needs 4 devices + 2 for the sampler (rollout.num_devices=2 per "
                                   "process), found 4 (cpu)"),
    ("disaggregated", 4, None, 4, "rollout.num_devices=4 leaves no device for the learner: this process has 4 (cpu)"),
])
def test_refusals_name_what_is_wrong(mode, num, spec, n, message):
    with pytest.raises(ValueError) as e:
        Placement.compute(mode=mode, num_devices=num, mesh_spec=spec, devices=devices(n), local_devices=devices(n),
                          processes=1)
    assert str(e.value) == message


class _Mesh:
    def __init__(self, devs, shape):
        self.devices = np.array(devs, dtype=object)
        self.shape = shape


def test_around_a_given_mesh_and_what_topology_records():
    devs = devices(8)
    mesh = _Mesh(devs[:6], {"dp": 6, "tp": 1, "sp": 1})
    p = Placement.around(mesh, mode="disaggregated", num_devices=2, local_devices=devs, processes=1)
    assert ids(p.sampler) == [6, 7] and p.mesh_spec == "dp6"
    with pytest.raises(ValueError, match=r"the sampler's devices \[6, 7\] are in the learner mesh"):
        Placement.around(_Mesh(devs, {"dp": 8}), mode="disaggregated", num_devices=2, local_devices=devs, processes=1)
    desc = p.describe(mesh, rollout_tp=2, trainer_mode="async")
    assert desc["learner"] == {"devices": [0, 1, 2, 3, 4, 5], "mesh": {"dp": 6, "tp": 1, "sp": 1}}
    assert desc["rollout"]["devices"] == [6, 7] and desc["rollout"]["replicas_per_process"] == 1
    assert desc["disjoint"] and desc["device_ratio"] == device_ratio(2, 6, shared=False)
    assert desc["device_ratio"]["ratio"] == "1:3"
