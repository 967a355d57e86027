"""``model.remat=auto``: rematerialise the layers in the backward pass when the update's activations would dominate memory.

Without remat the update keeps every layer's activations of a micro-batch until the backward
pass. With it (``model.remat_policy``) a layer keeps only its input (``full``) or also its
projections' outputs (``minimal``, MaxText's name) and recomputes the rest. On one CPU core at
31.6M (``bench/peer_remat.py``) ``minimal`` was the fastest of the three (0.87x the time of no
remat: storing the norms' and activations' outputs into the scan's per-layer buffers costs more
than recomputing them) at 38% of its temporaries; ``full`` took 0.98x at 13%.

``model.remat=auto`` (the default) turns remat on when the memory ledger's activation estimate
for one update micro-batch on one device (:func:`activation_bytes`, the formula of
``rljax.trace.ledger``'s ``activations`` row) is

* larger than the training state on that device: parameters, plus gradients and AdamW's two
  moments when every parameter trains (LoRA: the parameters only) -- the activations would be
  the largest thing the update holds, so checkpointing them is what brings its peak down; and
* larger than 1/64 of the device's memory (``memory_stats()["bytes_limit"]``; on CPU the
  host's memory shared by its local devices) -- below that the memory is not worth it.

``model.remat_policy=auto`` (the default) then keeps the projections (``minimal``) when what
``minimal`` keeps is at most twice the training state, else only the layer inputs (``full``).
The trainer says what it chose and why in one line (``remat: ...``). ``true`` / ``false`` and
``full`` / ``minimal`` force them. On the 31.6M model of ``bench/peer_trl.py`` (8 x 8
trajectories of 8 + 32 tokens, one device) the estimate is 800 MiB against a 482 MiB state:
remat on, ``minimal`` (520 MiB kept); at 256 new tokens ``full``; on the default task's tiny
model remat stays off. TRL's ``GRPOTrainer`` checkpoints gradients by default too.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

#: Remat only when the activations exceed this fraction of the device's memory (and the state).
DEVICE_FRACTION = 1 / 64
#: ``remat_policy=auto``: ``minimal`` when what it keeps is at most this many training states.
MINIMAL_STATE_FACTOR = 2

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class RematChoice:
    """What ``model.remat`` resolved to, with the numbers it was decided from (bytes per device)."""

    setting: str  # auto | true | false
    remat: bool
    policy: str  # full | minimal (what a rematerialised layer keeps)
    activation_bytes: int
    minimal_bytes: int  # what remat_policy=minimal keeps
    state_bytes: int
    device_bytes: Optional[int]
    device_source: str

    def line(self) -> str:
        mib = lambda b: f"{b / 2**20:.0f} MiB"  # noqa: E731
        numbers = (f"update activations ~{mib(self.activation_bytes)} per device (no remat) vs training state "
                   f"{mib(self.state_bytes)}" + (f" and 1/64 of {mib(self.device_bytes)} ({self.device_source})"
                                                 if self.device_bytes else ""))
        what = f"on, {self.policy} (keeps ~{mib(self.minimal_bytes if self.policy == 'minimal' else self.full_bytes)})" \
            if self.remat else "off"
        if self.setting != "auto":
            return f"remat: {what} (model.remat={self.setting}; {numbers})"
        return (f"remat: {what} (model.remat=auto: {numbers}; on when the activations exceed both; minimal when it "
                f"keeps at most {MINIMAL_STATE_FACTOR}x the state; model.remat=true/false, model.remat_policy="
                "full/minimal to force)")

    @property
    def full_bytes(self) -> int:
        return self.activation_bytes // self.factor if self.factor else 0

    factor: float = 0.0  # the no-remat estimate's per-layer-per-token factor (hidden units)


def activation_bytes(mc, tokens_per_device: int) -> int:
    """The memory ledger's estimate of one micro-batch's saved activations without remat:
    ``layers x tokens x hidden x bytes(dtype) x (ACTIVATION_FACTOR_BASE + 3 x intermediate / hidden)``."""
    from rljax.trace.ledger import ACTIVATION_FACTOR_BASE

    factor = ACTIVATION_FACTOR_BASE + 3 * mc.intermediate_size / mc.hidden_size
    return int(mc.num_layers * tokens_per_device * mc.hidden_size * _BYTES.get(str(mc.dtype), 4) * factor)


def minimal_bytes(mc, tokens_per_device: int) -> int:
    """What ``remat_policy=minimal`` keeps: each layer's input and its projections' outputs
    (q, k, v, o, gate, up, down) per token."""
    per_token = (mc.num_heads * mc.head_dim + 2 * mc.num_kv_heads * mc.head_dim + 3 * mc.hidden_size
                 + 2 * mc.intermediate_size)
    return int(mc.num_layers * tokens_per_device * per_token * _BYTES.get(str(mc.dtype), 4))


def state_bytes(mc, *, lora: bool, param_shards: int = 1) -> int:
    """Parameters on one device, plus gradients and AdamW's two moments when every parameter trains."""
    params = mc.num_params() * _BYTES.get(str(mc.param_dtype), 4) // max(param_shards, 1)
    return params if lora else 4 * params


