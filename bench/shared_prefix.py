"""The shared-prefix learner (``actor.shared_prefix``) against the unshared packed layout, side by side.

GRPO batches of ``n`` responses per prompt with GSM8K-like lengths (prompts lognormal around
190 tokens, responses lognormal around 250), the same trajectories for every ``n`` (``--batch``
trajectories: ``batch / n`` prompts). For each ``n`` both layouts of the packed learner run in
one process on the same batch, mini-batches and token budget: the actor update
(:class:`rljax.trainer.step.PackedTrainStep`, host packing included, as the trainer pays it)
and the old-log-prob pass (:class:`rljax.trainer.step.PackedLogprob`). Columns: median wall
time over interleaved rounds (layout after layout, so load changes hit both alike), the
speed-up of shared over unshared, the compiled program's temporaries
(``memory_analysis().temp_size_in_bytes``) and their ratio, the tokens each layout lays and the
fraction sharing saved, and the token slots the passes compute (laid tokens and the padding of
the bucketed micro-batch shapes). The load average is printed with each table.

    python bench/shared_prefix.py                        # n = 4, 8, 16; ~20M model
    python bench/shared_prefix.py --n 8 --reps 3 --skip-logprob
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from rljax import models  # noqa: E402
from rljax.models import functional as F  # noqa: E402
from rljax.trainer import StepConfig, init_state  # noqa: E402
from rljax.trainer import packing as P  # noqa: E402
from rljax.trainer.step import PackedLogprob, PackedTrainStep  # noqa: E402


def group_batch(n: int, args, vocab: int, rng) -> dict:
    """``--batch`` trajectories, ``n`` per prompt: left-padded prompts (equal within a group),
    right-padded responses, advantages and old log-probs as a GRPO step has them."""
    s, t, b = args.max_prompt, args.max_response, args.batch
    groups = b // n
    plen = np.repeat(np.clip(rng.lognormal(np.log(190), 0.1, groups), 8, s).astype(int), n)
    rlen = np.clip(rng.lognormal(np.log(250), 0.35, b), 4, t).astype(int)
    attn = np.concatenate([np.arange(s)[None] >= (s - plen)[:, None], np.arange(t)[None] < rlen[:, None]], 1)
    prompts = np.repeat(rng.integers(3, vocab, (groups, s)), n, axis=0)
    ids = np.where(attn, np.concatenate([prompts, rng.integers(3, vocab, (b, t))], 1), 0).astype(np.int32)
    loss_mask = (np.arange(t)[None] < rlen[:, None]).astype(np.float32)
    return {
        "input_ids": ids, "attention_mask": attn,
        "positions": np.maximum(np.cumsum(attn, 1) - 1, 0).astype(np.int32),
        "loss_mask": loss_mask,
        "advantages": (np.repeat(rng.normal(0, 1, (groups, 1)), n, 0) * loss_mask).astype(np.float32),
        "old_logp": (-np.log(vocab) + rng.normal(0, 0.1, (b, t)) * loss_mask).astype(np.float32),
    }


def rows_for(n: int, config, args, params, graphdef) -> dict:
    """Both layouts' update (and log-prob pass) for one ``n``: compiled, then timed interleaved."""
    s, t = args.max_prompt, args.max_response
    host = group_batch(n, args, config.vocab_size, np.random.default_rng(n))
    batch = {k: jnp.asarray(v) for k, v in host.items()}
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "positions")}
    opt = optax.sgd(1e-3)
    cfg = StepConfig(ppo_mini_batch_size=args.batch, ppo_micro_batch_size=args.batch, logprob_impl="chunked")
    pcfg = P.PackConfig(row_len=s + t, use_dynamic_bsz=True, max_token_len_per_device=args.token_budget)
    key = jax.random.key(0)
    runs, rows = {}, {}
    for shared in (False, True):
        name = "shared" if shared else "unshared"
        box = [init_state(jax.tree.map(jnp.copy, params), opt)]
        step = PackedTrainStep(graphdef, opt, cfg, pcfg, response_len=t, shared_prefix=shared)
        t0 = time.perf_counter()
        compiled = step.lower(box[0], batch, key).compile()
        stats = dict(step.stats)

        def run(compiled=compiled, box=box, step=step):
            out = compiled(box[0], batch, step._packed(batch, key))
            box[0] = out[0]
            return out[1]

        runs[("update", name)] = run
        rows[("update", name)] = dict(temp=compiled.memory_analysis().temp_size_in_bytes, laid=stats["laid_tokens"],
                                      real=stats["real_tokens"], slots=stats["packed_tokens"],
                                      compile_s=time.perf_counter() - t0)
        if args.skip_logprob:
            continue
        fn = PackedLogprob(graphdef, pcfg, response_len=t, impl="chunked", shared_prefix=shared)
        packed, b = fn._packed(inputs)
        lp = fn._fn.lower(params, packed, b).compile()
        runs[("logprob", name)] = lambda fn=fn, lp=lp: lp(params, fn._packed(inputs)[0])
        rows[("logprob", name)] = dict(temp=lp.memory_analysis().temp_size_in_bytes, laid=fn.stats["laid_tokens"],
                                       real=fn.stats["real_tokens"], slots=fn.stats["packed_tokens"],
                                       compile_s=0.0)
    wall = {k: [] for k in runs}
    for r in range(args.reps + 1):  # round 0 warms up (the donated state's layout settles)
        for k, run in runs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            if r:
                wall[k].append(time.perf_counter() - t0)
    for k in runs:
        rows[k]["time"] = float(np.median(wall[k]))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", default="4,8,16", help="responses per prompt, comma-separated")
    ap.add_argument("--batch", type=int, default=32, help="trajectories per step (a multiple of every n)")
    ap.add_argument("--token-budget", type=int, default=4096, help="tokens per device per packed micro-batch")
    ap.add_argument("--max-prompt", type=int, default=256)
    ap.add_argument("--max-response", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=3, help="timed rounds (layouts interleaved)")
    ap.add_argument("--skip-logprob", action="store_true", help="no old-log-prob pass rows")
    args = ap.parse_args()
    config = models.ModelConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
        num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=max(args.hidden // 128, 1),
        max_position_embeddings=8192)
    print(f"model: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_heads} heads, "
          f"{config.num_kv_heads} kv heads, vocab {config.vocab_size}: {config.num_params() / 1e6:.1f}M params "
          f"(float32); {args.batch} trajectories, one mini-batch, {args.token_budget} tokens per micro-batch; "
          f"jax {jax.__version__}, {jax.devices()[0].platform}", flush=True)
    graphdef, params = F.init_params(config, seed=0)
    for n in (int(x) for x in args.n.split(",")):
        if args.batch % n:
            raise SystemExit(f"--batch {args.batch} is not a multiple of n={n}")
        rows = rows_for(n, config, args, params, graphdef)
        print(f"\nn={n}: {args.batch // n} prompts x {n}; median of {args.reps} interleaved rounds; "
              f"load {os.getloadavg()[0]:.1f} {os.getloadavg()[1]:.1f}")
        print(f"{'pass':<9}{'layout':<10}{'wall s':>9}{'speedup':>9}{'temp MiB':>10}{'temp x':>8}{'tokens':>9}"
              f"{'saved':>8}{'slots':>8}{'compile s':>11}")
        for (kind, name), r in rows.items():
            base = rows[(kind, "unshared")]
            print(f"{kind:<9}{name:<10}{r['time']:>9.3f}{base['time'] / r['time']:>9.2f}{r['temp'] / 2**20:>10.1f}"
                  f"{r['temp'] / base['temp']:>8.2f}{r['laid']:>9}{1 - r['laid'] / r['real']:>8.0%}{r['slots']:>8}"
                  f"{r['compile_s']:>11.1f}", flush=True)


if __name__ == "__main__":
    main()
