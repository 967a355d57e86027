"""The rollout/learner mismatch table: verl's ``training/rollout_*`` metrics on short runs.

rljax samples and trains with the same model functions, so with the same weights its
sampler's token probabilities differ from the learner's only by floating-point reduction
order. This script measures that, per layout and mode, on the embedded task: each row is a
short ``python -m rljax.launch`` run (``--steps`` steps, default 3); the table reports the
mean over the steps of each metric (max: the largest step).

* ``sync dp8`` / ``sync dp2,tp2,sp2``: the synchronous step on 8 CPU devices.
* ``async tau=1``: ``trainer.mode=async``, ``max_staleness=1``: the learner's ``old_logp``
  is recomputed at consumption with weights up to one version newer than the sampler's, so
  the mismatch includes the policy's own change over one step (what TIS corrects).
* ``LoRA``: rank-8 adapters (the sampler gets the merged weights).
* ``bfloat16``: ``model.dtype=bfloat16`` compute (parameters float32).
* ``multi-turn``: the tool-lookup preset (observation tokens are masked out).

    python bench/rollout_mismatch.py --out /tmp/mismatch           # every row
    python bench/rollout_mismatch.py --rows "sync dp8" --steps 2    # one row
"""

import argparse
import json
import os
import subprocess
import sys
import time

SMALL = ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.embedded.num_train=64",
         "data.embedded.num_test=16", "trainer.test_freq=-1", "trainer.val_before_train=false", "trace.ledgers=false",
         "actor.optim.lr=3e-4"]
#: (row, launcher arguments)
ROWS = [
    ("sync dp8", ["--mesh=dp8", *SMALL]),
    ("sync dp2,tp2,sp2", ["--mesh=dp2,tp2,sp2", *SMALL]),
    ("async tau=1", ["--mesh=dp8", *SMALL, "trainer.mode=async", "async_training.max_staleness=1"]),
    ("LoRA rank 8", ["--mesh=dp8", *SMALL, "actor.lora.rank=8", "actor.lora.alpha=16", "actor.optim.lr=3e-3"]),
    ("bfloat16 compute", ["--mesh=dp8", *SMALL, "model.dtype=bfloat16"]),
    ("multi-turn (tool_lookup)", ["--mesh=dp8", "--config", "tool_lookup", "data.train_batch_size=8", "rollout.n=4",
                                  "actor.ppo_mini_batch_size=4", "trainer.test_freq=-1",
                                  "trainer.val_before_train=false", "trace.ledgers=false"]),
]
KEYS = ("training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std",
        "training/rollout_logprobs_diff_max", "training/rollout_actor_probs_pearson_corr")


def run_row(name: str, args: list, steps: int, out: str) -> dict:
    run_dir = os.path.join(out, name.replace(" ", "_").replace(",", "").replace("=", ""))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("XLA_FLAGS", None)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "rljax.launch", "--run-dir", run_dir, *args,
                        f"trainer.total_steps={steps}"], env=env, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        recs = [r for r in map(json.loads, f) if KEYS[0] in r]
    row = {k: (max if k.endswith("_max") else lambda v: sum(v) / len(v))([r[k] for r in recs]) for k in KEYS}
    row.update(steps=len(recs), wall_s=time.perf_counter() - t)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/rollout_mismatch")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", nargs="*", default=[r for r, _ in ROWS])
    a = ap.parse_args()
    unknown = set(a.rows) - {r for r, _ in ROWS}
    if unknown:
        ap.error(f"unknown rows {sorted(unknown)}; accepted: {[r for r, _ in ROWS]}")
    print(f"load: {os.getloadavg()[0]:.1f}", flush=True)
    print("| run | probs_diff_max | probs_diff_mean | probs_diff_std | logprobs_diff_max | pearson_corr | steps |")
    print("|---|---|---|---|---|---|---|", flush=True)
    for name, args in ROWS:
        if name in a.rows:
            r = run_row(name, args, a.steps, a.out)
            print(f"| {name} | " + " | ".join(f"{r[k]:.3g}" for k in KEYS) + f" | {r['steps']} |", flush=True)


if __name__ == "__main__":
    main()
