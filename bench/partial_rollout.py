"""What ``async_training.partial_rollout=recompute`` costs at a weight push, beside ``keep``.

    python bench/partial_rollout.py                          # tiny model, 16 slots, 64 + 128 tokens
    python bench/partial_rollout.py --config tiny --slots 16 --prompt-len 64 --new-tokens 128 --push-at 64

One rollout of ``--slots`` trajectories (no EOS: every row runs ``--new-tokens`` tokens) on one
:class:`rljax.rollout.driver.Driver`, with a weight push installed once the rows hold ``--push-at``
tokens, in both modes, side by side in one process on the same weights and prompts, after one
untimed warm-up run each (compiles). ``keep``: the rows decode on over their cache; ``recompute``:
each row's context (prompt + tokens so far) is re-prefilled with the new weights first
(:meth:`rljax.rollout.RljaxEngine.reprefill_many`). Columns: the call's wall seconds, decode
seconds, the re-prefill seconds at the push (``Driver.recompute_s``) and the tokens re-prefilled,
and the re-prefill's share of one decode step of the whole batch (how many decode steps the push
costs). Medians of ``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np


def one(mode, cfg, p0, p1, args):
    from rljax.rollout import DecodeParams, RljaxEngine, Request, Sampler, trajectory_keys
    from rljax.rollout.driver import results_for

    eng = RljaxEngine(cfg, num_slots=args.slots, max_prefill_length=args.prompt_len, max_decode_length=args.new_tokens,
                      prefill_batch_size=min(args.slots, 16))
    sampler = Sampler(eng, p0, version=0, steps_per_sync=args.steps_per_sync, partial_rollout=mode, compact=False)
    decode = DecodeParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=0)
    rng = np.random.default_rng(0)
    out = []
    for rep in range(args.repeats + 1):
        if sampler.version:
            sampler.update_weights(p0, sampler.version + 1)
        driver = sampler.driver(decode)
        res = results_for(eng, args.slots, args.new_tokens)
        for i in range(args.slots):
            prompt = rng.integers(3, cfg.vocab_size, args.prompt_len // 2 + i % (args.prompt_len // 2))
            driver.submit(Request(prompt, keys=trajectory_keys(0, [f"r{rep}-{i}"], [0]), results=res, rows=[i]))
        t0, pushed = time.perf_counter(), False
        while driver.busy:
            driver.step()
            if not pushed and driver.total_steps >= args.push_at:
                sampler.update_weights(p1 if sampler.version % 2 == 0 else p0, sampler.version + 1)
                pushed = True
        res.fetch()
        wall = time.perf_counter() - t0
        if rep:  # the first run compiles
            out.append({"wall": wall, "decode": driver.decode_s, "recompute": driver.recompute_s,
                        "tokens": driver.recomputed_tokens, "step": driver.decode_s / max(driver.total_steps, 1)})
    return {k: statistics.median(o[k] for o in out) for k in out[0]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--push-at", type=int, default=64, help="install the push once the rows hold this many tokens")
    ap.add_argument("--steps-per-sync", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    if not 0 < args.push_at < args.new_tokens:
        ap.error(f"--push-at is {args.push_at}; accepted: 0 < push-at < --new-tokens ({args.new_tokens})")

    from rljax.models import functional as F
    from rljax.models.config import get_config

    cfg = get_config(args.config)
    p0, p1 = F.init_params(cfg, seed=0)[1], F.init_params(cfg, seed=1)[1]
    lo, hi = args.prompt_len // 2, args.prompt_len // 2 + min(args.slots, args.prompt_len // 2) - 1
    print(f"# {args.config}, {args.slots} slots, prompts {lo}..{hi} tokens, "
          f"{args.new_tokens} new tokens, push at {args.push_at}; {platform.machine()} x{os.cpu_count()}, "
          f"load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}")
    print("| mode | wall s | decode s | re-prefill s at the push | tokens re-prefilled | decode steps it costs |")
    print("|---|---|---|---|---|---|")
    for mode in ("keep", "recompute"):
        r = one(mode, cfg, p0, p1, args)
        print(f"| {mode} | {r['wall']:.3f} | {r['decode']:.3f} | {r['recompute']:.4f} | {r['tokens']:.0f} | "
              f"{r['recompute'] / r['step']:.1f} |")


if __name__ == "__main__":
    main()
