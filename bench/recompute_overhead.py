"""What the re-derivations cost a training step (issue 35 item 6: the default run's
``trace/overhead_frac`` at most 3%, median).

    python bench/recompute_overhead.py                          # the default run, --mesh dp8, 10 steps
    python bench/recompute_overhead.py --mesh dp2 --steps 6 --overrides data.train_batch_size=8 rollout.n=4

One process, one trainer (``rljax.trainer.loop.Trainer``, the tracer on as in every run); the
re-derivations are switched off and on for alternate steps
(``tracer.whole_batch.recompute.enabled``; bench/_alternate.py), so both halves share the load,
the caches and the compiled programs. Reported per half (median over its steps):
``trace/overhead_frac`` (the tracer's whole share of the step), ``trace/invariants_s`` (the one
jitted reduction, now with the re-derivation rows, and the host comparisons) and
``trace/rescore_s`` (the re-scored rows' reward calls). The parameter digest inside the update
(twice per update) is timed on its own against a plain float sum of the same parameters, and
against the step's ``timing_s/update_actor``. The load average is printed.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _alternate as A  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default="dp8")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--overrides", nargs="*", default=[])
    args = p.parse_args(argv)
    trainer = A.trainer(args.mesh, args.steps, args.overrides, "recompute_overhead_")

    def switch(on: bool) -> None:
        trainer.tracer.whole_batch.recompute.enabled = on

    halves = A.alternate(trainer, args.steps, switch)
    times = A.digest_times(trainer.state.actor.params, reps=20)
    print(A.stamp(f"mesh {args.mesh}"))
    for on in (False, True):
        rows = halves[on]
        print(f"re-derivations {'on ' if on else 'off'} ({len(rows)} steps): overhead_frac "
              f"{100 * A.med(rows, 'trace/overhead_frac'):.2f}%  invariants "
              f"{1e3 * A.med(rows, 'trace/invariants_s'):.2f} ms  rescore {1e3 * A.med(rows, 'trace/rescore_s'):.3f} ms"
              f"  step {A.med(rows, 'timing_s/step'):.3f} s  update {A.med(rows, 'timing_s/update_actor'):.3f} s")
    update, d, s = A.med(halves[True], "timing_s/update_actor"), times["digest"], times["float sum"]
    print(f"parameter digest {1e3 * d:.2f} ms vs float sum {1e3 * s:.2f} ms ({d / s:.1f}x); "
          f"2 per update = {100 * 2 * d / update:.2f}% of timing_s/update_actor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
