"""Per-device training state and update memory on dp8 vs fsdp meshes, side by side (compile only).

Compiles (never runs) rljax's update step (``rljax.plan.compiled_update``: the fused log-prob,
the PPO loss, micro-batch gradient accumulation, AdamW) for a GSM8K config's model on 8
simulated CPU devices with abstract shapes -- nothing is downloaded or allocated -- and prints
per device: the training state (parameters + AdamW moments: the update's arguments less its
batch, from ``compiled.memory_analysis()``), the gradients (the trainable parameters' shards,
inside the temporaries), the temporaries, the update's peak, and each mesh's state / dp8's.
Expected: the state falls as 1/fsdp; temporaries as the batch split (the same on every
8-device mesh) plus the layer being gathered.

    python bench/fsdp_memory.py                                   # 0.5B, 1.5B, 7B x dp8 / dp4,fsdp2 / dp2,fsdp4 / fsdp8
    python bench/fsdp_memory.py --configs qwen2_5_7b_gsm8k --meshes "dp8;fsdp8"
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from rljax import plan as P  # noqa: E402
from rljax import sharding as sh  # noqa: E402
from rljax.config import derive  # noqa: E402
from rljax.trainer.build import optimizer_for  # noqa: E402


def measure(cfg, spec: str) -> dict:
    mesh = sh.make_mesh(spec)
    mc = P.model_config_for(cfg)
    mc = mc.replace(remat=bool(cfg.model.remat is True or cfg.model.remat == "true"))
    sizes = derive(cfg, sp=sh.mesh_sizes(mesh)["sp"])
    opt = optimizer_for(cfg.actor.optim, cfg.actor.grad_clip, max(sizes.optimizer_updates, 1))
    learner = P.abstract_learner(cfg, mc, mesh, opt)
    t0 = time.perf_counter()
    m = P.compiled_update(cfg, mc, mesh, sizes, learner, opt)
    batch = P._local(P.update_batch(cfg, mesh, sizes))
    return dict(state=m["argument"] - batch, exact=learner.params + learner.opt, grads=learner.trainable,
                temp=m["temp"], peak=m["peak"], compile_s=time.perf_counter() - t0, params=mc.num_params())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="qwen2_5_0_5b_gsm8k,qwen2_5_1_5b_gsm8k,qwen2_5_7b_gsm8k")
    ap.add_argument("--meshes", default="dp8;dp4,fsdp2;dp2,fsdp4;fsdp8", help="';'-separated; the first is the base")
    ap.add_argument("overrides", nargs="*", help="key=value for every config (e.g. data.train_batch_size=64)")
    args = ap.parse_args()
    meshes = [m.strip() for m in args.meshes.split(";") if m.strip()]
    print(f"update step of each config (its batch, micro-batch, lengths, param/compute dtypes, remat as the file "
          f"says); jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices; GiB per device")
    gib = lambda b: f"{b / 2**30:9.2f}"  # noqa: E731
    print(f"{'config':<22}{'mesh':<12}{'state':>9}{'grads':>9}{'temp':>9}{'peak':>9}{'state/' + meshes[0]:>12}"
          f"{'compile s':>11}")
    for name in [c for c in args.configs.split(",") if c]:
        base = None
        for spec in meshes:
            cfg, _ = P.resolve_for_plan(name, [*args.overrides, f"trainer.mesh={spec}"])
            r = measure(cfg, spec)
            base = base or r["state"]
            print(f"{name:<22}{spec:<12}{gib(r['state'])}{gib(r['grads'])}{gib(r['temp'])}{gib(r['peak'])}"
                  f"{r['state'] / base:>12.3f}{r['compile_s']:>11.1f}", flush=True)


if __name__ == "__main__":
    main()
