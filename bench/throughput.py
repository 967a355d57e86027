"""Learner update and decode throughput on realistic length distributions, side by side.

Update step (one actor update over a batch, the same shuffled mini-batches for every row):

* ``padded``: today's layout, every trajectory in a ``[max_prompt + max_response]`` row;
* ``packed``: real tokens packed into rows with segment ids (``actor.use_remove_padding``),
  the same trajectory-count micro-batches;
* ``packed+budget+balance``: packed, micro-batches by a per-device token budget
  (``actor.use_dynamic_bsz``), rows dealt to dp shards by tokens (``trainer.balance_batch``).

Columns: median wall time of the compiled step, temporary bytes of the compiled program
(``memory_analysis()``), the fraction of processed token slots that are padding, and the
number of distinct programs a run of ``--plan-steps`` batches from the same distribution
would compile (the packed shapes are bucketed). Decode: tokens/s of the engine's
device-side decode loop (``generate_chunk`` with the layer weights sliced once, as the rollout
driver decodes; ``--slice-per-chunk``: sliced by every chunk, as this bench timed before
2 Dec 2026) with every slot at 10%, 50% and 100% of the cache capacity,
attending over the whole cache (``dense``) or up to the live length (``live``), timed in
interleaved rounds, per wall second and per second of this process's CPU time, and whether
both sampled the same greedy tokens from one random cache.

Distributions (token counts, clipped to the limits):

* ``gsm8k``: prompts lognormal around 120 (sigma 0.35), responses lognormal around 300
  (sigma 0.6; tail to 2,000);
* ``agent``: prompts lognormal around 400 (sigma 0.5); responses 75% lognormal around
  150 (sigma 0.7) and 25% around 1,200 (sigma 0.4) -- a long tail of long episodes.

    python bench/throughput.py                          # both distributions, ~20M model
    python bench/throughput.py --dist gsm8k --batch 8 --skip-decode
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from rljax import models  # noqa: E402
from rljax.models import functional as F  # noqa: E402
from rljax.sharding import make_mesh  # noqa: E402
from rljax.rollout import DecodeParams, RljaxEngine  # noqa: E402
from rljax.models.config import get_config  # noqa: E402
from rljax.trainer import StepConfig, init_state, make_logprob_fn, make_train_step  # noqa: E402
from rljax.trainer import packing as P  # noqa: E402
from rljax.trainer.step import PackedLogprob, PackedTrainStep  # noqa: E402


def lengths(dist: str, n: int, rng, max_prompt: int, max_response: int):
    if dist == "gsm8k":
        p = rng.lognormal(np.log(120), 0.35, n)
        r = rng.lognormal(np.log(300), 0.6, n)
    elif dist == "agent":
        p = rng.lognormal(np.log(400), 0.5, n)
        long = rng.random(n) < 0.25
        r = np.where(long, rng.lognormal(np.log(1200), 0.4, n), rng.lognormal(np.log(150), 0.7, n))
    elif dist == "embedded":  # "7+8=" after BOS, answer "15" + EOS; a tenth run to the limit
        p = np.where(rng.random(n) < 0.5, 5, 4)
        r = np.where(rng.random(n) < 0.1, max_response, rng.integers(2, 4, n))
    else:
        raise ValueError(f"unknown distribution {dist!r}; accepted: gsm8k, agent, embedded")
    return (np.clip(p, 1, max_prompt).astype(int), np.clip(r, 1, max_response).astype(int))


def batch_of(plen, rlen, s, t, vocab, rng):
    """A learner batch in the padded layout (left-padded prompt, right-padded response)."""
    b = plen.size
    attn = np.concatenate([np.arange(s)[None] >= (s - plen)[:, None], np.arange(t)[None] < rlen[:, None]], 1)
    ids = np.where(attn, rng.integers(3, vocab, (b, s + t)), 0).astype(np.int32)
    loss_mask = (np.arange(t)[None] < rlen[:, None]).astype(np.float32)
    return {
        "input_ids": ids, "attention_mask": attn,
        "positions": np.maximum(np.cumsum(attn, 1) - 1, 0).astype(np.int32),
        "loss_mask": loss_mask,
        "advantages": (rng.normal(0, 1, (b, 1)) * loss_mask).astype(np.float32),
        "old_logp": (-np.log(vocab) + rng.normal(0, 0.1, (b, t)) * loss_mask).astype(np.float32),
    }


def timed(fn, reps, warmup=2):
    for _ in range(warmup):  # compile, and compile again if the donated state comes back in another layout
        jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def update_rows(config, args, dist, rng):
    """Update step and old-log-prob pass of every variant, compiled once each and timed
    round-robin (variant after variant, ``--reps`` rounds) so load changes hit all alike.
    Packed variants are timed with their host-side packing (what the trainer pays)."""
    s, t = args.max_prompt, args.max_response
    plen, rlen = lengths(dist, args.batch, rng, s, t)
    host = batch_of(plen, rlen, s, t, config.vocab_size, rng)
    batch = {k: jnp.asarray(v) for k, v in host.items()}
    graphdef, params = F.init_params(config, seed=0)
    mesh = make_mesh(args.mesh) if args.mesh else None
    if mesh is not None:  # as the trainer places them: parameters by their logical axes, rows on dp
        params = jax.device_put(params, F.param_shardings(config, mesh))
        batch = jax.device_put(batch, NamedSharding(mesh, PartitionSpec("dp")))
    opt = optax.sgd(1e-3)
    mini = args.mini or args.batch
    micro = args.micro or mini
    cfg = StepConfig(ppo_mini_batch_size=mini, ppo_micro_batch_size=micro, logprob_impl="chunked")
    key = jax.random.key(0)
    real = int(host["attention_mask"].sum())
    budget = args.token_budget
    variants = {
        "padded": None,
        "packed": P.PackConfig(row_len=s + t, micro_batch_size=micro),
        "packed+budget+balance": P.PackConfig(row_len=s + t, use_dynamic_bsz=True, max_token_len_per_device=budget,
                                              balance=True),
    }
    if args.half_budget:  # half the padded micro-batch's activations
        variants["packed+budget/2+balance"] = P.PackConfig(row_len=s + t, use_dynamic_bsz=True,
                                                           max_token_len_per_device=budget // 2, balance=True)
    # the trainer's log-prob pass: padded in micro-batches, packed in token-budget chunks
    lp_variants = {"padded": None, "packed": P.PackConfig(row_len=s + t, use_dynamic_bsz=True,
                                                          max_token_len_per_device=budget)}
    rows, runs = {}, {}
    for name, pcfg in variants.items():
        box = [init_state(jax.tree.map(jnp.copy, params), opt)]
        t0 = time.perf_counter()
        if pcfg is None:
            step = make_train_step(graphdef, opt, cfg, mesh=mesh)
            compiled = step.lower(box[0], batch, key).compile()
            feed = lambda: key  # noqa: E731
            slots, compiles = args.batch * (s + t), 1
        else:
            step = PackedTrainStep(graphdef, opt, cfg, pcfg, mesh, response_len=t)
            compiled = step.lower(box[0], batch, key).compile()
            feed = lambda step=step: step._packed(batch, key)  # noqa: E731  host packing, timed
            slots = step.stats["packed_tokens"]
            compiles = len(plan_shapes(config, args, dist, pcfg, mini, rng))
        compile_s = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        print(f"  compiled update {name} in {compile_s:.0f} s", flush=True)

        def run(compiled=compiled, box=box, feed=feed):
            out = compiled(box[0], batch, feed())  # (state, metrics, on-policy rows)
            box[0] = out[0]
            return out[1]

        runs[("update", name)] = run
        rows[("update", name)] = dict(temp=mem.temp_size_in_bytes, pad=1 - real / slots, compiles=compiles,
                                      compile_s=compile_s)
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "positions")}
    for name, pcfg in ({} if args.skip_logprob else lp_variants).items():
        t0 = time.perf_counter()
        if pcfg is None:
            fn = make_logprob_fn(graphdef, response_len=t, temperature=1.0, impl="chunked", mesh=mesh,
                                 micro_batch_size=micro)
            compiled = fn.lower(params, inputs).compile()
            run = lambda fn=compiled: fn(params, inputs)  # noqa: E731
            slots = args.batch * (s + t)
        else:
            fn = PackedLogprob(graphdef, pcfg, response_len=t, temperature=1.0, impl="chunked", mesh=mesh)
            packed, b = fn._packed(inputs)
            compiled = fn._fn.lower(params, packed, b).compile()
            slots = int(np.prod(packed["tokens"].shape))
            run = lambda fn=fn, c=compiled: c(params, fn._packed(inputs)[0])  # noqa: E731
        compile_s = time.perf_counter() - t0
        runs[("logprob", name)] = run
        rows[("logprob", name)] = dict(temp=compiled.memory_analysis().temp_size_in_bytes, pad=1 - real / slots,
                                       compiles=1, compile_s=compile_s)
    wall = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    for _ in range(args.reps):
        for k, run in runs.items():
            w0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(run())
            wall[k].append(time.perf_counter() - w0)
            cpu[k].append(time.process_time() - c0)
            print(f"  {k[0]} {k[1]}: {wall[k][-1]:.2f} s wall, {cpu[k][-1]:.2f} s cpu", flush=True)
    for k in runs:
        rows[k].update(time=float(np.median(wall[k])), cpu=float(np.median(cpu[k])))
    return rows, (plen, rlen)


def plan_shapes(config, args, dist, pcfg, mini, rng):
    """The programs a run would compile: distinct bucketed packed shapes over ``--plan-steps`` batches."""
    s, t = args.max_prompt, args.max_response
    shapes = set()
    for i in range(args.plan_steps):
        pl, rl = lengths(dist, args.batch, np.random.default_rng(1000 + i), s, t)
        hb = batch_of(pl, rl, s, t, config.vocab_size, rng)
        orders = P.epoch_orders(jax.random.key(i), args.batch, 1)
        _, st = P.pack(hb["input_ids"], hb["attention_mask"], hb["positions"], t, orders, mini_batch_size=mini,
                       cfg=pcfg)
        shapes.add(st["shape"])
    return shapes


def decode_rows(config, args):
    """Tokens/s of dense and live decode at each fill: all six chunks built first, then timed in
    interleaved rounds (wall and this process's CPU time: the CPU-time ratio moves less with other
    processes' load). Greedy tokens from one random cache are compared between the modes."""
    cap = args.max_prompt + args.max_response
    graphdef, params = F.init_params(config, seed=0)
    s = args.slots
    runs, tokens = {}, {}
    for mode in ("dense", "live"):
        eng = RljaxEngine(config, num_slots=s, max_prefill_length=args.max_prompt,
                          max_decode_length=args.max_response, decode_attention=mode)
        p = eng.load_params(params)
        # as the rollout driver decodes: each layer's weights sliced once per weight version, not per chunk
        layers = None if args.slice_per_chunk else eng.decode_layers(p)
        for fill in (0.1, 0.5, 1.0):
            index = min(int(fill * cap), cap - args.decode_steps - 1)
            state = eng.init_decode_state(DecodeParams(temperature=0.0, max_new_tokens=args.max_response, eos_ids=()))
            key = jax.random.key(1)  # the same random cache for both modes: their tokens must agree
            state = state.replace(cache=jax.tree.map(lambda x: 0.5 * jax.random.normal(key, x.shape, x.dtype),
                                                     state.cache),
                                  index=jnp.full((s,), index, jnp.int32), active=jnp.ones((s,), bool),
                                  done=jnp.zeros((s,), bool), step=jnp.ones((s,), jnp.int32))
            box = [state]

            def run(box=box, index=index, eng=eng, p=p, layers=layers):
                st = box[0].replace(index=jnp.full((s,), index, jnp.int32), step=jnp.ones((s,), jnp.int32),
                                    done=jnp.zeros((s,), bool), tokens=jnp.arange(s, dtype=jnp.int32))
                box[0], steps = eng.generate_chunk(p, st, num_steps=args.decode_steps, layers=layers)
                return box[0].out_tokens

            for _ in range(2):  # compile, and compile again if the donated state comes back in another layout
                tokens[(mode, fill)] = np.asarray(run())[:, 1 : 1 + args.decode_steps]
            runs[(mode, fill)] = (run, [])
    for _ in range(args.reps):  # interleaved rounds
        for run, times in runs.values():
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(run())
            times.append((time.perf_counter() - t0, time.process_time() - c0))
    out = {}
    for k, (_, times) in runs.items():
        out[k] = tuple(s * args.decode_steps / float(np.median(x)) for x in zip(*times))  # (wall, cpu) tokens/s
    same = {fill: bool(np.array_equal(tokens[("dense", fill)], tokens[("live", fill)])) for fill in (0.1, 0.5, 1.0)}
    return out, same


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dist", default="gsm8k,agent", help="gsm8k, agent, embedded (comma-separated)")
    ap.add_argument("--batch", type=int, default=32, help="trajectories per update step")
    ap.add_argument("--mini", type=int, default=None, help="trajectories per mini-batch (default: --batch)")
    ap.add_argument("--micro", type=int, default=4, help="trajectories per micro-batch (padded and packed; 0: mini)")
    ap.add_argument("--token-budget", type=int, default=8192, help="tokens per device per packed micro-batch")
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-response", type=int, default=2048)
    ap.add_argument("--mesh", default=None, help="run the learner on this mesh (e.g. dp1, as the trainer does)")
    ap.add_argument("--preset", default=None, help="a model preset (e.g. tiny) instead of --layers/--hidden/--vocab")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=2, help="timed rounds (variants interleaved)")
    ap.add_argument("--plan-steps", type=int, default=50, help="batches planned to count compiled shapes")
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--skip-update", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--slice-per-chunk", action="store_true",
                    help="decode chunks slice the layer weights themselves, every chunk (the driver slices once per "
                         "weight version; before 2 Dec the bench timed this)")
    ap.add_argument("--half-budget", action="store_true", help="also packed+budget+balance at --token-budget / 2")
    ap.add_argument("--skip-logprob", action="store_true", help="no old-log-prob pass rows")
    args = ap.parse_args()
    if args.preset:
        config = get_config(args.preset)
    else:
        config = models.ModelConfig(
            vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
            num_layers=args.layers, num_heads=args.hidden // 64, num_kv_heads=max(args.hidden // 128, 1),
            max_position_embeddings=8192)
    print(f"model: {config.num_layers} layers, hidden {config.hidden_size}, {config.num_heads} heads, "
          f"{config.num_kv_heads} kv heads, mlp {config.intermediate_size}, vocab {config.vocab_size}: "
          f"{config.num_params() / 1e6:.2f}M params (float32); limits prompt {args.max_prompt} + response "
          f"{args.max_response}; jax {jax.__version__}, {jax.devices()[0].platform}", flush=True)
    if not args.skip_update:
        for dist in args.dist.split(","):
            rows, (plen, rlen) = update_rows(config, args, dist, np.random.default_rng(0))
            mini = args.mini or args.batch
            print(f"\n{dist}: {args.batch} trajectories (prompt mean {plen.mean():.0f}, response mean "
                  f"{rlen.mean():.0f} / max {rlen.max()}), mini-batch {mini}, micro-batch {args.micro or mini} "
                  f"trajectories or {args.token_budget} tokens; median of {args.reps} interleaved rounds")
            print(f"{'pass':<9}{'variant':<26}{'wall s':>9}{'speedup':>9}{'cpu s':>9}{'cpu x':>7}{'temp MiB':>10}"
                  f"{'temp/pad':>10}{'padding':>9}{'compiles':>10}{'compile s':>11}")
            for (kind, name), r in rows.items():
                base = rows[(kind, "padded")]
                print(f"{kind:<9}{name:<26}{r['time']:>9.3f}{base['time'] / r['time']:>9.2f}{r['cpu']:>9.3f}"
                      f"{base['cpu'] / r['cpu']:>7.2f}{r['temp'] / 2**20:>10.1f}{r['temp'] / base['temp']:>10.2f}"
                      f"{r['pad']:>9.2f}{r['compiles']:>10}{r['compile_s']:>11.1f}", flush=True)
    if not args.skip_decode:
        out, same = decode_rows(config, args)
        cap = args.max_prompt + args.max_response
        print(f"\ndecode: {args.slots} slots, cache capacity {cap}, {args.decode_steps} steps per chunk; tokens/s "
              f"(wall; cpu: per second of this process's CPU time), median of {args.reps} interleaved rounds, "
              f"load {os.getloadavg()[0]:.1f}")
        print(f"{'cache fill':<12}{'dense':>10}{'live':>10}{'live/dense':>12}{'cpu dense':>11}{'cpu live':>10}"
              f"{'cpu ratio':>11}{'same tokens':>13}")
        for fill in (0.1, 0.5, 1.0):
            (d, dc), (lv, lc) = out[("dense", fill)], out[("live", fill)]
            print(f"{int(fill * 100):>9}%  {d:>10.0f}{lv:>10.0f}{lv / d:>12.2f}{dc:>11.0f}{lc:>10.0f}{lc / dc:>11.2f}"
                  f"{'yes' if same[fill] else 'NO':>13}")

if __name__ == "__main__":
    main()
