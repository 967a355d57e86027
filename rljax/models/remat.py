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
trajectories of 8 + 32 tokens, one device) the estimate is 1650 MiB against a 482 MiB state:
remat on, ``minimal`` (520 MiB kept); at 256 new tokens ``full`` (12738 MiB estimated, XLA's
update temporaries 12885 MiB with the gradients); on the default task's tiny model remat
stays off (38 MiB, under 1/64 of the host). The estimate counts the attention implementation
the config selects (dense ``[B, H, T, T]`` scores up to ``model.attn_block_size`` keys). TRL's ``GRPOTrainer`` checkpoints gradients by default too.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

from rljax.config import derive

#: Remat only when the activations exceed this fraction of the device's memory (and the state).
DEVICE_FRACTION = 1 / 64
#: ``remat_policy=auto``: ``minimal`` when what it keeps is at most this many training states.
MINIMAL_STATE_FACTOR = 2

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

#: Saved activations per layer per token without remat, in units of ``hidden_size`` values:
#: ``ACTIVATION_FACTOR_BASE + ACTIVATION_FACTOR_MLP x intermediate / hidden``, plus the attention
#: state (:func:`score_bytes`). Fitted to XLA:CPU's ``memory_analysis()`` temporaries of the
#: real update (value_and_grad + AdamW) with blockwise attention, so no score matrices, at hidden
#: 128 and 512, intermediate / hidden 1, 4 and 8: 12 + 7 x 4 = 40 at 31.6M (measured 40.7);
#: 17.5 + 7 x f/h at hidden 128 (fixed per-head and per-token terms weigh more in a small
#: model). The old 8 + 3 x f/h (the residual stream, norms, q/k/v/o and MLP input; MLP hidden x 3)
#: was half of what XLA keeps: it also keeps the rotary inputs, SwiGLU's gate, up, their
#: activation and product, and float32 upcasts of the norms.
ACTIVATION_FACTOR_BASE = 12
ACTIVATION_FACTOR_MLP = 7


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

    full_bytes: int = 0  # what remat_policy=full keeps (the layer inputs) and one layer's recompute


def attention_blocked(mc, keys: int) -> bool:
    """Whether the update's attention over ``keys`` keys runs blockwise (``rljax.models.attention.attention``)."""
    return mc.attn_block_size is not None and keys > mc.attn_block_size


