"""The sampler's own mesh: ``rollout_tp`` devices per replica, replicas on ``dp``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from rljax.sharding import make_mesh


def sampler_mesh(rollout_tp: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """``dp{len(devices) // rollout_tp},tp{rollout_tp}`` over ``devices`` (default all).

    Parameters are split over ``tp`` and replicated over ``dp``; the KV cache puts
    decode slots on ``dp`` (each replica decodes its share of the slots).
    """
    devices = list(jax.devices() if devices is None else devices)
    if isinstance(rollout_tp, bool) or not isinstance(rollout_tp, int) or rollout_tp < 1 or len(devices) % rollout_tp:
        raise ValueError(f"rollout_tp is {rollout_tp!r}; accepted: a positive divisor of the {len(devices)} devices")
    return make_mesh({"dp": len(devices) // rollout_tp, "tp": rollout_tp}, devices)
