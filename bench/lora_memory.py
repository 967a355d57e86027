"""Per-device memory of the actor update: full fine-tuning vs LoRA, side by side.

Compiles (never runs) rljax's jitted update step (``rljax.trainer.make_train_step``: fused
log-prob, PPO loss, micro-batch gradient accumulation, AdamW) for the ``qwen2.5-0.5b`` and
``qwen2.5-1.5b`` presets with abstract shapes -- nothing is downloaded or allocated -- on 8
simulated CPU devices, and prints per-device bytes:

* params, opt state: the state's shards on one device (what ``memory_analysis()``
  counts in the arguments; the ``args`` column is its total, batch included);
* grads: the gradient accumulator's shards (float32 for LoRA adapters; the parameter
  dtype for full fine-tuning) -- it lives inside ``temp``;
* temp: ``compiled.memory_analysis().temp_size_in_bytes`` (activations, gradients,
  optimizer temporaries).

Full fine-tuning keeps float32 parameters (as ``configs/qwen2_5_0_5b_gsm8k.yaml``); LoRA
keeps the frozen base in bfloat16 and float32 adapters on every projection. Compute is
bfloat16 with per-layer remat in both.

    python bench/lora_memory.py                       # both presets, dp8 and dp2,tp2,sp2, full / r8 / r64
    python bench/lora_memory.py --presets qwen2.5-0.5b --meshes dp8 --ranks 8
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from rljax import sharding as sh  # noqa: E402
from rljax.models import functional as F  # noqa: E402
from rljax.models import lora as L  # noqa: E402
from rljax.models.config import get_config  # noqa: E402
from rljax.trainer import StepConfig, init_state, make_optimizer, make_train_step  # noqa: E402


def _abstract(shapes, shardings):
    return jax.tree.map(lambda s, sd: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sd), shapes, shardings)


def _local_bytes(tree) -> int:
    """Bytes of device 0's shards of a tree of sharded ShapeDtypeStructs."""
    total = 0
    for x in jax.tree.leaves(tree):
        shard = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shard) * jnp.dtype(x.dtype).itemsize
    return total


def measure(preset: str, spec: str, rank: int, *, batch: int, micro: int, prompt: int, response: int) -> dict:
    mesh = sh.make_mesh(spec)
    full = rank == 0
    config = get_config(preset, dtype="bfloat16", param_dtype="float32" if full else "bfloat16", remat=True)
    graphdef, shapes = F.abstract_params(config)
    params = _abstract(shapes, F.param_shardings(config, mesh))
    if not full:
        lcfg = L.LoRAConfig(rank=rank, alpha=2.0 * rank)
        adapters = _abstract(L.abstract_adapters(config, lcfg), L.adapter_shardings(config, lcfg, mesh))
        params = L.LoRAParams(base=params, adapters=adapters, config=lcfg)
    opt = make_optimizer(lr=1e-5, grad_clip=1.0)
    state = jax.eval_shape(lambda p: init_state(p, opt), params)
    rep = NamedSharding(mesh, PartitionSpec())
    train = params if full else params.adapters
    # AdamW's mu and nu have the trainable tree's structure and take its shardings; counters are replicated
    moments = iter(jax.tree.leaves(train) * 2)
    opt_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                            sharding=rep if x.ndim == 0 else next(moments).sharding),
                             state.opt_state)
    scalar = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
    state = state.replace(params=params, opt_state=opt_state, step=scalar, skipped=scalar)
    seq = prompt + response

    def field(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, sh.batch_spec(shape, mesh)))

    data = {"input_ids": field((batch, seq), jnp.int32), "attention_mask": field((batch, seq), jnp.bool_),
            "positions": field((batch, seq), jnp.int32), "loss_mask": field((batch, response), jnp.float32),
            "old_logp": field((batch, response), jnp.float32), "advantages": field((batch, response), jnp.float32)}
    cfg = StepConfig(ppo_mini_batch_size=batch, ppo_micro_batch_size=micro, logprob_impl="chunked")
    step = make_train_step(graphdef, opt, cfg, mesh=mesh)
    t0 = time.perf_counter()
    compiled = step.lower(state, data, jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep)).compile()
    m = compiled.memory_analysis()
    return dict(params=_local_bytes(params), opt=_local_bytes(opt_state), grads=_local_bytes(train), temp=m.temp_size_in_bytes,
                args=m.argument_size_in_bytes, trainable=sum(math.prod(x.shape) for x in jax.tree.leaves(train)),
                compile_s=time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--meshes", default="dp8;dp2,tp2,sp2", help="';'-separated mesh specs")
    ap.add_argument("--ranks", default="8,64", help="LoRA ranks compared with full fine-tuning")
    ap.add_argument("--batch", type=int, default=16, help="trajectories per mini-batch (one optimizer step)")
    ap.add_argument("--micro", type=int, default=8, help="trajectories per forward/backward (all devices)")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=512)
    args = ap.parse_args()
    ranks = [0] + [int(r) for r in args.ranks.split(",") if r]
    print(f"update step, mini-batch {args.batch} x (prompt {args.prompt} + response {args.response}), micro-batch "
          f"{args.micro}; AdamW; bf16 compute, remat; jax {jax.__version__}, {jax.device_count()} "
          f"{jax.devices()[0].platform} devices; MiB per device")
    mib = lambda b: f"{b / 2**20:10.1f}"  # noqa: E731
    head = f"{'preset':<14}{'mesh':<13}{'mode':<8}{'trainable':>12}{'params':>10}{'grads':>10}{'opt':>10}{'temp':>10}" \
           f"{'args':>10}{'p+o+temp':>10}{'vs full':>9}{'compile s':>10}"
    print(head)
    for preset in [p for p in args.presets.split(",") if p]:
        for spec in [m.strip() for m in args.meshes.split(";") if m.strip()]:
            base = None
            for rank in ranks:
                r = measure(preset, spec, rank, batch=args.batch, micro=args.micro, prompt=args.prompt,
                            response=args.response)
                total = r["params"] + r["opt"] + r["temp"]  # grads live inside temp
                base = base or total
                mode = "full" if rank == 0 else f"lora{rank}"
                print(f"{preset:<14}{spec:<13}{mode:<8}{r['trainable'] / 1e6:>11.2f}M{mib(r['params'])}{mib(r['grads'])}"
                      f"{mib(r['opt'])}{mib(r['temp'])}{mib(r['args'])}{mib(total)}{total / base:>9.3f}"
                      f"{r['compile_s']:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
