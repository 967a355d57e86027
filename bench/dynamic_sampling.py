"""DAPO dynamic sampling vs plain GRPO on the embedded task, side by side, same seed.

Two ``python -m rljax.launch`` runs of the embedded default (addition, the ``tiny`` model
from random initialisation) that differ only in ``algorithm.filter_groups.enable``; the
table gives, every ``--every`` steps, the held-out reward (greedy, the test split) and the
prompts generated per trained step (``train/num_gen_batches * data.train_batch_size``), and
the wall time of each run.

    python bench/dynamic_sampling.py --steps 60 --every 20 --out /tmp/dynamic_sampling
"""

import argparse
import os

from _launch import launch_run  # bench/ is on sys.path when a bench runs as a script

BASE = ["--mesh=dp2", "data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=8",
        "trainer.val_before_train=true", "trace.ledgers=false", "data.val_batch_size=64", "data.embedded.num_test=64"]
RUNS = [("GRPO", []),
        ("GRPO + filter_groups", ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0"])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/dynamic_sampling")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=20)
    a = ap.parse_args()
    print(f"load: {os.getloadavg()[0]:.1f}", flush=True)
    results = {}
    for name, extra in RUNS:
        run_dir = os.path.join(a.out, name.replace(" ", "").replace("+", "_"))
        results[name] = launch_run(run_dir, [*BASE, *extra, f"trainer.total_steps={a.steps}",
                                             f"trainer.test_freq={a.every}"], name=name)
        print(f"{name}: {results[name][1]:.0f} s", flush=True)
    steps = sorted({r["step"] for recs, _ in results.values() for r in recs if "val/score/mean" in r})
    print("| step | " + " | ".join(f"{n}: held-out reward | {n}: prompts generated / step" for n, _ in RUNS) + " |")
    print("|---" * (1 + 2 * len(RUNS)) + "|")
    for s in steps:
        cells = []
        for name, _ in RUNS:
            recs = results[name][0]
            val = next((r["val/score/mean"] for r in recs if r["step"] == s and "val/score/mean" in r), float("nan"))
            lo = max(1, s - a.every + 1)
            gen = [r.get("train/num_gen_batches", 1) * 8 for r in recs if lo <= r["step"] <= s and "actor/pg_loss" in r]
            cells += [f"{val:.3f}", f"{sum(gen) / len(gen):.1f}" if gen else "-"]
        print(f"| {s} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
