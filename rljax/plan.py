"""``python -m rljax.launch ... --plan [--device-memory 80GiB]``: does the run fit, before it starts.

The plan resolves the configuration like a launch, then prints per device: the parameters,
gradients and optimizer state (exact: the shard shapes of the layout the logical-axis table
gives on the mesh), the update's activations (with the choice ``model.remat=auto`` would make
for that device memory), the reference model and the critic when the run has them, the
sampler's weights (its own mesh: ``rollout.tp``) and KV cache, and the total; it says whether
the total fits and, when not, the smallest change that would: ``model.remat=true``, a smaller
``actor.ppo_micro_batch_size``, a mesh that moves ``dp`` into ``fsdp`` (the training state
split over the data axis), or LoRA -- tried in that order, each alone, then the mesh with
each of the others.

Two ways to the activations, and the plan says which it used:

* **XLA**: the update step (``rljax.trainer.make_train_step``: fused log-prob, the loss,
  gradient accumulation, AdamW) is lowered and compiled for the mesh with abstract shapes
  (``jax.ShapeDtypeStruct`` with shardings: nothing is allocated, no weights are read) and its
  ``compiled.memory_analysis()`` gives the update's peak (arguments + outputs - aliased +
  temporaries; the gradients live in the temporaries). This is the default.
* **formulas**: the memory ledger's (:mod:`rljax.models.remat`): saved activations per layer
  per token fitted to XLA's analysis, and the gradients as large as the trainable parameters.
  Used for the plan itself when the program cannot be compiled here (the reason is printed).

The suggested changes are judged as the plan was. Each candidate is planned by the formulas
first; when the plan itself was measured by XLA, a candidate the formulas accept is then
compiled the same way and named only if XLA's total fits too (at most ``XLA_CANDIDATES``
compiles, in order; those XLA refuses are printed with both totals, since the formulas can be
below XLA: the 7B config's micro-batch 8 is 12.0 GiB by the formulas, 17.6 GiB by XLA). When
the plan could not compile, the formulas alone judge and the suggestion says so.

The plan trains nothing and writes nothing (no run directory, no compilation cache). Exit
status: 0 fits, 1 does not fit, 2 usage error (launch's). On a CPU host the launcher creates
the mesh's devices as it does for a run, so a plan for an 8-chip host runs on a laptop; XLA's
CPU analysis stands in for the accelerator's (the same program; the accelerator's compiler
may fuse differently).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Callable, Optional

from rljax.config import ConfigError, apply_model_overrides, derive, resolve_run, validate

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920; units B, KB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB (of 2), G = GB.

    Raises:
      ValueError: one line naming the value and what is accepted.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(f"--device-memory {text!r} is not a memory size; accepted: a positive number with a unit "
                         "B, KB, MB, GB, TB (powers of 10) or KiB, MiB, GiB, TiB (powers of 2), e.g. 80GiB or 16GB")
    return int(float(m.group(1)) * _UNITS[unit])


def gib(n: Optional[float]) -> str:
    """Bytes as GiB (MiB below 1 GiB)."""
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class Row:
    item: str
    bytes: int
    how: str


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes of a run (``rows``), their ``total`` and what it was measured by (``source``)."""

    mesh: str
    rows: tuple
    total: int
    source: str
    remat: str  # the remat line (rljax.models.remat.RematChoice.line)
    device_bytes: Optional[int]
    device_source: str

    @property
    def fits(self) -> Optional[bool]:
        return None if self.device_bytes is None else self.total <= self.device_bytes

    def lines(self) -> list:
        out = [f"memory plan per device, mesh {self.mesh} ({self.source})", self.remat]
        width = max(len(r.item) for r in self.rows)
        out += [f"  {r.item:<{width}}  {gib(r.bytes):>12}  {r.how}" for r in self.rows]
        out.append(f"  {'total':<{width}}  {gib(self.total):>12}")
        if self.device_bytes is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            out.append(f"{verdict}: {gib(self.total)} of {gib(self.device_bytes)} per device ({self.device_source}; "
                       f"{100 * self.total / self.device_bytes:.0f}%)")
        return out


# ------------------------------------------------------------------------------------ inputs


