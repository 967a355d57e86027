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


def kv_heads_note(num_kv_heads: int, rollout_tp: int) -> str | None:
    """One line when ``rollout.tp`` does not split the model's KV heads, else ``None``.

    The sampler's KV cache splits its heads over ``tp``; with ``num_kv_heads % rollout_tp != 0``
    (more tp devices than KV heads included: grouped-query models have few, Qwen2.5-7B 4) the
    heads cannot split, and every tp device holds the whole cache of its replica's slots, replicated
    ``rollout_tp`` times. The note names the values of ``rollout.tp`` that do split it.
    """
    if rollout_tp <= 1 or num_kv_heads % rollout_tp == 0:
        return None
    splits = [t for t in range(1, num_kv_heads + 1) if num_kv_heads % t == 0]
    return (f"rollout: rollout.tp={rollout_tp} does not divide the model's {num_kv_heads} KV heads: each tp device "
            f"holds its replica's whole KV cache ({rollout_tp} copies); rollout.tp in {splits} splits it")
