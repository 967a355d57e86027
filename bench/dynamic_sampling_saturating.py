"""DAPO dynamic sampling where groups saturate: its cost and effect late in training.

A preset (the embedded addition task by default, or ``--config tool_lookup``) trains
``--base-steps`` steps with plain GRPO and saves a checkpoint there; then two runs resume
from copies of that run directory, same seed, for ``--steps`` more steps: plain GRPO, and
GRPO with ``algorithm.filter_groups.enable=true`` (``max_num_gen_batches`` from
``--max-gen-batches``, 0: no limit). Late in training most prompts are answered right by
every sample, so their groups have zero variance: the filter drops them and draws more
prompt batches. Every ``--every`` steps the table gives, side by side: the held-out reward
(greedy, the test split, the window's last evaluation), the prompts generated per trained step
(``train/num_gen_batches * data.train_batch_size``), the filter's zero-variance and trained
fractions of the groups it generated, the train reward (``critic/score/mean``: of the trained
batch, so the filter's leaves out the saturated groups it dropped), and the seconds per step
(``timing_s/step``; the resumed runs' first step, which compiles, is left out) and of
generation (``timing_s/gen``). ``--report`` prints the table again from the runs in ``--out``.

    python bench/dynamic_sampling_saturating.py --base-steps 250 --steps 100 --every 10 --out /tmp/ds_sat
    python bench/dynamic_sampling_saturating.py --config tool_lookup --base-steps 150 --steps 100 --every 20 \\
        --out /tmp/ds_sat_tool
"""

import argparse
import json
import os
import shutil
import statistics

import yaml

from _launch import launch_run  # bench/ is on sys.path when a bench runs as a script

COMMON = ["trace.ledgers=false", "trainer.val_before_train=false"]
#: the two runs after the split: name -> filter on
RUNS = {"GRPO": False, "GRPO + filter_groups": True}


def _filter(limit: int) -> list[str]:
    return ["algorithm.filter_groups.enable=true", f"algorithm.filter_groups.max_num_gen_batches={limit}"]


def _dir(name: str) -> str:
    return "filter" if RUNS[name] else "plain"


def _windows(start: int, end: int, every: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + every - 1, end)) for lo in range(start + 1, end + 1, every)]


def _mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def summarise(recs: list[dict], lo: int, hi: int, *, batch: int, first: int) -> dict:
    """One window's numbers from a run's metrics records (steps ``lo..hi``)."""
    train = [r for r in recs if lo <= r["step"] <= hi and "actor/pg_loss" in r]
    vals = [r["val/score/mean"] for r in recs if lo <= r["step"] <= hi and "val/score/mean" in r]
    val = vals[-1] if vals else float("nan")  # the window's last evaluation (every trainer.test_freq steps)
    gen_batches = [r.get("train/num_gen_batches", 1) for r in train]
    dropped = sum(r.get("train/dropped_groups", 0) for r in train)
    trained = sum(r.get("train/kept_groups", batch) for r in train)  # kept: trained; excess: the surplus beyond
    generated = int(sum(gen_batches)) * batch
    steady = [r for r in train if r["step"] != first]  # the resumed run's first step compiles
    return {"val": val, "prompts": _mean(gen_batches) * batch, "zero_var": dropped / generated if generated else 0.0,
            "trained": trained / generated if generated else 0.0,
            "reward": _mean([r["critic/score/mean"] for r in train]),
            "s_step": _mean([r["timing_s/step"] for r in steady]), "gen_s": _mean([r["timing_s/gen"] for r in steady]),
            "generated": generated, "steps": len(train)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="default", help="the preset (default: the embedded addition task)")
    ap.add_argument("--out", default="/tmp/ds_sat")
    ap.add_argument("--base-steps", type=int, default=250, help="plain GRPO steps before the two runs split")
    ap.add_argument("--steps", type=int, default=100, help="steps of each run after the split")
    ap.add_argument("--every", type=int, default=10, help="a table row (and a held-out evaluation) every N steps")
    ap.add_argument("--max-gen-batches", type=int, default=0, help="algorithm.filter_groups.max_num_gen_batches")
    ap.add_argument("--report", action="store_true", help="print the table of the runs already in --out")
    ap.add_argument("extra", nargs="*", help="key=value overrides for every run")
    a = ap.parse_args()
    if a.base_steps < 1 or a.steps < 1 or a.every < 1:
        ap.error("--base-steps, --steps and --every must be >= 1")
    if not a.report and os.path.exists(a.out):
        ap.error(f"--out {a.out} exists; give a new directory (or --report to print its table)")
    if a.report and not os.path.isdir(os.path.join(a.out, "filter")):
        ap.error(f"--report: no runs in --out {a.out}")
    k, end = a.base_steps, a.base_steps + a.steps
    if not a.report:
        run(a, k, end)
    report(a.out, k, end, a.every)