def resolve_for_plan(config_name, overrides):
    """``resolve`` for a plan: every check of a launch but the inputs a plan does not read: the
    data files and, for a preset, the checkpoint and tokenizer (the preset gives the shapes), so
    ``--config qwen2_5_7b_gsm8k --plan`` answers before its FILL IN keys are filled in. Pure
    Python, like ``resolve``."""
    cfg, prov = resolve_run(config_name, overrides, validate=False)
    d, m = cfg.data, cfg.model
    unread = "(not read by --plan)"
    if d.dataset in ("gsm8k", "local") and not d.path and not d.train_files:
        d = dataclasses.replace(d, path=unread)
    if m.tokenizer is None and m.path is None:
        m = dataclasses.replace(m, tokenizer=unread)
    validate(dataclasses.replace(cfg, data=d, model=m))
    return cfg, prov


def model_config_for(cfg):
    """The policy's :class:`~rljax.models.ModelConfig` without weights: ``model.path``'s
    ``config.json``, else the preset with its ``model.*`` overrides and the tokenizer's
    vocabulary when ``model.tokenizer`` names one (as a run sizes it)."""
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    from rljax.models.config import get_config  # JAX: once the launcher set up the devices
    from rljax.models.hf import config_from_hf  # JAX: once the launcher set up the devices

    m = cfg.model
    if m.path:
        file = os.path.join(os.path.expanduser(m.path), "config.json")
        try:
            with open(file) as fh:
                hf = json.load(fh)
        except (OSError, ValueError) as e:  # a plan reads the shapes only: config.json, no weights
            raise ConfigError(f"model.path={m.path!r}: cannot read {file} ({type(e).__name__}); the plan needs a local "
                              "Hugging Face checkpoint's config.json, or no model.path (the preset's shapes)") from None
        base = config_from_hf(hf, dtype=m.dtype)
        return base.replace(scan_layers=m.scan_layers)
    base = apply_model_overrides(get_config(m.name), m)
    over = dict(dtype=m.dtype, param_dtype=m.param_dtype, scan_layers=m.scan_layers)
    if m.tokenizer not in (None, "char"):
        # JAX and model code: imported when a plan runs, after the launcher set up the devices
        from rljax.trainer.build import tokenizer_for  # JAX: once the launcher set up the devices

        over["vocab_size"] = tokenizer_for(cfg).vocab_size
    return base.replace(**over)


def _local(tree) -> int:
    """Bytes of device 0's shards of a tree of sharded ``ShapeDtypeStruct`` (or arrays)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def _abstract(shapes, shardings):
    import jax

    return jax.tree.map(lambda s, sd: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sd), shapes, shardings)


@dataclasses.dataclass
class Learner:
    """The actor's abstract train state on a mesh and the sizes the plan reads from it."""

    graphdef: object
    state: object  # TrainState of ShapeDtypeStructs with shardings
    params: int
    trainable: int
    opt: int


def abstract_learner(cfg, mc, mesh, optimizer) -> Learner:
    """The actor's train state as sharded ``ShapeDtypeStruct`` (LoRA: a frozen base and float32
    adapters, as the run builds them); AdamW's moments take the trainable leaves' shardings."""
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from rljax.models import functional as F, lora as L  # JAX: once the launcher set up the devices
    from rljax.trainer.step import init_state  # JAX: once the launcher set up the devices

    graphdef, shapes = F.abstract_params(mc)
    params = _abstract(shapes, F.param_shardings(mc, mesh))
    lc = cfg.actor.lora
    train = params
    if lc.rank > 0:
        lcfg = L.LoRAConfig(rank=lc.rank, alpha=lc.alpha, target_modules=tuple(lc.target_modules),
                            dropout=lc.dropout, modules_to_save=tuple(lc.modules_to_save))
        train = _abstract(L.abstract_adapters(mc, lcfg), L.adapter_shardings(mc, lcfg, mesh))
        params = L.LoRAParams(base=params, adapters=train, config=lcfg)
    state = jax.eval_shape(lambda p: init_state(p, optimizer), params)
    rep = NamedSharding(mesh, PartitionSpec())
    moments = iter(jax.tree.leaves(train) * 2)
    opt = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep if x.ndim == 0 else
                                                      next(moments).sharding), state.opt_state)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    state = state.replace(params=params, opt_state=opt, step=scalar, skipped=scalar)
    return Learner(graphdef=graphdef, state=state, params=_local(params), trainable=_local(train), opt=_local(opt))


