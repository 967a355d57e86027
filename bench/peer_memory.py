"""Where rljax's peak RSS comes from at the ``bench/peer_trl.py`` 31m case: resident and peak memory per stage.

    python bench/peer_memory.py                 # 31.6M Qwen2, 8 prompts x 8, 32 new tokens, dp1, 3 steps
    python bench/peer_memory.py --new-tokens 256 --steps 2
    python bench/peer_memory.py --extra trace.ledgers=false

Runs the real trainer (``model.*`` overrides of the ``tiny`` preset, the character
vocabulary) with a step-runner observer that, around every stage, reads the process's
resident set (``VmRSS``) and its high-water mark (``VmHWM``, reset before each stage
through ``/proc/self/clear_refs``), so each row is the stage's own peak. Step 1 compiles
(the sampler's prefill / decode programs, the update, the log-prob pass when there is
one); later steps show the steady state. Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) / 1024
    return out


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _live_mb() -> float:
    """Bytes of the JAX arrays alive now (every device), MB: what the process still references."""
    import jax

    return sum(x.nbytes for x in jax.live_arrays()) / 2**20


class MemoryObserver:
    """Per stage: RSS before and after, the peak while it ran, and the JAX arrays alive after it (MB)."""

    def __init__(self):
        self.rows: list[tuple[int, str, float, float, float, float]] = []
        self._before = 0.0

    def step_start(self, step, t):
        _reset_peak()
        self._before = _status()["VmRSS"]

    def stage(self, ev):
        s = _status()
        self.rows.append((ev.step, ev.stage, self._before, s["VmRSS"], s["VmHWM"], _live_mb()))
        _reset_peak()
        self._before = _status()["VmRSS"]

    def step_end(self, step, metrics):
        pass

    def cleanup(self, report):
        pass


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--extra", nargs="*", default=[], help="more key=value overrides")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    t0 = time.perf_counter()
    start = _status()
    from rljax.config import resolve
    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    imported = _status()
    overrides = ["model.hidden_size=512", "model.intermediate_size=2048", "model.num_layers=8", "model.num_heads=8",
                 "model.num_kv_heads=4", "data.train_batch_size=8", "rollout.n=8", "actor.ppo_mini_batch_size=8",
                 f"data.max_response_length={args.new_tokens}", f"trainer.total_steps={args.steps}",
                 "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.val_before_train=false", *args.extra]
    cfg, _ = resolve("default", overrides)
    said: list = []
    trainer = Trainer(cfg, make_mesh("dp1"), tempfile.mkdtemp(prefix="peer_memory_"), echo=said.append)
    built = _status()
    obs = MemoryObserver()
    trainer.runner.observers.append(obs)
    timings = []
    for _ in range(args.steps):
        m = trainer.train_one_step()
        timings.append({k[len("timing_s/"):]: v for k, v in m.items() if k.startswith("timing_s/")})
    end = _status()
    print(f"RSS MB: start {start['VmRSS']:.0f}, after imports {imported['VmRSS']:.0f}, trainer built "
          f"{built['VmRSS']:.0f}, end {end['VmRSS']:.0f}; process peak {end['VmHWM']:.0f} (since the last reset); "
          f"peak-reset {'works' if _reset_peak() else 'unavailable'}; {time.perf_counter() - t0:.0f} s")
    print(f"{'step':>4}  {'stage':<20}{'RSS before':>11}{'RSS after':>10}{'stage peak':>11}{'peak - before':>14}"
          f"{'live arrays':>12}")
    for step, stage, before, after, peak, live in obs.rows:
        print(f"{step:>4}  {stage:<20}{before:>11.0f}{after:>10.0f}{peak:>11.0f}{peak - before:>14.0f}{live:>12.0f}")
    print("".join(f"{line}\n" for line in said if str(line).startswith("remat:")), end="")
    for i, t in enumerate(timings, 1):  # the step's stage seconds; 'outside' = step - the stages' sum
        stages = {k: v for k, v in t.items() if k != "step"}
        print(f"step {i} seconds: step {t.get('step', 0):.2f} = " + ", ".join(f"{k} {v:.2f}" for k, v in stages.items())
              + f", outside the stages {t.get('step', 0) - sum(stages.values()):.3f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
