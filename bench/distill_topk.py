"""What ``forward_kl_topk`` distillation costs beside the sampled-token modes (k1 / k3), on this
machine's CPU: the teacher's pass and the student's update head, side by side in one process.

    python bench/distill_topk.py                                 # N=2048 tokens, H=256, V=32768, K=128
    python bench/distill_topk.py --shape 1024x896x151936 --k 128 --reps 3

For one (N, H, V) and K it prints the median wall time (the functions take turns in every
repetition, so a change of load hits them alike) and the ratios:
  * teacher: the sampled token's log-prob (``fused_logprob``, what k1 / k3 keep: ``[N]``) vs the
    top-k ids and log-probs (``fused_topk_logprob``: ``[N, K]``);
  * student: value and gradient of the sampled token's log-prob (k1 / k3) vs of it plus the
    log-probs at the teacher's K ids (``fused_logprob_at``; the update does both from one
    hidden state);
and the bytes the batch carries per response token (k1 / k3: ``teacher_logp``, 4 bytes in
float32; top-k: ``K`` int32 ids plus ``K`` log-probs in the teacher's dtype). Not a test:
nothing here asserts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from rljax.pallas import fused_logprob
from rljax.pallas._topk import fused_logprob_at, fused_topk_logprob


def _median_seconds(fns, args, reps):
    for fn, a in zip(fns, args):
        jax.block_until_ready(fn(*a))  # compile + warm up
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, a, t in zip(fns, args, times):
            start = time.perf_counter()
            jax.block_until_ready(fn(*a))
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def measure(n, h, v, k, reps):
    keys = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(keys[0], (n, h), jnp.float32)
    unembed = jax.random.normal(keys[1], (h, v), jnp.float32) / h ** 0.5
    targets = jax.random.randint(keys[2], (n,), 0, v)
    ids = jax.random.randint(keys[3], (n, k), 0, v)

    teacher_sampled = jax.jit(lambda hd, w, t: fused_logprob(hd, w, t, impl="chunked")[0])
    teacher_topk = jax.jit(lambda hd, w: fused_topk_logprob(hd, w, k))

    def sampled_loss(hd, w, t):
        return fused_logprob(hd, w, t, impl="chunked")[0].sum()

    def topk_loss(hd, w, t, i):
        return fused_logprob(hd, w, t, impl="chunked")[0].sum() + fused_logprob_at(hd, w, i).sum()

    student_sampled = jax.jit(jax.value_and_grad(sampled_loss, argnums=(0, 1)))
    student_topk = jax.jit(jax.value_and_grad(topk_loss, argnums=(0, 1)))
    t_s, t_k, s_s, s_k = _median_seconds(
        (teacher_sampled, teacher_topk, student_sampled, student_topk),
        ((hidden, unembed, targets), (hidden, unembed), (hidden, unembed, targets), (hidden, unembed, targets, ids)),
        reps)
    print(f"N={n} H={h} V={v} K={k} ({jax.devices()[0].platform}, median of {reps})")
    print(f"  teacher pass head   sampled token {t_s:8.3f} s   top-k {t_k:8.3f} s   top-k / sampled {t_k / t_s:5.2f}")
    print(f"  student value+grad  sampled token {s_s:8.3f} s   + at top-k {s_k:8.3f} s   ratio {s_k / s_s:5.2f}")
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        print(f"  batch bytes per response token ({dtype} teacher): k1/k3 4, top-k {k * (4 + size)} "
              f"({k * (4 + size) / 4:.0f}x)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="2048x256x32768", help="NxHxV")
    p.add_argument("--k", type=int, default=128)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    n, h, v = (int(x) for x in a.shape.split("x"))
    measure(n, h, v, a.k, a.reps)


if __name__ == "__main__":
    main()