def update_batch(cfg, mesh, sizes) -> dict:
    """The update's batch fields (``rljax.trainer.stages.actor_batch``) as sharded ``ShapeDtypeStruct``."""
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from rljax.sharding import batch_spec  # JAX: once the launcher set up the devices

    b = sizes.trajectories_per_step
    t = sizes.learner_response_length
    width = sizes.learner_prompt_length + t

    def field(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, batch_spec(shape, mesh)))

    out = {"input_ids": field((b, width), jnp.int32), "attention_mask": field((b, width), jnp.bool_),
           "positions": field((b, width), jnp.int32)}
    names = ["loss_mask", "advantages", "old_logp"]
    names += ["ref_logp"] if cfg.actor.use_kl_loss else []
    names += ["rollout_is_weights"] if cfg.rollout.correction != "none" else []
    out.update({k: field((b, t), jnp.float32) for k in names})
    return out


def compiled_update(cfg, mc, mesh, sizes, learner: Learner, optimizer) -> dict:
    """``compiled.memory_analysis()`` of the actor update on ``mesh`` (abstract shapes)."""
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from rljax.trainer.build import step_config_for  # JAX: once the launcher set up the devices
    from rljax.trainer.step import make_train_step  # JAX: once the launcher set up the devices

    step = make_train_step(learner.graphdef, optimizer, step_config_for(cfg, sizes, on_policy=False), mesh=mesh)
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, PartitionSpec()))
    m = step.lower(learner.state, update_batch(cfg, mesh, sizes), key).compile().memory_analysis()
    d = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, alias=m.alias_size_in_bytes,
             temp=m.temp_size_in_bytes)
    d["peak"] = d["argument"] + d["output"] - d["alias"] + d["temp"]
    return d


# ------------------------------------------------------------------------------------ the plan


def cpu_bf16_note(mc, mesh) -> str:
    """The caveat of XLA:CPU's analysis of a bfloat16 model ('' otherwise): XLA:CPU computes
    bfloat16 dots in float32 and keeps float32 copies of loop-invariant bfloat16 arrays (the
    layers' weight shards, the saved layer inputs, a gathered frozen lm_head: ~5 GiB per device
    for the 7B GSM8K config with a bfloat16 LoRA base, docs/benchmarks/memory.md), which an
    accelerator computing in bfloat16 need not make."""
    import jax.numpy as jnp

    bf16 = jnp.dtype(jnp.bfloat16) in (jnp.dtype(mc.jnp_dtype), jnp.dtype(mc.jnp_param_dtype))
    if not bf16 or mesh.devices.flat[0].platform != "cpu":
        return ""
    return "; XLA:CPU keeps float32 copies of bfloat16 arrays: on the safe side for a bfloat16 accelerator"


def _remat(cfg, mc, mesh, device_bytes):
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    from rljax.models import remat as R  # JAX: once the launcher set up the devices

    return R.for_run(cfg, mc, mesh, device_bytes=device_bytes)


def activation_formula(cfg, mc, mesh, sizes, choice) -> int:
    """The ledger's estimate of the update's saved activations per device (one micro-batch)."""
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    from rljax.models import remat as R  # JAX: once the launcher set up the devices
    from rljax.sharding import data_shards  # JAX: once the launcher set up the devices

    shape = dict(mesh.shape)
    sp, tp = shape.get("sp", 1), shape.get("tp", 1)
    rows = math.ceil(sizes.micro_batch_trajectories / data_shards(mesh))
    seq = sizes.learner_prompt_length + sizes.learner_response_length
    if choice.remat:
        return R.remat_bytes(mc.replace(remat=True), rows, seq, sp=sp, tp=tp, policy=choice.policy)
    return R.activation_bytes(mc, rows, seq, sp=sp, tp=tp)