def device_memory_bytes(device=None) -> tuple[Optional[int], str]:
    """``(bytes, where from)``: the device's ``bytes_limit``; on CPU the host's physical memory
    divided among its local devices (simulated CPU devices share it)."""
    import jax

    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats() or {}
    except Exception:
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.platform} bytes_limit"
    try:
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None, "unknown"
    n = len(jax.local_devices())
    return host // n, f"host memory / {n} local devices" if n > 1 else "host memory"


def choose(setting, mc, *, tokens_per_device: int, lora: bool, param_shards: int = 1,
           device_bytes: Optional[int] = None, device_source: str = "", policy: str = "auto") -> RematChoice:
    """Resolves ``model.remat`` (``auto`` / ``true`` / ``false``; a bool is taken as true / false)
    and ``model.remat_policy`` (``auto`` / ``full`` / ``minimal``)."""
    from rljax.trace.ledger import ACTIVATION_FACTOR_BASE

    setting = {True: "true", False: "false"}.get(setting, setting)
    if setting not in ("auto", "true", "false"):
        raise ValueError(f"model.remat={setting!r}; accepted: auto, true, false")
    if policy not in ("auto", "full", "minimal"):
        raise ValueError(f"model.remat_policy={policy!r}; accepted: auto, full, minimal")
    act = activation_bytes(mc, tokens_per_device)
    kept = minimal_bytes(mc, tokens_per_device)
    state = state_bytes(mc, lora=lora, param_shards=param_shards)
    if setting == "auto":
        remat = act > state and (device_bytes is None or act > device_bytes * DEVICE_FRACTION)
    else:
        remat = setting == "true"
    if policy == "auto":
        policy = "minimal" if kept <= MINIMAL_STATE_FACTOR * state else "full"
    return RematChoice(setting=setting, remat=remat, policy=policy, activation_bytes=act, minimal_bytes=kept,
                       state_bytes=state, device_bytes=device_bytes, device_source=device_source,
                       factor=ACTIVATION_FACTOR_BASE + 3 * mc.intermediate_size / mc.hidden_size)


def for_run(cfg, mc, mesh) -> RematChoice:
    """``model.remat`` of a run: the update's tokens per device from the configuration and the
    mesh (a padded micro-batch: ``ceil(micro / dp)`` rows of ``(S + T) / sp`` tokens, or the
    packed token budget ``actor.ppo_max_token_len_per_device`` when that is larger)."""
    from rljax.config import derive

    shape = dict(mesh.shape) if mesh is not None else {}
    dp, sp, tp = shape.get("dp", 1), shape.get("sp", 1), shape.get("tp", 1)
    sizes = derive(cfg, sp=sp)
    width = sizes.learner_prompt_length + sizes.learner_response_length
    tokens = math.ceil(sizes.micro_batch_trajectories / dp) * (width // sp)
    a = cfg.actor
    if a.use_remove_padding != "false" and a.use_dynamic_bsz and a.ppo_max_token_len_per_device:
        tokens = max(tokens, a.ppo_max_token_len_per_device)
    device = None
    if mesh is not None:
        device = mesh.devices.flat[0]
    limit, source = device_memory_bytes(device)
    return choose(cfg.model.remat, mc, tokens_per_device=tokens, lora=a.lora.rank > 0, param_shards=tp,
                  device_bytes=limit, device_source=source, policy=cfg.model.remat_policy)
