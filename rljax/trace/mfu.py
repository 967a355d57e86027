"""Model FLOPs utilisation: model FLOPs per second over the devices' peak.

``mfu = flops / seconds / (devices * peak)`` with ``flops`` from :mod:`rljax.models.flops`
and ``peak`` the dense bf16 matmul peak of one device from :data:`PEAK_BF16_FLOPS`
(vendor data sheets; GPUs without sparsity). Devices not in the table (CPU, unknown
accelerators) have no peak, and the MFU metrics are left out rather than guessed.
"""

from __future__ import annotations

from typing import Optional

#: Dense bf16 peak FLOP/s per device, by a lower-case substring of ``device.device_kind``
#: (first match wins, so the more specific names come first).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("tpu v6 lite", 918e12),  # v6e (Trillium)
    ("tpu v6e", 918e12),
    ("tpu v5 lite", 197e12),  # v5e
    ("tpu v5e", 197e12),
    ("tpu v5p", 459e12),
    ("tpu v5", 459e12),  # v5p reports "TPU v5"
    ("tpu v4", 275e12),
    ("h200", 989e12),
    ("h100", 989e12),  # SXM; the PCIe part is 756e12
    ("a100", 312e12),
)


def peak_flops(device_kind: str) -> Optional[float]:
    """Peak bf16 FLOP/s of one device of ``device_kind`` (``jax.Device.device_kind``), or None."""
    kind = device_kind.lower()
    for name, peak in PEAK_BF16_FLOPS:
        if name in kind:
            return peak
    return None


def mfu(flops: float, seconds: float, devices) -> Optional[float]:
    """``flops / seconds / (len(devices) * peak)``; None off the table (e.g. CPU) or for no time."""
    devices = list(devices)
    if not devices or seconds <= 0:
        return None
    peak = peak_flops(devices[0].device_kind)
    if peak is None or devices[0].platform == "cpu":
        return None
    return flops / seconds / (len(devices) * peak)


def mfu_metrics(model_config, *, update_lengths=None, update_s: float = 0.0, prompt_lengths=None,
                response_lengths=None, gen_s: float = 0.0, devices=()) -> dict:
    """``perf/mfu/actor`` (the actor update: forward + backward over every PPO epoch's
    tokens, ``update_lengths`` repeated per epoch by the caller) and ``perf/mfu/rollout``
    (prefill + decode of the responses); keys are absent where :func:`mfu` is None."""
    from rljax.models import flops as F  # flax (rljax.models): the peak table is read without the model code

    out = {}
    if update_lengths is not None:
        v = mfu(F.train_flops(model_config, update_lengths), update_s, devices)
        if v is not None:
            out["perf/mfu/actor"] = v
    if prompt_lengths is not None and response_lengths is not None:
        v = mfu(F.rollout_flops(model_config, prompt_lengths, response_lengths), gen_s, devices)
        if v is not None:
            out["perf/mfu/rollout"] = v
    return out