def gathered_bytes(mc, mesh) -> int:
    """What the fsdp gathers hold at once per device (formula path): two layers' weights (the
    layer the forward or the backward is in, and the next one's gather in flight) and the
    unembedding, which the log-probs read whole; each gathered over ``fsdp`` only (``tp`` splits
    stay), at the larger of the parameter and compute dtype's width (XLA may gather before or
    after the cast)."""
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    import jax
    import jax.numpy as jnp

    from rljax.models import functional as F  # JAX: once the launcher set up the devices

    fsdp = dict(mesh.shape).get("fsdp", 1)
    width = max(jnp.dtype(mc.jnp_dtype).itemsize, jnp.dtype(mc.jnp_param_dtype).itemsize)
    _, shapes = F.abstract_params(mc)
    shardings = F.param_shardings(mc, mesh)

    def gathered(tree, sharding_tree) -> int:
        total = 0
        for x, sd in zip(jax.tree.leaves(tree), jax.tree.leaves(sharding_tree)):
            split = any(a == "fsdp" or (isinstance(a, tuple) and "fsdp" in a) for a in sd.spec)
            total += math.prod(sd.shard_shape(x.shape)) * (fsdp if split else 1) * width
        return total

    unembed = "embed" if mc.tie_embeddings else "lm_head"
    return 2 * gathered(shapes["layers"], shardings["layers"]) // mc.num_layers + gathered(shapes[unembed],
                                                                                          shardings[unembed])


def sampler_rows(cfg, mc, devices) -> list:
    """The sampler's weights (its own mesh: ``rollout.tp`` per replica) and KV cache per device."""
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    import jax
    import jax.numpy as jnp

    from rljax.models import functional as F  # JAX: once the launcher set up the devices
    from rljax.rollout.mesh import kv_heads_note, sampler_mesh  # JAX: once the launcher set up the devices
    from rljax.sharding import kv_cache_sharding  # JAX: once the launcher set up the devices

    r, d = cfg.rollout, cfg.data
    mesh = sampler_mesh(r.tp, devices)
    _, shapes = F.abstract_params(mc)
    weights = _local(_abstract(shapes, F.param_shardings(mc, mesh)))
    context = d.max_prompt_length + (d.max_response_length if cfg.env.function is not None else 0)
    slots = r.max_slots or d.train_batch_size * r.n
    shape = (mc.num_layers, slots, context + d.max_response_length, mc.num_kv_heads, mc.head_dim)
    local = kv_cache_sharding(shape, mesh).shard_shape(shape)
    kv = 2 * math.prod(local) * jnp.dtype(mc.jnp_dtype).itemsize
    del jax
    return [Row("sampler weights", weights, f"its own mesh dp{len(devices) // r.tp},tp{r.tp}; the weight sync "
                                            "reshards into it"),
            Row("sampler KV cache", kv, f"{slots} slots x {shape[2]} tokens, {mc.num_layers} layers, k and v, "
                                        f"local [slots, kv heads] {local[1]} x {local[3]}"
                                        + (f"; {note[len('rollout: '):]}" if (note := kv_heads_note(mc.num_kv_heads, r.tp))
                                           else ""))]


