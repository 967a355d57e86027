"""Naive vs chunked log-prob + entropy on this machine's CPU: temporary memory and wall time.

    python bench/logprob.py                      # the two issue shapes, float32 and bfloat16
    python bench/logprob.py --shapes 2048x256x32768 --dtypes float32 --reps 3

For each (N, H, V, dtype) it prints, side by side in one process:
  * forward+backward temporary bytes of the compiled program
    (``jax.jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes``);
  * the median wall time of forward-only and of forward+backward (gradients of
    ``sum(logp) + 0.1 * sum(entropy)`` with respect to hidden and unembed);
and the naive / chunked ratios (memory: naive / chunked, higher is better; time:
chunked / naive, lower is better). Not a test: nothing here asserts.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from rljax.pallas import fused_logprob

SHAPES = ((8192, 1024, 32768), (4096, 896, 151936))  # the second is Qwen2.5-0.5B's unembed


def _functions(impl, temperature):
    def forward(hidden, unembed, targets):
        return fused_logprob(hidden, unembed, targets, impl=impl, temperature=temperature)

    def loss(hidden, unembed, targets):
        logp, ent = forward(hidden, unembed, targets)
        return logp.sum() + 0.1 * ent.sum()

    return jax.jit(forward), jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def _median_seconds(fns, args, reps):
    """Median wall time of each function; the functions take turns in every repetition so
    that a change in machine load hits them alike."""
    for fn in fns:
        jax.block_until_ready(fn(*args))  # compile + warm up
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, t in zip(fns, times):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            t.append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def measure(n, h, v, dtype, reps, temperature=1.0):
    k = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k[0], (n, h), jnp.float32).astype(dtype)
    unembed = (jax.random.normal(k[1], (h, v), jnp.float32) / h ** 0.5).astype(dtype)
    targets = jax.random.randint(k[2], (n,), 0, v)
    args = (hidden, unembed, targets)
    impls = ("naive", "chunked")
    fns = {impl: _functions(impl, temperature) for impl in impls}
    row = {}
    for impl in impls:
        compiled = fns[impl][1].lower(*args).compile()
        row[f"{impl}_temp"] = compiled.memory_analysis().temp_size_in_bytes
    outputs = {impl: fns[impl][0](*args) for impl in impls}
    row["max_abs_diff"] = max(float(jnp.max(jnp.abs(a - b)))
                              for a, b in zip(outputs["naive"], outputs["chunked"]))
    del outputs
    for kind, index in (("fwd", 0), ("fwdbwd", 1)):
        medians = _median_seconds([fns[impl][index] for impl in impls], args, reps)
        for impl, seconds in zip(impls, medians):
            row[f"{impl}_{kind}"] = seconds
    return row


def _gib(x):
    return f"{x / 2**30:.3f}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="*", default=[f"{n}x{h}x{v}" for n, h, v in SHAPES],
                        help="NxHxV triples")
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions (median)")
    parser.add_argument("--precision", default="highest", choices=("default", "high", "highest"),
                        help="jax_default_matmul_precision (CPU computes float32 either way)")
    args = parser.parse_args(argv)
    jax.config.update("jax_default_matmul_precision", args.precision)

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{jax.devices()[0].device_kind}, reps={args.reps} (median), "
          f"matmul precision {args.precision}; naive and chunked alternate in each repetition")
    header = (f"{'N':>5} {'H':>5} {'V':>6} {'dtype':>8} | {'tmp naive':>9} {'tmp chunk':>9} "
              f"{'mem x':>6} | {'fwd naive':>9} {'fwd chunk':>9} {'ratio':>5} | "
              f"{'f+b naive':>9} {'f+b chunk':>9} {'ratio':>5} | {'max|diff|':>9}")
    print("temporary memory in GiB (fwd+bwd program), times in seconds; mem x = naive / chunked,"
          " time ratio = chunked / naive")
    print(header)
    print("-" * len(header))
    for shape in args.shapes:
        n, h, v = (int(x) for x in shape.split("x"))
        for dtype in args.dtypes:
            r = measure(n, h, v, jnp.dtype(dtype), args.reps)
            print(f"{n:>5} {h:>5} {v:>6} {dtype:>8} | {_gib(r['naive_temp']):>9} "
                  f"{_gib(r['chunked_temp']):>9} {r['naive_temp'] / r['chunked_temp']:>6.1f} | "
                  f"{r['naive_fwd']:>9.3f} {r['chunked_fwd']:>9.3f} "
                  f"{r['chunked_fwd'] / r['naive_fwd']:>5.2f} | "
                  f"{r['naive_fwdbwd']:>9.3f} {r['chunked_fwdbwd']:>9.3f} "
                  f"{r['chunked_fwdbwd'] / r['naive_fwdbwd']:>5.2f} | {r['max_abs_diff']:>9.2e}",
                  flush=True)


if __name__ == "__main__":
    main()
