"""``python -m rljax.launch [--mesh=dp8]``: device setup, then the job.

Until the end-to-end GRPO loop lands (issue 6) the job is a mesh self-check: one GRPO
actor update of the tiny policy on a synthetic batch, computed on the requested mesh and
on a single device, compared leaf by leaf. It exercises the model, the fused log-prob, the
losses and the sharded train step exactly as training will.

Usage errors (a bad mesh spec, a device-count mismatch on an accelerator) print one line
and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_HOST_COUNT_FLAG = "--xla_force_host_platform_device_count"


class UsageError(Exception):
    """A command-line mistake: reported in one line, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rljax.launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default="dp8", help="mesh spec over dp/tp/sp, e.g. dp8 or dp2,tp2,sp2 (default dp8)")
    p.add_argument("--seed", type=int, default=0)
    return p


def _accelerator_present() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p in platforms for p in ("gpu", "cuda", "rocm", "tpu"))
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))


def setup_devices(spec: str) -> dict:
    """Parse ``spec``; on a CPU host, create the devices it needs before JAX initialises."""
    from rljax.sharding.mesh import parse_mesh, spec_device_count

    try:
        need = spec_device_count(spec)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not _accelerator_present():
        flags = os.environ.get("XLA_FLAGS", "")
        if _HOST_COUNT_FLAG not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {_HOST_COUNT_FLAG}={need}".strip()
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
            print(f"rljax: CPU host: created {need} virtual CPU devices for mesh {spec} ({_HOST_COUNT_FLAG}={need})")
    import jax

    try:
        return parse_mesh(spec, jax.devices())
    except ValueError as e:
        raise UsageError(str(e)) from None


def self_check(spec: str, seed: int) -> dict:
    """One GRPO update of the tiny policy on ``spec`` and on one device; returns the comparison."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from rljax import loss as rl
    from rljax.models import functional as F
    from rljax.models.config import get_config
    from rljax.sharding import make_mesh, topology
    from rljax.trainer import ActorConfig, init_state, make_logprob_fn, make_train_step

    config = get_config("tiny")
    mesh = make_mesh(spec)
    sizes = dict(mesh.shape)
    groups, n, prompt_len, response_len = 4, 4, 16, 16
    b = groups * n
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, config.vocab_size, (b, prompt_len + response_len)).astype(np.int32)
    lengths = rng.integers(1, response_len + 1, b)
    resp_mask = np.arange(response_len)[None] < lengths[:, None]
    attn = np.concatenate([np.ones((b, prompt_len), bool), resp_mask], 1)
    scores = rng.integers(0, 2, b).astype(np.float32)
    group_ids = np.repeat(np.arange(groups), n)
    adv = rl.grpo_advantages(jnp.asarray(scores), jnp.asarray(group_ids), num_groups=groups)
    batch = {
        "input_ids": jnp.asarray(np.where(attn, ids, 0)),
        "attention_mask": jnp.asarray(attn),
        "positions": F.default_positions(jnp.asarray(attn)),
        "loss_mask": jnp.asarray(resp_mask, jnp.float32),
        "advantages": jnp.broadcast_to(adv[:, None], (b, response_len)),
    }
    graphdef, params = F.init_params(config, seed=seed)
    batch["old_logp"] = make_logprob_fn(graphdef, response_len=response_len, temperature=1.0)(params, batch)[0]
    cfg = ActorConfig(ppo_mini_batch_size=b, ppo_micro_batch_size=max(sizes["dp"], b // 2))
    opt = optax.sgd(1.0)

    def update(p, m):
        step = make_train_step(graphdef, opt, cfg, mesh=m)
        t = time.perf_counter()
        state, metrics = step(init_state(p, opt), batch, jax.random.key(seed))
        jax.block_until_ready(state)
        return state, metrics, time.perf_counter() - t

    single, m1, t1 = update(jax.tree.map(jnp.copy, params), None)
    sharded, m2, t2 = update(jax.device_put(params, F.param_shardings(config, mesh)), mesh)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(single.params), jax.tree.leaves(sharded.params)))
    return {
        "topology": topology(mesh),
        "loss_single": float(m1["loss"]),
        "loss_mesh": float(m2["loss"]),
        "grad_norm_single": float(m1["grad_norm"]),
        "grad_norm_mesh": float(m2["grad_norm"]),
        "max_abs_param_diff": diff,
        "seconds_single": round(t1, 2),
        "seconds_mesh": round(t2, 2),
    }


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        setup_devices(args.mesh)
    except UsageError as e:
        print(f"rljax.launch: error: {e}", file=sys.stderr)
        return 2
    report = self_check(args.mesh, args.seed)
    topo = report["topology"]
    print(f"mesh {args.mesh}: {topo['mesh']} on {topo['world_size']} {topo['platform']} device(s); "
          f"actor_dp = world_size / (tp * sp) = {topo['world_size']} / "
          f"({topo['mesh']['tp']} * {topo['mesh']['sp']}) = {topo['actor_dp']}")
    print(json.dumps({k: v for k, v in report.items() if k != "topology"}, indent=2))
    ok = report["max_abs_param_diff"] <= 1e-4 and abs(report["loss_single"] - report["loss_mesh"]) <= 1e-4
    print("self-check: " + ("PASS — the mesh gives the single-device update" if ok else "FAIL — the mesh differs"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
