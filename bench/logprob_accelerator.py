"""Naive vs chunked vs Pallas log-prob + entropy on a GPU or TPU: memory, time and accuracy.

    python bench/logprob_accelerator.py            # the issue's shapes, float32 and bfloat16
    python bench/logprob_accelerator.py --smoke    # tiny shapes, runs anywhere (CPU: Pallas in
                                                   # interpret mode), checks the script itself

On a TPU the Pallas TPU kernels are compiled for real (Mosaic), on a GPU the Pallas GPU kernels
(Triton); ``impl="auto"`` still picks chunked on GPUs until this table shows the kernel faster
there. Every path
is compared with a float64 reference computed with NumPy on the host from the same (possibly
bfloat16-rounded) inputs (max |diff| of logp and entropy, and of d_hidden / d_unembed for one
random cotangent), so a fast but wrong kernel shows up in the same table. Designed to finish in well under five minutes on one chip.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from rljax.pallas import fused_logprob

SHAPES = ((8192, 1024, 32768), (4096, 896, 151936))
SMOKE_SHAPES = ((64, 32, 1000), (40, 16, 300))


def _problem(n, h, v, dtype):
    k = jax.random.split(jax.random.key(0), 5)
    hidden = jax.random.normal(k[0], (n, h), jnp.float32).astype(dtype)
    unembed = (jax.random.normal(k[1], (h, v), jnp.float32) * (2.0 / h ** 0.5)).astype(dtype)
    targets = jax.random.randint(k[2], (n,), 0, v).at[0].set(0).at[-1].set(v - 1)
    g_logp = jax.random.normal(k[3], (n,), jnp.float32)
    g_ent = jax.random.normal(k[4], (n,), jnp.float32)
    return hidden, unembed, targets, g_logp, g_ent


def _fns(impl, blocks, precision):
    def forward(hidden, unembed, targets):
        with jax.default_matmul_precision(precision):
            return fused_logprob(hidden, unembed, targets, impl=impl, **blocks)

    def fwd_bwd(hidden, unembed, targets, g_logp, g_ent):
        (logp, ent), pullback = jax.vjp(lambda h, w: forward(h, w, targets), hidden, unembed)
        return logp, ent, *pullback((g_logp, g_ent))

    return jax.jit(forward), jax.jit(fwd_bwd)


def _median(fn, args, reps):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _max_diff(got, want):
    return max(float(np.max(np.abs(np.asarray(g, np.float64) - w))) for g, w in zip(got, want))


def reference64(hidden, unembed, targets, g_logp, g_ent, chunk=1024):
    """(logp, entropy, d_hidden, d_unembed) in float64 with NumPy, ``chunk`` tokens at a time
    (never the whole [N, V] float64 logits)."""
    h, w = (np.asarray(jax.device_get(x)).astype(np.float64) for x in (hidden, unembed))
    y, gl, ge = (np.asarray(jax.device_get(x)) for x in (targets, g_logp, g_ent))
    n = h.shape[0]
    logp, ent, dh, dw = np.empty(n), np.empty(n), np.empty_like(h), np.zeros_like(w)
    for t0 in range(0, n, chunk):
        sl = slice(t0, min(t0 + chunk, n))
        z = h[sl] @ w
        z -= z.max(axis=1, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=1, keepdims=True))
        lp = z - lse
        p = np.exp(lp)
        rows = np.arange(sl.stop - sl.start)
        logp[sl] = lp[rows, y[sl]]
        ent[sl] = -(p * lp).sum(axis=1)
        # d logp / dz = onehot - p; d entropy / dz = -p (lp + entropy)
        dz = -p * (gl[sl, None] + ge[sl, None] * (lp + ent[sl, None]))
        dz[rows, y[sl]] += gl[sl]
        dh[sl] = dz @ w.T
        dw += h[sl].T @ dz
    return logp, ent, dh, dw


def run_shape(n, h, v, dtype, variants, reps, precision):
    problem = _problem(n, h, v, dtype)
    fwd_args, all_args = problem[:3], problem
    # The reference: float64 math on the same (possibly bf16-rounded) inputs.
    reference = reference64(*problem)
    rows = []
    for label, (impl, blocks) in variants.items():
        forward, fwd_bwd = _fns(impl, blocks, precision)
        try:
            compiled = fwd_bwd.lower(*all_args).compile()  # run as compiled: one compile, not two
            temp = compiled.memory_analysis().temp_size_in_bytes
            out = jax.device_get(compiled(*all_args))
            rows.append(dict(
                impl=label, temp=temp,
                fwd=_median(forward, fwd_args, reps), fwdbwd=_median(compiled, all_args, reps),
                diff_values=_max_diff(out[:2], reference[:2]),
                diff_grads=_max_diff(out[2:], reference[2:]),
                grad_scale=max(float(np.max(np.abs(r))) for r in reference[2:])))
        except Exception as err:  # report and go on: one failing path must not hide the rest
            rows.append(dict(impl=label, error=f"{type(err).__name__}: {str(err)[:200]}"))
    return rows


def variants_for(backend: str, smoke: bool, block_t=None, block_v=None) -> dict:
    """label -> (impl, block sizes); "chunk-L" shows whether big tiles pay off on this chip.

    The Pallas kernel of the backend ("pallas" resolves to it); with ``smoke`` off an
    accelerator, both kernels in interpret mode (tiny blocks), so the script's code paths run."""
    variants = {"naive": ("naive", {}), "chunked": ("chunked", {}),
                "chunk-L": ("chunked", dict(block_t=4096, block_v=8192))}
    if smoke:
        variants["chunk-L"] = ("chunked", dict(block_t=32, block_v=256))
    blocks = dict(block_t=block_t, block_v=block_v)
    if backend == "tpu":
        variants["pallas"] = ("pallas_tpu", blocks)
    elif backend == "gpu":
        variants["pallas"] = ("pallas_gpu", blocks)
    elif smoke:
        variants["pallas"] = ("pallas_tpu", dict(block_t=block_t or 16, block_v=block_v or 128))
        variants["pal-gpu"] = ("pallas_gpu", dict(block_t=block_t or 16, block_v=block_v or 128))
    return variants


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; runs on CPU too")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--precision", default="default", choices=("default", "high", "highest"),
                        help="matmul precision of the timed runs (TPU default: one bf16 pass)")
    parser.add_argument("--block-t", type=int, default=None, help="pallas block_t")
    parser.add_argument("--block-v", type=int, default=None, help="pallas block_v")
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    variants = variants_for(backend, args.smoke, args.block_t, args.block_v)
    print(f"jax {jax.__version__}, backend {backend}, {jax.devices()[0].device_kind}, "
          f"reps={args.reps} (median), timed matmul precision {args.precision}")
    if "pallas" not in variants:
        print(f"pallas: skipped (no Pallas kernel for backend {backend})")
    elif backend not in ("tpu", "gpu"):
        print("pallas: interpret mode (no accelerator): numbers check the script, not kernel speed")
    print("temp = fwd+bwd temporary GiB; times in ms; x = ratio to naive (memory: naive/impl, "
          "time: impl/naive); diffs vs a float64 NumPy reference; bf16 gradients are "
          "returned in bf16, so their diff is bf16 rounding of (scale)")
    header = (f"{'N':>5} {'H':>5} {'V':>6} {'dtype':>8} {'impl':>8} | {'temp':>7} {'mem x':>6} | "
              f"{'fwd':>9} {'x':>6} | {'fwd+bwd':>9} {'x':>6} | {'|d|logp,H':>9} "
              f"{'|d|grads':>9} {'(scale)':>8}")
    print(header)
    print("-" * len(header))
    start = time.perf_counter()
    for n, h, v in shapes:
        for dtype in (jnp.float32, jnp.bfloat16):
            rows = run_shape(n, h, v, dtype, variants, args.reps, args.precision)
            base = rows[0]
            for r in rows:
                lead = f"{n:>5} {h:>5} {v:>6} {jnp.dtype(dtype).name:>8} {r['impl']:>8} | "
                if "error" in r:
                    print(lead + r["error"], flush=True)
                    continue
                ok = "error" not in base
                print(lead
                      + f"{r['temp'] / 2**30:>7.3f} "
                      + (f"{base['temp'] / r['temp']:>6.1f} | " if ok else f"{'':>6} | ")
                      + f"{r['fwd'] * 1e3:>9.2f} "
                      + (f"{r['fwd'] / base['fwd']:>6.2f} | " if ok else f"{'':>6} | ")
                      + f"{r['fwdbwd'] * 1e3:>9.2f} "
                      + (f"{r['fwdbwd'] / base['fwdbwd']:>6.2f} | " if ok else f"{'':>6} | ")
                      + f"{r['diff_values']:>9.2e} {r['diff_grads']:>9.2e} {r['grad_scale']:>8.2e}",
                      flush=True)
    print(f"total {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