def score_bytes(mc, rows: int, queries: int, keys: int, *, tp: int = 1) -> int:
    """One layer's saved attention state for ``rows`` rows of ``queries`` queries over ``keys``
    keys (heads split over ``tp``), per the implementation the config selects: dense
    attention (``keys <= model.attn_block_size``, or no block size) keeps the ``[B, H, Tq, Tk]``
    float32 scores and the probabilities in the compute dtype; blockwise keeps two float32
    softmax statistics per query and head."""
    heads = -(-mc.num_heads // max(tp, 1))
    if attention_blocked(mc, keys):
        return rows * heads * queries * 2 * 4
    return rows * heads * queries * keys * (4 + _BYTES.get(str(mc.dtype), 4))


def layer_bytes(mc, rows: int, queries: int, keys: int, *, tp: int = 1) -> int:
    """One layer's saved activations without remat: ``rows x queries`` tokens x ``hidden`` x
    bytes(dtype) x (ACTIVATION_FACTOR_BASE + ACTIVATION_FACTOR_MLP x intermediate / hidden),
    plus :func:`score_bytes`."""
    factor = ACTIVATION_FACTOR_BASE + ACTIVATION_FACTOR_MLP * mc.intermediate_size / mc.hidden_size
    per_token = mc.hidden_size * _BYTES.get(str(mc.dtype), 4) * factor
    return int(rows * queries * per_token) + score_bytes(mc, rows, queries, keys, tp=tp)


def activation_bytes(mc, rows: int, seq: int, *, sp: int = 1, tp: int = 1) -> int:
    """The memory ledger's estimate of one update micro-batch's saved activations on one device
    without remat: ``layers x`` :func:`layer_bytes` for ``rows`` rows of ``seq / sp`` queries
    over ``seq`` keys (sequence parallelism all-gathers the keys)."""
    return mc.num_layers * layer_bytes(mc, rows, -(-seq // max(sp, 1)), seq, tp=tp)


def remat_bytes(mc, rows: int, seq: int, *, sp: int = 1, tp: int = 1, policy: str = "full") -> int:
    """The same with remat: what every layer keeps (``full``: its input; ``minimal``:
    :func:`minimal_bytes`) plus one layer's activations, recomputed in the backward pass."""
    q = -(-seq // max(sp, 1))
    tokens = rows * q
    kept = (minimal_bytes(mc, tokens) if policy == "minimal"
            else mc.num_layers * tokens * mc.hidden_size * _BYTES.get(str(mc.dtype), 4))
    return kept + layer_bytes(mc, rows, q, seq, tp=tp)


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


def choose(setting, mc, *, rows: int, seq: int, lora: bool, sp: int = 1, tp: int = 1, fsdp: int = 1,
           device_bytes: Optional[int] = None, device_source: str = "", policy: str = "auto") -> RematChoice:
    """Resolves ``model.remat`` (``auto`` / ``true`` / ``false``; a bool is taken as true / false)
    and ``model.remat_policy`` (``auto`` / ``full`` / ``minimal``) for an update micro-batch of
    ``rows`` rows of ``seq`` tokens on one device (the sequence split over ``sp``, heads and
    parameters over ``tp``, the training state also over ``fsdp``)."""
    setting = {True: "true", False: "false"}.get(setting, setting)
    if setting not in ("auto", "true", "false"):
        raise ValueError(f"model.remat={setting!r}; accepted: auto, true, false")
    if policy not in ("auto", "full", "minimal"):
        raise ValueError(f"model.remat_policy={policy!r}; accepted: auto, full, minimal")
    act = activation_bytes(mc, rows, seq, sp=sp, tp=tp)
    kept = minimal_bytes(mc, rows * -(-seq // max(sp, 1)))
    state = state_bytes(mc, lora=lora, param_shards=tp * fsdp)
    if setting == "auto":
        remat = act > state and (device_bytes is None or act > device_bytes * DEVICE_FRACTION)
    else:
        remat = setting == "true"
    if policy == "auto":
        policy = "minimal" if kept <= MINIMAL_STATE_FACTOR * state else "full"
    return RematChoice(setting=setting, remat=remat, policy=policy, activation_bytes=act, minimal_bytes=kept,
                       state_bytes=state, device_bytes=device_bytes, device_source=device_source,
                       full_bytes=remat_bytes(mc, rows, seq, sp=sp, tp=tp, policy="full"))


def for_run(cfg, mc, mesh, *, device_bytes: Optional[int] = None) -> RematChoice:
    """``model.remat`` of a run: the update's micro-batch on one device from the configuration and
    the mesh (a padded micro-batch: ``ceil(micro / (dp * fsdp))`` rows of ``S + T`` tokens split
    over ``sp``; with the packed token budget ``actor.ppo_max_token_len_per_device``, when that is
    larger, as many rows of ``S + T`` as hold it). ``device_bytes``: the device memory to decide
    for (``--plan --device-memory``; default: the mesh's first device's)."""
    shape = dict(mesh.shape) if mesh is not None else {}
    dp, fsdp, sp, tp = shape.get("dp", 1), shape.get("fsdp", 1), shape.get("sp", 1), shape.get("tp", 1)
    sizes = derive(cfg, sp=sp)
    width = sizes.learner_prompt_length + sizes.learner_response_length
    rows = math.ceil(sizes.micro_batch_trajectories / (dp * fsdp))
    a = cfg.actor
    if a.use_remove_padding != "false" and a.use_dynamic_bsz and a.ppo_max_token_len_per_device:
        rows = max(rows, math.ceil(a.ppo_max_token_len_per_device / (width // sp)))
    if device_bytes is not None:
        limit, source = device_bytes, "--device-memory"
    else:
        limit, source = device_memory_bytes(None if mesh is None else mesh.devices.flat[0])
    return choose(cfg.model.remat, mc, rows=rows, seq=width, sp=sp, tp=tp, fsdp=fsdp, lora=a.lora.rank > 0,
                  device_bytes=limit, device_source=source, policy=cfg.model.remat_policy)