def run(a, k: int, end: int) -> None:
    """The base run to step ``k``, then the two runs resumed from copies of it to ``end``."""
    common = ["--config", a.config, *COMMON, *a.extra]
    print(f"load at start: {os.getloadavg()[0]:.1f}", flush=True)
    base = os.path.join(a.out, "base")
    _, wall = launch_run(base, [*common, f"trainer.total_steps={k}", f"trainer.save_freq={k}",
                                f"trainer.test_freq={k}"], name="base")
    print(f"base: {k} steps of plain GRPO in {wall:.0f} s", flush=True)
    for name, on in RUNS.items():
        path = os.path.join(a.out, _dir(name))
        shutil.copytree(base, path)
        os.remove(os.path.join(path, "rljax.lock"))
        print(f"{name}: load {os.getloadavg()[0]:.1f} at start", flush=True)
        _, wall = launch_run(path, [*common, f"--resume={k}", f"trainer.total_steps={end}",
                                    f"trainer.save_freq={end}", f"trainer.test_freq={a.every}",
                                    *(_filter(a.max_gen_batches) if on else [])], name=name)
        print(f"{name}: steps {k + 1}-{end} in {wall:.0f} s (launch to exit, compile included)", flush=True)
    print(f"load at end: {os.getloadavg()[0]:.1f}", flush=True)


def report(out: str, k: int, end: int, every: int) -> None:
    """The side-by-side table from the runs' ``metrics.jsonl``."""
    results = {}
    for name in RUNS:
        with open(os.path.join(out, _dir(name), "metrics.jsonl")) as fh:
            results[name] = [json.loads(line) for line in fh]
    with open(os.path.join(out, "base", "config.resolved.yaml")) as fh:
        batch = yaml.safe_load(fh)["data"]["train_batch_size"]
    names = list(RUNS)
    val0 = next((r["val/score/mean"] for r in results[names[0]] if r["step"] == k and "val/score/mean" in r),
                float("nan"))
    print(f"\nbatch: {batch} prompts; held-out reward at step {k} (both runs start here): {val0:.3f}\n")
    print("| steps | held-out reward: GRPO / filter | prompts generated a step: GRPO / filter | filter: zero-variance "
          "/ generated groups | filter: trained / generated groups | train reward: GRPO / filter | s/step: GRPO / "
          "filter | gen s/step: GRPO / filter |")
    print("|---" * 8 + "|")
    for lo, hi in _windows(k, end, every):
        p, f = (summarise(results[n], lo, hi, batch=batch, first=k + 1) for n in names)
        print(f"| {lo}-{hi} | {p['val']:.3f} / {f['val']:.3f} | {p['prompts']:.0f} / {f['prompts']:.0f} | "
              f"{f['zero_var']:.2f} | {f['trained']:.2f} | {p['reward']:.3f} / {f['reward']:.3f} | "
              f"{p['s_step']:.2f} / {f['s_step']:.2f} | {p['gen_s']:.2f} / {f['gen_s']:.2f} |")
    for n in names:
        whole = summarise(results[n], k + 1, end, batch=batch, first=k + 1)
        steady = [r["timing_s/step"] for r in results[n] if k + 1 < r["step"] <= end and "timing_s/step" in r]
        gen = [r["timing_s/gen"] for r in results[n] if k + 1 < r["step"] <= end and "timing_s/gen" in r]
        print(f"{n}: {whole['generated']} prompts generated in steps {k + 1}-{end}; steps {k + 2}-{end}: "
              f"{sum(steady):.1f} s ({_mean(steady):.2f} s/step), generation {sum(gen):.1f} s")

if __name__ == "__main__":
    main()
