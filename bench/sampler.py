"""Decode throughput of the rljax sampler vs. a recompute baseline and HF ``generate``, side by side.

    python bench/sampler.py                      # tiny and ~100M configs, batch 32, 128 new tokens
    python bench/sampler.py --configs tiny --batch 8 --new-tokens 32
    python bench/sampler.py --rl                 # RL shapes: prompts x n samples, EOS ends rows early

``--rl`` times the shapes of an RL step instead (``--rl-shapes``, default 8x8 and 64x8
trajectories at 32 and 256 new tokens on the 31.6M config of ``bench/peer_trl.py``):
``prompts x n`` trajectories (each prompt prefilled once and inserted into ``n`` slots),
sampled at temperature 1 with EOS (id 2) ending rows early, beside ``transformers``
``generate`` (sampling, the same EOS, prompts repeated ``n`` times, as TRL calls it);
``--no-compact-row`` adds the engine without compacting finished rows away
(``Sampler(compact=False)``). ``vs generate`` is generate's seconds over the row's. Rows
end at different steps, so the table reports generated tokens and the engine's host syncs
(decode chunks) and prefill calls as well as seconds; tokens differ (different random
streams), so there is no agreement column.

For each model configuration, in one process and on the same weights:

* ``engine``: :class:`rljax.rollout.Sampler` on :class:`rljax.rollout.RljaxEngine` (KV cache,
  batched prefill, continuous batching, multi-step device loop);
* ``recompute``: no cache; every step runs the full forward over the whole sequence so
  far (right-padded to a power-of-two length bucket, one compilation per bucket), takes
  the argmax at each row's last token and appends it;
* ``hf``: ``transformers`` ``generate`` (KV cache, greedy) on the same weights exported
  with ``rljax.models.save_hf_checkpoint``, when torch and transformers are installed.

All decode greedily with no EOS, so every row generates exactly ``--new-tokens`` tokens
(one extra engine row samples at temperature 1 with top-p 0.95, for the cost of sampling);
prompt lengths are ragged in ``[prompt_len/2, prompt_len]``. Throughput is generated
tokens / wall seconds of the whole call (prefill included), after one untimed warm-up call
that compiles. The recompute baseline is slow enough on the ~100M model that, by default,
it is timed on ``--recompute-steps`` steps of each length bucket (every step of a bucket
has the same shapes, hence the same cost) and the 128-step time is the sum over buckets
of steps-in-bucket x measured seconds-per-step; the table marks such rows ``(timed N/128
steps)``. ``--recompute-steps 0`` times every step. The last column is the share of
generated tokens equal to the engine's (greedy decoding of the same weights; float
rounding can flip near-ties).

Measured with ``python bench/sampler.py`` on this project's 2-core CPU machine (shared,
load average ~2; JAX 0.10.2, torch 2.13 CPU, transformers 5):

    config    params  method                                   seconds  tokens/s  vs recompute  same tokens
    tiny        0.1M  engine (KV cache, cont. batching)           0.06   66526.9         80.9x  1.000 (ref)
    tiny        0.1M  engine, sampling T=1 top-p 0.95             0.08   51742.5         62.9x            -
    tiny        0.1M  recompute (no cache)                        4.98     822.6          1.0x        1.000
    tiny        0.1M  transformers generate                       4.82     850.6          1.0x        1.000
    100m       92.6M  engine (KV cache, cont. batching)           8.57     478.2         38.8x  1.000 (ref)
    100m       92.6M  engine, sampling T=1 top-p 0.95             8.30     493.7         40.1x            -
    100m       92.6M  recompute (no cache) (timed 6/128 steps)  332.61      12.3          1.0x            -
    100m       92.6M  transformers generate                      71.49      57.3          4.7x        1.000
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.models import functional as F
from rljax.models.config import get_config

from _peer_update import model_31m

CONFIGS = {
    "tiny": lambda: get_config("tiny"),
    # ~93M parameters: Qwen2-style (GQA, QKV bias), 12 layers, 32k vocabulary.
    "100m": lambda: get_config("tiny").replace(
        vocab_size=32000, hidden_size=640, intermediate_size=1728, num_layers=12, num_heads=10, num_kv_heads=2,
        head_dim=64, max_position_embeddings=2048,
    ),
    # bench/peer_trl.py's 31.6M Qwen2 (hidden 512, 8 layers, 8 / 4 heads, MLP 2048, character vocabulary).
    "31m": model_31m,
}
RL_SHAPES = "8x8x32,8x8x256,64x8x32,64x8x256"  # prompts x n x new tokens


def make_prompts(batch, prompt_len, vocab, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, batch)
    return [rng.integers(3, vocab, n).astype(np.int32).tolist() for n in lengths]


# --------------------------------------------------------------------------- engine


def bench_engine(config, params, prompts, new_tokens):
    """Greedy and sampled (temperature 1, top-p 0.95) runs on one engine: ``(greedy, sampled)``
    as ``(seconds, tokens, stats)``."""
    from rljax.rollout import DecodeParams, RljaxEngine, Sampler  # pylint: disable=import-outside-toplevel

    batch = len(prompts)
    max_prefill = 1 << math.ceil(math.log2(max(map(len, prompts))))
    engine = RljaxEngine(config, num_slots=batch, max_prefill_length=max_prefill, max_decode_length=new_tokens,
                         prefill_batch_size=batch)
    sampler = Sampler(engine, params, steps_per_sync=32)
    uids = [f"b{i}" for i in range(batch)]
    out = []
    for decode in (DecodeParams(temperature=0.0, max_new_tokens=new_tokens, eos_ids=()),
                   DecodeParams(temperature=1.0, top_p=0.95, max_new_tokens=new_tokens, eos_ids=())):
        sampler.generate(prompts, uids=uids, decode=decode)  # compile (the first time) and warm up
        traj = sampler.generate(prompts, uids=uids, decode=decode)
        tokens = [traj.response_ids[b, : traj.response_length[b]].tolist() for b in range(batch)]
        out.append((traj.stats.wall_s, tokens, traj.stats))
    return out


# --------------------------------------------------------------------------- recompute baseline


def _bucket(n):
    return 1 << math.ceil(math.log2(n))


def bench_recompute(config, params, prompts, new_tokens, steps_per_bucket):
    graphdef = F.abstract_params(config)[0]

    @jax.jit
    def step(p, buf, lengths):
        mask = jnp.arange(buf.shape[1])[None, :] < lengths[:, None]
        hidden = F.forward(graphdef, p, buf, mask=mask)
        last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
        nxt = jnp.argmax(F.compute_logits(p, last), axis=-1).astype(jnp.int32)
        return buf.at[jnp.arange(buf.shape[0]), lengths].set(nxt, mode="drop"), lengths + 1, nxt

    batch = len(prompts)
    lengths0 = np.array([len(q) for q in prompts], np.int32)
    final = _bucket(int(lengths0.max()) + new_tokens)
    host = np.zeros((batch, final), np.int32)
    for i, q in enumerate(prompts):
        host[i, : len(q)] = q
    # Step t runs on a buffer of width bucket(max_len_t + 1), the smallest that holds the new token.
    widths = [_bucket(int(lengths0.max()) + t + 1) for t in range(new_tokens)]
    for w in sorted(set(widths)):  # compile every bucket outside the timing
        jax.block_until_ready(step(params, jnp.asarray(host[:, :w]), jnp.asarray(lengths0)))

    full = steps_per_bucket <= 0
    buf, lengths, out = jnp.asarray(host), jnp.asarray(lengths0), []
    elapsed, timed = 0.0, 0
    per_bucket: dict[int, list[float]] = {}
    for t, w in enumerate(widths):
        if not full and len(per_bucket.get(w, [])) >= steps_per_bucket:
            continue
        t0 = time.perf_counter()
        small, lengths, nxt = step(params, buf[:, :w], lengths)
        buf = buf.at[:, :w].set(small)
        nxt = np.asarray(nxt)  # a host copy per step: the tokens are needed to continue
        dt = time.perf_counter() - t0
        per_bucket.setdefault(w, []).append(dt)
        elapsed += dt
        timed += 1
        out.append(nxt)
    if full:
        return elapsed, np.stack(out, 1).tolist(), timed
    total = sum(widths.count(w) * float(np.mean(per_bucket[w])) for w in per_bucket)
    return total, None, timed


# --------------------------------------------------------------------------- transformers


def _hf_model(config, params):
    """The same weights as a transformers model (float32, eval mode), or None without torch."""
    try:
        import torch  # pylint: disable=import-outside-toplevel
        import transformers  # pylint: disable=import-outside-toplevel
    except ImportError:
        return None
    from rljax.models.hf import save_hf_checkpoint  # pylint: disable=import-outside-toplevel

    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(tmp, config, params)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    return model.eval()


def bench_hf(config, params, prompts, new_tokens):
    model = _hf_model(config, params)
    if model is None:
        return None
    import torch  # pylint: disable=import-outside-toplevel
    batch, width = len(prompts), max(map(len, prompts))
    ids = np.zeros((batch, width), np.int64)
    mask = np.zeros((batch, width), np.int64)
    for i, q in enumerate(prompts):  # HF batched generation wants left padding
        ids[i, width - len(q):] = q
        mask[i, width - len(q):] = 1
    kwargs = dict(
        input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None,
    )
    with torch.no_grad():
        model.generate(**{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        out = model.generate(**kwargs)
        elapsed = time.perf_counter() - t0
    return elapsed, out[:, width:].tolist()


# --------------------------------------------------------------------------- main


def bench_rl(config, params, prompts, n, new_tokens, eos=2, compact=True):
    """Engine at an RL shape (sampling, EOS): ``(seconds, generated tokens, stats)`` of the second call.
    ``compact=False``: finished rows keep their slots (a step computes every slot) until the call ends."""
    from rljax.rollout import DecodeParams, RljaxEngine, Sampler  # pylint: disable=import-outside-toplevel

    rows = len(prompts) * n
    max_prefill = 1 << math.ceil(math.log2(max(map(len, prompts))))
    engine = RljaxEngine(config, num_slots=rows, max_prefill_length=max_prefill, max_decode_length=new_tokens,
                         prefill_batch_size=min(len(prompts), 64))
    sampler = Sampler(engine, params, compact=compact)  # the trainer's defaults (steps_per_sync, refill_batch)
    decode = DecodeParams(temperature=1.0, max_new_tokens=new_tokens, eos_ids=(eos,), seed=0)
    uids = [f"p{i}" for i in range(len(prompts))]
    sampler.generate(prompts, uids=uids, n=n, decode=decode)  # compile
    traj = sampler.generate(prompts, uids=uids, n=n, decode=decode)
    return traj.stats.wall_s, int(traj.response_length.sum()), traj.stats


def bench_hf_rl(config, params, prompts, n, new_tokens, eos=2):
    model = _hf_model(config, params)
    if model is None:
        return None
    import torch  # pylint: disable=import-outside-toplevel
    rows = [q for q in prompts for _ in range(n)]
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, q in enumerate(rows):
        ids[i, width - len(q):] = q
        mask[i, width - len(q):] = 1
    kwargs = dict(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=new_tokens,
                  do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=eos)
    torch.manual_seed(0)
    with torch.no_grad():
        model.generate(**{**kwargs, "max_new_tokens": 2})  # warm-up
        t0 = time.perf_counter()
        out = model.generate(**kwargs)
        elapsed = time.perf_counter() - t0
    gen = out[:, width:].numpy()
    ended = (gen == eos).any(1)
    tokens = int(np.where(ended, (gen == eos).argmax(1) + 1, gen.shape[1]).sum())
    return elapsed, tokens


def main_rl(args):
    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}); "
          f"RL shapes, sampling T=1 with EOS, float32")
    print(f"{'config':<6}{'shape':>12}  {'method':<24}{'seconds':>9}{'tokens':>8}{'tokens/s':>10}{'vs generate':>13}"
          f"{'syncs':>7}{'prefills':>9}")
    for name in args.configs.split(","):
        config = CONFIGS[name]()
        params = F.init_params(config, seed=0)[1]
        for shape in args.rl_shapes.split(","):
            p, n, t = (int(x) for x in shape.split("x"))
            prompts = make_prompts(p, args.prompt_len, config.vocab_size)
            label = f"{p}x{n}x{t}"
            runs = [("engine", *bench_rl(config, params, prompts, n, t))]
            if args.no_compact_row:
                runs.append(("engine, no compaction", *bench_rl(config, params, prompts, n, t, compact=False)))
            hf = None if args.no_hf else bench_hf_rl(config, params, prompts, n, t)
            for method, eng_s, eng_tok, st in runs:
                ratio = f"{hf[0] / eng_s:>12.2f}x" if hf else f"{'-':>13}"
                print(f"{name:<6}{label:>12}  {method:<24}{eng_s:>9.2f}{eng_tok:>8}{eng_tok / eng_s:>10.1f}{ratio}"
                      f"{st.decode_chunks:>7}{st.prefill_calls:>9}", flush=True)
            if hf:
                print(f"{name:<6}{label:>12}  {'transformers generate':<24}{hf[0]:>9.2f}{hf[1]:>8}{hf[1] / hf[0]:>10.1f}"
                      f"{'1.00x':>13}{t:>7}{1:>9}", flush=True)
        del params


def agreement(a, b):
    if a is None or b is None:
        return "-"
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(len(r) for r in a)
    return f"{same / total:.3f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="tiny,100m", help=f"comma-separated, from {', '.join(CONFIGS)}")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--recompute-steps", type=int, default=None,
                    help="steps timed per length bucket in the recompute baseline (0: all); default 0 for tiny, 2 otherwise")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers generate")
    ap.add_argument("--rl", action="store_true", help="time RL shapes (prompts x n, sampling, EOS) instead")
    ap.add_argument("--rl-shapes", default=RL_SHAPES, help="comma-separated PROMPTSxNxNEW_TOKENS (with --rl)")
    ap.add_argument("--no-compact-row", action="store_true",
                    help="with --rl, also time the engine with Sampler(compact=False)")
    args = ap.parse_args(argv)
    if args.rl and args.configs == "tiny,100m":
        args.configs = "31m"
    for name in args.configs.split(","):
        if name not in CONFIGS:
            ap.error(f"unknown config {name!r}; accepted: {', '.join(CONFIGS)}")
    if args.rl:
        for shape in args.rl_shapes.split(","):
            parts = shape.split("x")
            if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
                ap.error(f"--rl-shapes entry {shape!r}; accepted: PROMPTSxNxNEW_TOKENS such as 8x8x32")
        main_rl(args)
        return

    print(f"jax {jax.__version__} on {jax.devices()[0].platform} ({os.cpu_count()} cpus); batch {args.batch}, "
          f"{args.new_tokens} new tokens, prompts {args.prompt_len // 2}-{args.prompt_len} tokens, greedy, float32")
    header = f"{'config':<8}{'params':>8}  {'method':<46}{'seconds':>9}{'tokens/s':>11}{'vs recompute':>14}{'same tokens':>13}"
    rows = []
    for name in args.configs.split(","):
        config = CONFIGS[name]()
        params = F.init_params(config, seed=0)[1]
        prompts = make_prompts(args.batch, args.prompt_len, config.vocab_size)
        generated = args.batch * args.new_tokens
        size = f"{config.num_params() / 1e6:.1f}M"

        (eng_s, eng_tokens, stats), (smp_s, _, _) = bench_engine(config, params, prompts, args.new_tokens)
        steps = args.recompute_steps if args.recompute_steps is not None else (0 if name == "tiny" else 2)
        rec_s, rec_tokens, timed = bench_recompute(config, params, prompts, args.new_tokens, steps)
        rec_label = "recompute (no cache)" + ("" if timed == args.new_tokens else f" (timed {timed}/{args.new_tokens} steps)")
        results = [("engine (KV cache, cont. batching)", eng_s, eng_tokens),
                   ("engine, sampling T=1 top-p 0.95", smp_s, None), (rec_label, rec_s, rec_tokens)]
        hf = None if args.no_hf else bench_hf(config, params, prompts, args.new_tokens)
        if hf is not None:
            results.append(("transformers generate", hf[0], hf[1]))
        for method, secs, toks in results:
            same = "1.000 (ref)" if toks is eng_tokens else agreement(eng_tokens, toks)
            rows.append(f"{name:<8}{size:>8}  {method:<46}{secs:>9.2f}{generated / secs:>11.1f}{rec_s / secs:>13.1f}x{same:>13}")
        print(f"  [{name}] engine: prefill {stats.prefill_s:.2f}s, decode {stats.decode_s:.2f}s in {stats.decode_chunks} "
              f"chunks, {stats.prefill_calls} prefill call(s)", file=sys.stderr)
        del params
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
