"""Weight-sync time per version from the learner's fsdp layout to the sampler's own layout.

For each GSM8K config: parameters randomly initialised in the learner's layout (``--mesh``,
default ``fsdp8``: every large parameter split over 8 devices) in the config's parameter dtype,
then what a weight sync does per version: ``engine.load_params`` resharding them to the
sampler's layout (``dp{8 / rollout.tp},tp{rollout.tp}``: the whole model per replica) and
copying, timed to ``block_until_ready`` (``Sampler.update_weights``' ``last_weight_sync_s``).

On this host the 8 devices are simulated CPU devices sharing one memory, and the sampler holds
``8 / rollout.tp`` copies of the model: the 0.5B and 1.5B models in float32 would need 16-25 GB
for the sampler alone. So each config is measured with the preset's shapes at a few depths
(``--layers``, the embedding and lm_head whole): the bytes the sampler receives per version are
exact (counted from its shards, extended to the preset's depth), the time is those bytes at the
median throughput of the depths measured (each the fastest of ``--repeats``: a reshard on this
shared CPU host is memory copies and first-touch page faults, and its timing is noisy).

    python bench/fsdp_weight_sync.py
    python bench/fsdp_weight_sync.py --configs qwen2_5_1_5b_gsm8k --layers 1,2,3 --repeats 5
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import gc  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rljax import plan as P  # noqa: E402
from rljax import sharding as sh  # noqa: E402
from rljax.models import functional as F  # noqa: E402
from rljax.rollout.engine import _shares_buffers  # noqa: E402
from rljax.rollout.mesh import sampler_mesh  # noqa: E402


def sync_seconds(mc, learner_mesh, rollout_tp: int, repeats: int) -> tuple[list, int]:
    """Seconds of each of ``repeats`` syncs (after one warm-up) and the bytes the sampler receives:
    ``RolloutEngine.load_params``' reshard and copy, on the sampler mesh built as the run builds it."""
    _, params = F.init_params(mc, seed=0, mesh=learner_mesh)
    target = F.param_shardings(mc, sampler_mesh(rollout_tp))
    times, received = [], 0
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        out = sh.reshard(params, target)
        out = jax.tree.map(lambda src, dst: jax.numpy.copy(dst) if _shares_buffers(src, dst) else dst, params, out)
        jax.block_until_ready(out)
        if i:
            times.append(time.perf_counter() - t0)
        received = sum(s.data.nbytes for x in jax.tree.leaves(out) for s in x.addressable_shards)
        del out
        gc.collect()
    del params
    gc.collect()
    return times, received


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="qwen2_5_0_5b_gsm8k,qwen2_5_1_5b_gsm8k")
    ap.add_argument("--mesh", default="fsdp8", help="the learner's mesh the weights start on")
    ap.add_argument("--layers", default="1,2,3", help="depths measured; the time is fitted linearly in depth")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    depths = [int(x) for x in args.layers.split(",")]
    mesh = sh.make_mesh(args.mesh)
    print(f"weight sync {args.mesh} -> sampler layout; jax {jax.__version__}, {jax.device_count()} "
          f"{jax.devices()[0].platform} devices; median of {args.repeats} after a warm-up")
    for name in [c for c in args.configs.split(",") if c]:
        cfg, _ = P.resolve_for_plan(name, [f"trainer.mesh={args.mesh}"])
        full = P.model_config_for(cfg)
        tp = cfg.rollout.tp
        rows = []
        for n in depths:
            times, received = sync_seconds(full.replace(num_layers=n), mesh, tp, args.repeats)
            rows.append((min(times), received))
            print(f"  {name:<20} {n:>2} of {full.num_layers} layers  sampler dp{8 // tp},tp{tp}  "
                  f"{received / 2**30:6.2f} GiB received  {min(times):7.3f} s (fastest; median "
                  f"{float(np.median(times)):.3f})  {received / 2**30 / min(times):5.2f} GiB/s", flush=True)
        per_layer = (rows[-1][1] - rows[0][1]) / max(depths[-1] - depths[0], 1)
        total = rows[0][1] + per_layer * (full.num_layers - depths[0])
        rate = float(np.median([r[1] / 2**30 / r[0] for r in rows]))  # GiB/s
        print(f"{name:<22} {full.num_params() / 1e9:.2f}B {np.dtype(full.jnp_param_dtype).name}, "
              f"{full.num_layers} layers: {total / 2**30:.2f} GiB received per version "
              f"({total / 8 / 2**30:.2f} per device), at {rate:.2f} GiB/s -> {total / 2**30 / rate:.1f} s per version",
              flush=True)


if __name__ == "__main__":
    main()
