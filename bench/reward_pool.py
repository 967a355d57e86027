"""Reward scoring: in the trainer's process vs a RewardPool of N worker processes.

    python bench/reward_pool.py [--batch 64] [--ms 20]

Three rewards, one batch each, all alternatives timed side by side in this process:
* ``sleep``: waits ``--ms`` per sample (a reward that calls a sandbox, a judge or a
  verifier service);
* ``cpu``: ``--ms`` of pure-Python work per sample (a symbolic math checker);
* ``embedded``: the built-in rule reward (microseconds): the pool's overhead per sample.
Prints seconds per batch and the speed-up over in-process (> 1: the pool is faster).
Startup of the workers is excluded (they start once per run, in the background).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

PLUGIN = '''
import time

def sleep(response, answer, **extra):
    time.sleep(MS / 1000)
    return 1.0

def cpu(response, answer, **extra):
    end = time.process_time() + MS / 1000
    x = 0
    while time.process_time() < end:
        x += 1
    return 1.0
'''


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ms", type=float, default=20.0)
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from rljax.reward import RewardPool, get_reward_fn, score_batch

    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "bench_reward.py")
    with open(path, "w") as fh:
        fh.write(PLUGIN.replace("MS", repr(args.ms)))
    responses = [f"{i % 10}" for i in range(args.batch)]
    answers = [f"{(i * 7) % 10}" for i in range(args.batch)]
    uids = list(range(args.batch))
    workers = [int(w) for w in args.workers.split(",")]
    print(f"batch {args.batch}, {args.ms:g} ms per sample for sleep/cpu, {os.cpu_count()} CPUs; "
          f"median of {args.repeats}")
    print(f"{'reward':<10} {'in-process s':>13} " + " ".join(f"{f'{w} workers s (x)':>20}" for w in workers))
    for name in ("sleep", "cpu", "embedded"):
        spec = "embedded" if name == "embedded" else f"{path}:{name}"
        fn = get_reward_fn(spec, dataset="embedded")

        def timed(scorer):
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                score_batch(scorer, responses, answers, uids, max_error_fraction=0.0)
                times.append(time.perf_counter() - t)
            return statistics.median(times)

        base = timed(fn)
        row = f"{name:<10} {base:>13.4f} "
        for w in workers:
            with RewardPool(spec, dataset="embedded", num_workers=w, timeout_s=60) as pool:
                pool.map([(responses[0], answers[0], {})] * w)  # wait for the workers to start
                t = timed(pool)
            row += f"{f'{t:.4f} ({base / t:.2f}x)':>20} "
        print(row)


if __name__ == "__main__":
    main()
