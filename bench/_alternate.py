"""What bench/trace_overhead.py and bench/recompute_overhead.py share: a simulated mesh, one
``rljax.trainer.loop.Trainer`` trained with a switch flipped for alternate steps (both halves
share the load, the caches and the compiled programs; the first two steps, compiling, are not
counted), medians of the halves' metrics, and the parameter digest timed beside a float sum of
the same parameters (this tree's, and a git revision's when asked)."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What every bench run switches off: evaluation, validation before training, checkpoints.
QUIET = ["trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1"]


def trainer(mesh: str, steps: int, overrides, prefix: str):
    """A Trainer of the default config with ``overrides`` on ``mesh`` (``steps`` + 1 total steps),
    run in a fresh temporary directory. Sets the simulated CPU devices first: call it before JAX runs."""
    from rljax.sharding.mesh import spec_device_count

    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_force_host_platform_device_count={spec_device_count(mesh)}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    from rljax.config import resolve
    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    cfg, _ = resolve("default", [*QUIET, f"trainer.total_steps={steps + 1}", *overrides])
    return Trainer(cfg, make_mesh(mesh), tempfile.mkdtemp(prefix=prefix), echo=lambda *a: None)


def alternate(t, steps: int, switch: Callable[[bool], None]) -> dict[bool, list[dict]]:
    """``steps`` steps of ``t``, ``switch(on)`` before each (even steps on); ``{on: [metrics]}`` of the
    steps after the first two. Each step's metrics get ``bench/wall_s``: the seconds the whole
    ``train_one_step`` call took (``timing_s/step`` ends before the observers' ``step_end``, so
    it leaves the tracer's own work out; the wall time has it, and the cleanup), ``bench/cpu_s``: the
    CPU seconds of the whole process during the call (every thread: XLA's, the tracer's), and
    ``bench/main_cpu_s``: those of the calling thread alone."""
    halves: dict[bool, list[dict]] = {True: [], False: []}
    for step in range(1, steps + 1):
        on = step % 2 == 0
        switch(on)
        t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        metrics = t.train_one_step()
        metrics["bench/wall_s"] = time.perf_counter() - t0
        metrics["bench/cpu_s"] = time.process_time() - c0
        metrics["bench/main_cpu_s"] = time.thread_time() - m0
        if step > 2:
            halves[on].append(metrics)
    return halves


def med(rows, key: str) -> float:
    """The median of ``key`` over ``rows`` (absent: 0)."""
    return statistics.median(float(r.get(key) or 0.0) for r in rows)


def thread_cpu(prefix: str) -> float:
    """The CPU seconds used so far by the live Python threads whose name starts with ``prefix``."""
    import threading

    total = 0.0
    for th in threading.enumerate():
        if th.name.startswith(prefix) and th.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(th.ident))
            except (OSError, AttributeError):  # ended meanwhile, or a platform without thread clocks
                pass
    return total


def stamp(what: str) -> str:
    """The load average and the date, for the line a figure in the docs quotes."""
    return f"load average {os.getloadavg()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {what}"


def revision_digest(ref: str):
    """``param_digest`` of ``rljax/_digest.py`` as it is at the git revision ``ref``."""
    text = subprocess.run(["git", "-C", ROOT, "show", f"{ref}:rljax/_digest.py"], check=True, capture_output=True,
                          text=True).stdout
    mod = types.ModuleType(f"_digest_{ref}")
    mod.__file__ = f"<{ref}:rljax/_digest.py>"
    exec(compile(text, mod.__file__, "exec"), mod.__dict__)  # noqa: S102
    return mod.param_digest


def digest_times(params, ref: Optional[str] = None, reps: int = 10) -> dict[str, float]:
    """Median seconds of one parameter digest of ``params`` (this tree's; ``ref``'s too) and of a
    float sum of the same parameters, timed in turn."""
    import jax
    import jax.numpy as jnp

    from rljax._digest import param_digest

    fns = {"digest": param_digest,
           "float sum": jax.jit(lambda t: sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(t)))}
    if ref:
        fns[f"digest at {ref}"] = revision_digest(ref)
    times: dict[str, list[float]] = {k: [] for k in fns}
    for f in fns.values():
        jax.block_until_ready(f(params))
    for _ in range(reps):
        for k, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(params))
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}
