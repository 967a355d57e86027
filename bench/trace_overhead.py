"""What the trace costs a training step, trace on against trace off, side by side in one process
(issue 35 item 6: the default run's ``trace/overhead_frac`` at most 3% median, the 31.6M case's 1%).

    python bench/trace_overhead.py                         # the default run, --mesh dp8, 12 steps
    python bench/trace_overhead.py --case 31m --mesh dp2 --steps 6
    python bench/trace_overhead.py --early-ab --steps 30         # mid-step checks against all at the step's end

One trainer (``rljax.trainer.loop.Trainer``); the trace is switched off and on for alternate
steps (bench/_alternate.py), so both halves share the load, the caches and the compiled
programs. Off: the runner has no observer (no records, invariants, re-derivations, DFX metrics)
and the digest log records nothing (no digest of the old or reference pass, the sampler's
installs and chunks). What stays on in both halves: the two parameter digests compiled into the
jitted update. Printed: the load average, the medians of ``timing_s/step`` per half and their
ratio, the same of the wall time of each ``train_one_step`` call (``timing_s/step`` ends before
the tracer's ``step_end``: the wall time holds all of the tracer's work), ``trace/overhead_frac``
and ``trace/overhead_s`` of the on half, ``trace/invariants_s``, ``trace/rescore_s``; the parameter digests computed outside the update per on step (the old and
reference passes take a known digest when they read the arrays the update digested); one
digest timed against a float sum of the same parameters (and against the digest of the git
revision ``--ref`` when one is named), with the share of the step of the update's two
and the sampler's install. ``--early-ab``: the trace on in both halves, which differ only in where
the checks that can start mid-step run (``Tracer.early``, :mod:`rljax.trace.early`: its background
thread from their stage's event, against the step's end); the medians of both and their ratios.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _alternate as A  # noqa: E402

CASES = {
    "default": [],
    # bench/peer_trl.py's 31m: a 31.6M-parameter Qwen2 shape, 8 prompts x 8, 32 new tokens
    "31m": ["model.hidden_size=512", "model.intermediate_size=2048", "model.num_layers=8", "model.num_heads=8",
            "model.num_kv_heads=4", "data.train_batch_size=8", "rollout.n=8", "data.max_response_length=32",
            "actor.ppo_mini_batch_size=8"],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", default="default", choices=sorted(CASES))
    p.add_argument("--mesh", default="dp8")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--ref", default="none", help="git revision whose parameter digest is timed beside this "
                                                  "tree's ('none', the default: not timed)")
    p.add_argument("--overrides", nargs="*", default=[])
    p.add_argument("--parts", action="store_true", help="also time the tracer's parts per on step (each wrapped "
                                                        "with a clock; the wrappers add a little to the on half)")
    p.add_argument("--early-ab", action="store_true",
                   help="trace on in both halves; the halves differ in where the checks that can start mid-step run "
                        "(rljax.trace.early: a background thread from the stage's event, against the step's end)")
    args = p.parse_args(argv)
    trainer = A.trainer(args.mesh, args.steps, [*CASES[args.case], *args.overrides], "trace_overhead_")
    if args.early_ab:
        return early_ab(trainer, args)
    import rljax._digest as D

    runner, sampler = trainer.runner, trainer.services.rollout.sampler
    observers, log, record = list(runner.observers), getattr(sampler, "digest_log", None), D.LOG.record
    computed = {"n": 0}
    digest = D.param_digest

    def counted(tree):
        computed["n"] += 1
        return digest(tree)

    D.param_digest = counted  # what DigestLog.digest computes (a known digest is not counted)

    parts = Parts(trainer.tracer) if args.parts else None

    def switch(on: bool) -> None:
        runner.observers = observers if on else []
        if hasattr(sampler, "digest_log"):
            sampler.digest_log = log if on else None
        D.LOG.record = record if on else (lambda *a, **k: None)
        if on:
            D.LOG.clear()  # the off step's records (none): the on step ties what it sees
            if getattr(sampler, "params", None) is not None:  # the weights the off step installed, digested as
                D.LOG.digest(sampler.params)  # a traced install would have: the on step's chunks find it
            D.LOG.take_spent()  # and its digest time is not the on step's
        computed["n"] = 0
        if parts is not None:
            parts.next(on)

    counts, threads = [], []  # threads[s]: the tracer's threads' CPU seconds so far when step s + 1 began
    halves = A.alternate(trainer, args.steps, lambda on: (counts.append(computed["n"]),
                                                          threads.append(_threads()), switch(on)))
    threads.append(_threads())
    counts.append(computed["n"])  # counts[s]: the digests computed during step s (counts[0]: none ran)
    D.param_digest, D.LOG.record = digest, record
    on_counts = counts[4::2]  # the on steps that count (steps 1-2 compile)
    times = A.digest_times(trainer.state.actor.params, None if args.ref == "none" else args.ref)
    print(A.stamp(f"case {args.case}, mesh {args.mesh}, {len(halves[False])} + {len(halves[True])} steps"))
    off, on = A.med(halves[False], "timing_s/step"), A.med(halves[True], "timing_s/step")
    print(f"timing_s/step (median; ends before the tracer's step_end): trace off {off:.4f} s, on {on:.4f} s, "
          f"on / off {on / off:.3f}")
    w_off, w_on = A.med(halves[False], "bench/wall_s"), A.med(halves[True], "bench/wall_s")
    print(f"wall per train_one_step (median; the tracer's step_end and cleanup included): trace off {w_off:.4f} s, "
          f"on {w_on:.4f} s, on / off {w_on / w_off:.3f}")
    c_off, c_on = A.med(halves[False], "bench/cpu_s"), A.med(halves[True], "bench/cpu_s")
    m_off, m_on = A.med(halves[False], "bench/main_cpu_s"), A.med(halves[True], "bench/main_cpu_s")
    bg = {k: (threads[-1][k] - threads[2][k]) / max(len(halves[True]), 1) for k in threads[-1]}  # steps 3..end
    print(f"CPU per train_one_step (median): whole process off {1e3 * c_off:.1f} ms, on {1e3 * c_on:.1f} ms "
          f"(+{1e3 * (c_on - c_off):.2f} ms = {100 * (c_on - c_off) / w_off:.2f}% of the off wall); trainer's thread "
          f"off {1e3 * m_off:.1f} ms, on {1e3 * m_on:.1f} ms (+{1e3 * (m_on - m_off):.2f} ms); the tracer's threads "
          f"{1e3 * sum(bg.values()):.2f} ms per on step ("
          + ", ".join(f"{k} {1e3 * v:.2f}" for k, v in bg.items()) + ")")
    print(f"trace on: overhead_frac {100 * A.med(halves[True], 'trace/overhead_frac'):.2f}% (median), overhead_s "
          f"{1e3 * A.med(halves[True], 'trace/overhead_s'):.2f} ms, invariants_s "
          f"{1e3 * A.med(halves[True], 'trace/invariants_s'):.2f} ms, rescore_s "
          f"{1e3 * A.med(halves[True], 'trace/rescore_s'):.3f} ms; background_frac "
          f"{100 * A.med(halves[True], 'trace/background_frac'):.2f}% (median; the tracer's threads' CPU as the "
          f"run reports it), background_s {1e3 * A.med(halves[True], 'trace/background_s'):.2f} ms")
    print(f"parameter digests computed outside the update per on step: {on_counts}")
    update = A.med(halves[True], "timing_s/update_actor")
    for name, s in times.items():
        share = "" if name == "float sum" else (f"; 2 in the update = {100 * 2 * s / update:.2f}% of "
                                                f"timing_s/update_actor ({update:.4f} s), 3 (+ the install) = "
                                                f"{100 * 3 * s / on:.2f}% of the step")
        print(f"{name}: {1e3 * s:.2f} ms ({s / times['float sum']:.1f}x the float sum){share}")
    if parts is not None:
        parts.next(False)
        print("tracer parts (ms per on step, median, wall / the trainer thread's CPU; nested parts are inside "
              "their parents):")
        medians = parts.medians()
        for name, ms in medians.items():
            if not name.startswith("cpu:"):
                cpu = medians.get("cpu:" + name)
                print(f"  {name}: {ms:.3f}" + ("" if cpu is None else f" / {cpu:.3f}"))
    return 0


def early_ab(trainer, args) -> int:
    """Both halves traced; on: the checks that can start mid-step start at their stage's event in the
    tracer's background thread (``Tracer.early``), off: every check at the step's end (``early = None``)."""
    tracer = trainer.tracer
    early = tracer.early

    def switch(on: bool) -> None:
        tracer.early = early if on else None

    halves = A.alternate(trainer, args.steps, switch)
    print(A.stamp(f"case {args.case}, mesh {args.mesh}, {len(halves[False])} + {len(halves[True])} steps, trace on "
                  "in both; on: checks started mid-step (rljax.trace.early), off: all at the step's end"))
    for key, scale, unit in (("trace/overhead_s", 1e3, "ms"), ("trace/overhead_frac", 100, "%"),
                             ("trace/background_s", 1e3, "ms"), ("timing_s/step", 1e3, "ms"),
                             ("bench/wall_s", 1e3, "ms"), ("bench/cpu_s", 1e3, "ms"), ("bench/main_cpu_s", 1e3, "ms")):
        off, on = A.med(halves[False], key), A.med(halves[True], key)
        print(f"{key} (median): end of step {scale * off:.2f} {unit}, mid-step {scale * on:.2f} {unit}, "
              f"mid-step / end {on / off if off else float('nan'):.3f}")
    wb, rc = tracer.whole_batch, tracer.whole_batch.recompute
    print(f"mid-step results taken: rollout facts {wb.taken_mid_step_rollout}, reduction {wb.taken_mid_step}, "
          f"re-scoring {rc.taken_mid_step if rc else 0} "
          f"(of the {args.steps // 2} steps run with them)")
    return 0


def _threads() -> dict:
    """CPU seconds so far of each of the tracer's background threads (a step's writer jobs run during the next)."""
    return {name: A.thread_cpu(f"rljax-trace-{name}") for name in ("writer", "prefetch", "early")}


class Parts:
    """The tracer's parts, each wrapped with two clocks: ``{part: seconds}`` of every on step, wall
    and the calling thread's CPU (``cpu:<part>``; a part whose wall is well above its CPU waited:
    for the device, or, in an asynchronous run, for the GIL and the cores the rollout thread holds)."""

    def __init__(self, tracer):
        from rljax.trace import _io, invariants as I, tracer as T
        from rljax.trace.observers import records as R, rollouts as RO, whole_batch as W
        from rljax.trace.recompute import Recompute

        self.steps: list[dict] = []
        self.now: dict = {}
        self.on = False
        targets = [(type(tracer), "step_end", "step_end"), (type(tracer), "cleanup", "cleanup"),
                   (type(tracer), "stage", "stage events"), (type(tracer), "step_start", "step_start"),
                   (type(tracer.rollouts), "step", "rollouts"), (type(tracer.whole_batch), "step", "whole_batch"),
                   (I, "step_facts", "whole_batch/step_facts"), (W, "_local", "whole_batch/host compare"),
                   (W, "_rederived", "whole_batch/rederived"), (Recompute, "_rescore", "whole_batch/rederived/rescore"),
                   (Recompute, "_weights", "whole_batch/rederived/weights"), (type(tracer.perf), "tokens", "perf.tokens"),
                   (type(tracer.perf), "bytes_and_comm", "perf.bytes_and_comm"),
                   (R.Records, "step", "records.step (field summaries)"), (R.Records, "cleanup", "records.cleanup"),
                   (type(tracer), "_summary", "cleanup/summary dict"), (T, "write_atomic", "cleanup/summary write"),
                   (R, "append_lines", "records.cleanup/append"), (RO, "append_lines", "rollouts/append")]
        if getattr(tracer, "prefetch", None) is not None or hasattr(T, "Prefetch"):
            targets.append((T.Prefetch, "wait", "step_end/prefetch wait"))
        if hasattr(T, "WRITER"):
            targets.append((T.WRITER, "wait", "writer wait (flush)"))
        del _io
        for owner, attr, name in targets:
            setattr(owner, attr, self._wrap(getattr(owner, attr), name))
        take = T.LOG.take_spent

        def taken():  # the digest log's seconds during the step's stages, as the tracer counts them
            s = take()
            self.now["digest log (stages)"] = self.now.get("digest log (stages)", 0.0) + s
            return s
        T.LOG.take_spent = taken

    def _wrap(self, fn, name):
        import functools
        import threading
        import time

        @functools.wraps(fn)
        def wrapped(*a, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:  # a part a background thread ran is named apart (rljax-trace-early, -writer)
                key = name if threading.current_thread() is threading.main_thread() else f"{name} [background]"
                self.now[key] = self.now.get(key, 0.0) + time.perf_counter() - t
                self.now["cpu:" + key] = self.now.get("cpu:" + key, 0.0) + time.thread_time() - c
        return wrapped

    def next(self, on: bool) -> None:
        """A step begins (its trace ``on``); the step before's parts are kept when it was on (its
        cleanup runs at the start of the next step, so its parts are kept one step late)."""
        if self.on:
            self.steps.append(self.now)
        self.now, self.on = {}, on

    def medians(self) -> dict:
        import statistics

        kept = self.steps[1:]  # the first on step compiles
        names = dict.fromkeys(k for s in kept for k in s)
        return {k: 1e3 * statistics.median(s.get(k, 0.0) for s in kept) for k in names}


if __name__ == "__main__":
    raise SystemExit(main())