def plan(cfg, mesh, *, device_bytes: Optional[int], device_source: str = "--device-memory",
         compile: bool = True, sampler_devices=None) -> Plan:
    """The per-device plan of ``cfg`` on the learner ``mesh`` (see the module docstring)."""
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    from rljax.trainer.build import optimizer_for  # JAX: once the launcher set up the devices

    mc = model_config_for(cfg)
    choice = _remat(cfg, mc, mesh, device_bytes)
    mc = mc.replace(remat=choice.remat, remat_policy=choice.policy)
    sizes = derive(cfg, sp=dict(mesh.shape).get("sp", 1))
    optimizer = optimizer_for(cfg.actor.optim, cfg.actor.grad_clip, max(sizes.optimizer_updates, 1))
    learner = abstract_learner(cfg, mc, mesh, optimizer)
    measured, source = None, "formulas: the memory ledger's (rljax.models.remat)"
    if compile:
        try:
            measured = compiled_update(cfg, mc, mesh, sizes, learner, optimizer)
            source = ("XLA: the update compiled with abstract shapes, compiled.memory_analysis()"
                      + cpu_bf16_note(mc, mesh))
        except Exception as e:  # the plan still answers, from the formulas, and says why
            source += f"; the update did not compile here ({type(e).__name__}: {str(e).splitlines()[0][:160]})"
    rows = [Row("parameters", learner.params, "shards of the learner layout"),
            Row("gradients", learner.trainable, "the trainable parameters' shards")]
    rows.append(Row("optimizer state", learner.opt, "AdamW mu, nu (+ counters)"))
    if measured is not None:
        rest = measured["peak"] - learner.params - learner.opt
        rows.append(Row("activations", max(rest - learner.trainable, 0),
                        f"XLA temporaries {gib(measured['temp'])} less the gradients, + the batch and outputs"))
    else:
        rows.append(Row("activations", activation_formula(cfg, mc, mesh, sizes, choice),
                        "saved activations of one micro-batch (ledger formula)"))
        rows.append(Row("update temporaries", 2 * learner.trainable,
                        "a micro-batch's gradients beside the accumulator, and AdamW's update"))
        if dict(mesh.shape).get("fsdp", 1) > 1:
            rows.append(Row("gathered weights", gathered_bytes(mc, mesh),
                            "fsdp: two layers gathered (forward, backward) and the whole unembedding"))
    full = _local(_abstract(*_full_params(mc, mesh)))
    if (cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and cfg.actor.lora.rank == 0:
        rows.append(Row("reference model", full, "a copy of the parameters, same layout"))
    if cfg.algorithm.adv_estimator == "gae":
        rows.append(Row("critic state", 3 * full, "parameters + AdamW mu, nu, same layout (its update runs apart)"))
    learner_total = sum(r.bytes for r in rows)
    srows = sampler_rows(cfg, mc, sampler_devices if sampler_devices is not None else list(mesh.devices.flat))
    rows += srows
    total = sum(r.bytes for r in rows)
    if cfg.rollout.placement == "disaggregated":  # learner and sampler on different devices: the larger
        total = max(learner_total, sum(r.bytes for r in srows))
    spec = ",".join(f"{a}{n}" for a, n in dict(mesh.shape).items() if n > 1) or "dp1"
    return Plan(mesh=spec, rows=tuple(rows), total=total, source=source, remat=choice.line(),
                device_bytes=device_bytes, device_source=device_source)


def _full_params(mc, mesh):
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    from rljax.models import functional as F  # JAX: once the launcher set up the devices

    _, shapes = F.abstract_params(mc)
    return shapes, F.param_shardings(mc, mesh)


# ------------------------------------------------------------------------------------ suggestions


def _fsdp_spec(sizes: dict) -> Optional[str]:
    """The same devices with ``dp`` moved into ``fsdp`` (tp, sp kept), or None when dp is 1."""
    if sizes.get("dp", 1) == 1:
        return None
    out = {"fsdp": sizes["dp"] * sizes.get("fsdp", 1), "tp": sizes.get("tp", 1), "sp": sizes.get("sp", 1)}
    return ",".join(f"{a}{n}" for a, n in out.items() if n > 1)


def candidates(cfg, sizes: dict, shards: int) -> list:
    """``(description, overrides)`` from the smallest change up (see the module docstring)."""
    a = cfg.actor
    singles = []
    if cfg.model.remat is not True and str(cfg.model.remat) != "true":
        singles.append(("model.remat=true", ["model.remat=true"]))
    micro = a.ppo_micro_batch_size or a.ppo_mini_batch_size * cfg.rollout.n
    m = micro // 2
    while m >= shards and m % shards == 0:
        singles.append((f"actor.ppo_micro_batch_size={m}", [f"actor.ppo_micro_batch_size={m}"]))
        m //= 2
    fsdp = _fsdp_spec(sizes)
    mesh = [(f"--mesh={fsdp}", [f"trainer.mesh={fsdp}"])] if fsdp else []
    lora = [] if a.lora.rank > 0 else [("actor.lora.rank=8", ["actor.lora.rank=8"])]
    pairs = [(f"{x[0]} and {y[0]}", x[1] + y[1]) for x in mesh for y in singles + lora]
    return singles + mesh + lora + pairs


XLA_CANDIDATES = 3  # at most this many candidates compiled per plan (minutes each at 7B)


def suggest(cfg, mesh, device_bytes: int, reconfigure: Callable, devices, sampler_devices=None, *,
            compile: bool = False, max_compiles: int = XLA_CANDIDATES) -> tuple:
    """``(found, rejected)``: ``found`` is ``(change, plan)`` for the first of :func:`candidates`
    that fits, or None; ``rejected`` lists ``(change, formula plan, XLA plan)`` for those the
    formulas accepted and XLA did not.

    Each candidate is planned by the formulas first (cheap). ``compile`` (the run's own plan was
    measured by XLA): a candidate the formulas accept is then compiled like the plan (abstract
    shapes) and named only when XLA's total fits too; at most ``max_compiles`` compiles, in the
    order of :func:`candidates`. A candidate whose update does not compile here is judged by its
    formulas (its plan's source says so)."""
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    from rljax.sharding import data_shards, make_mesh, mesh_sizes  # JAX: once the launcher set up the devices

    rejected, compiles = [], 0
    for text, overrides in candidates(cfg, mesh_sizes(mesh), data_shards(mesh)):
        try:
            new = reconfigure(overrides)
        except (ConfigError, ValueError):
            continue
        new_mesh = make_mesh(new.trainer.mesh, devices) if new.trainer.mesh else mesh
        p = plan(new, new_mesh, device_bytes=device_bytes, compile=False, sampler_devices=sampler_devices)
        if not p.fits:
            continue
        if not compile:
            return (text, p), rejected
        if compiles >= max_compiles:
            break
        compiles += 1
        q = plan(new, new_mesh, device_bytes=device_bytes, compile=True, sampler_devices=sampler_devices)
        if q.fits:
            return (text, q), rejected
        rejected.append((text, p, q))
    return None, rejected


def run_plan(cfg, placement, *, device_bytes: Optional[int], reconfigure: Callable, echo: Callable = print) -> int:
    """Prints the plan of ``cfg`` on ``placement``'s devices (:class:`rljax.sharding.placement.Placement`)
    and, when it does not fit, the smallest change that would; 0 fits, 1 not. ``device_bytes``
    None: the learner's first device's memory (:func:`rljax.models.remat.device_memory_bytes`)."""
    # JAX and model code: imported when a plan runs, after the launcher set up the devices
    import jax

    from rljax.models.remat import device_memory_bytes  # JAX: once the launcher set up the devices
    from rljax.sharding import make_mesh  # JAX: once the launcher set up the devices

    jax.config.update("jax_enable_compilation_cache", False)  # the plan writes nothing
    devices = list(placement.learner)
    mesh = make_mesh(placement.mesh_spec, devices)
    source = "--device-memory"
    if device_bytes is None:
        device_bytes, source = device_memory_bytes(devices[0])
    p = plan(cfg, mesh, device_bytes=device_bytes, device_source=source, sampler_devices=list(placement.sampler))
    for line in p.lines():
        echo(line)
    if p.fits is None:
        echo("no device memory known: pass --device-memory (e.g. 80GiB) to say whether it fits")
        return 0
    if p.fits:
        return 0
    xla = p.source.startswith("XLA")
    found, rejected = suggest(cfg, mesh, p.device_bytes, reconfigure, devices, list(placement.sampler), compile=xla)
    for text, f, x in rejected:
        echo(f"not named: {text}: the formulas give {gib(f.total)} (fits), XLA {gib(x.total)} (does not)")
    if found is None:
        if rejected:
            echo(f"no change that XLA confirms fits within {XLA_CANDIDATES} compiles (of those the formulas accept, "
                 "smallest first): use more devices or a larger tp, or plan a change above with another")
        else:
            echo("no single change tried fits (remat, a smaller micro-batch, dp -> fsdp, LoRA, or the mesh change "
                 "with one of the others): use more devices or a larger tp")
    else:
        text, q = found
        judge = q.source.split(";")[0]
        if not xla:
            judge += "; the plan itself did not compile here, so the change is judged by the formulas only"
        elif not q.source.startswith("XLA"):
            judge += "; this change's update did not compile here: judged by the formulas only"
        echo(f"smallest change that fits: {text} -> {gib(q.total)} per device ({judge})")
    return 1
