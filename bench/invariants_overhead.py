"""What the whole-batch invariants cost a training step (issue 24: at most 2% of step time).

    python bench/invariants_overhead.py                       # tiny and 31m, --mesh dp2, 8 timed steps
    python bench/invariants_overhead.py --cases tiny --steps 20 --reps 50

Each case trains in this process (``rljax.trainer.loop.Trainer``, the tracer on as in every
run) and reports two things:

* **share of the step**: the tracer's own ``trace/invariants_s`` (everything the invariants
  do in a step: the device reduction, the transfer, the host digests and comparisons) over
  ``timing_s/step``, per timed step: median and max;
* **fused vs per-field**, side by side on the same step's arrays (an observer after the
  tracer replays them ``--reps`` times, the two alternating): the device part as the tracer
  does it now (:func:`rljax.trace.invariants.step_facts`: one jitted reduction for every fact,
  the response columns sliced inside it, one ``[k, B]`` transfer) against the path it
  replaced (a jitted reduction per mask, the response slice, the per-row loss tokens and the
  scores each dispatched and fetched on their own). Medians in ms and their ratio.

Cases: ``tiny`` is the test suite's small config (8 prompts x 4, 3 new tokens); ``31m`` is the
31.6M-parameter Qwen2 shape of ``bench/peer_trl.py`` (hidden 512, 8 layers, 8 / 4 heads, MLP
2048; 8 prompts x 8, 32 new tokens) through the model overrides. The machine is shared:
the load average is printed with the results.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["data.train_batch_size=8", "rollout.n=4", "actor.ppo_mini_batch_size=4", "data.embedded.num_train=64",
         "data.embedded.num_test=16"]
CASES = {
    "tiny": SMALL,
    "31m": ["model.hidden_size=512", "model.intermediate_size=2048", "model.num_layers=8", "model.num_heads=8",
            "model.num_kv_heads=4", "data.train_batch_size=8", "rollout.n=8", "data.max_response_length=32",
            "actor.ppo_mini_batch_size=8"],
}
COMMON = ["trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1"]


class Replay:
    """Observer after the tracer: times both device paths on each step's own arrays, then lets them go."""

    def __init__(self, reps: int):
        self.reps = reps
        self.events: list = []
        self.fused: list[float] = []
        self.per_field: list[float] = []

    def step_start(self, step, t):
        self.events = []

    def stage(self, event):
        self.events.append(event)

    def step_end(self, step, metrics):
        events, self.events = self.events, []
        fields = {}
        for ev in events:
            fields.update(ev.reads)
            fields.update(ev.writes)
        if fields.get("trajectories") is None or fields.get("loss_mask") is None:
            return
        args = _inputs(events, fields)
        _fused(*args), _per_field(*args)  # compiled outside the timing
        for _ in range(self.reps):
            for fn, out in ((_fused, self.fused), (_per_field, self.per_field)):
                t = time.perf_counter()
                fn(*args)
                out.append(time.perf_counter() - t)
        del events, fields, args

    def cleanup(self, report):
        pass


def _inputs(events, fields):
    """What the tracer reduces on device in a step: the distinct (loss_mask, input_ids) the
    learner stages read, the observation mask, the step's loss_mask and the advantages' scores."""
    import numpy as np

    traj = fields["trajectories"]
    pairs = {}
    for ev in events:
        lm = ev.reads.get("loss_mask")
        if lm is not None and ev.stage != "metrics" and lm.shape[0] == traj.batch_size:
            ids = ev.reads.get("input_ids", fields.get("input_ids"))
            pairs[(id(lm), id(ids))] = (lm, ids)
    roles = getattr(traj, "roles", None)
    obs = None if roles is None else np.asarray(roles) == 2
    adv = next((ev for ev in events if ev.stage == "advantages" and "scores" in ev.reads), None)
    return list(pairs.values()), obs, fields["loss_mask"], None if adv is None else adv.reads["scores"]


def _fused(pairs, obs, loss_mask, scores):
    from rljax.trace.invariants import step_facts

    return step_facts(pairs, obs, loss_mask, scores)


_PER_PAIR = {}


def _per_field(pairs, obs, loss_mask, scores):
    """The replaced path: one jitted reduction and fetch per mask, the rest dispatched one by one."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from rljax.sharding import to_host
    from rljax.trace.invariants import device_row_facts_traced

    row_tokens = np.asarray(to_host(jnp.sum(loss_mask, axis=1)))
    facts = []
    for lm, ids in pairs:
        key = (ids is not None, obs is not None)
        if key not in _PER_PAIR:
            _PER_PAIR[key] = jax.jit(lambda m, i, o, k=key: device_row_facts_traced(m, i if k[0] else None,
                                                                                    o if k[1] else None))
        resp = None if ids is None else ids[:, ids.shape[1] - lm.shape[1]:]
        facts.append({k: np.asarray(v) for k, v in jax.device_get(_PER_PAIR[key](lm, resp, obs)).items()})
    read = None if scores is None else np.asarray(to_host(scores), np.float32)
    return facts, row_tokens, read


def run_case(name: str, mesh: str, warmup: int, steps: int, reps: int) -> dict:
    from rljax.config import resolve
    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    cfg, _ = resolve("default", CASES[name] + COMMON + [f"trainer.total_steps={warmup + steps}"])
    trainer = Trainer(cfg, make_mesh(mesh), tempfile.mkdtemp(prefix=f"inv_{name}_"), echo=lambda *a: None)
    replay = Replay(reps)
    trainer.runner.observers.append(replay)
    shares, step_s, inv_s = [], [], []
    for i in range(warmup + steps):
        m = trainer.train_one_step()
        if i >= warmup:
            step_s.append(m["timing_s/step"])
            inv_s.append(m["trace/invariants_s"])
            shares.append(m["trace/invariants_s"] / m["timing_s/step"])
        else:  # the warm-up steps' replays include compilation
            replay.fused.clear(), replay.per_field.clear()
    params = sum(int(x.size) for x in __import__("jax").tree_util.tree_leaves(trainer.state.params))
    return dict(case=name, params_m=params / 1e6, rows=cfg.data.train_batch_size * cfg.rollout.n,
                step_ms=statistics.median(step_s) * 1e3, inv_ms=statistics.median(inv_s) * 1e3,
                share=statistics.median(shares), share_max=max(shares),
                fused_ms=statistics.median(replay.fused) * 1e3, per_field_ms=statistics.median(replay.per_field) * 1e3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="tiny,31m", help="comma-separated: " + ", ".join(CASES))
    ap.add_argument("--mesh", default="dp2")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps")
    ap.add_argument("--reps", type=int, default=20, help="replays of each device path per timed step")
    args = ap.parse_args(argv)
    names = [c for c in args.cases.split(",") if c]
    unknown = [c for c in names if c not in CASES]
    if unknown or not names:
        ap.error(f"--cases {args.cases!r}: unknown {', '.join(unknown) or '(none given)'}; accepted: "
                 f"{', '.join(CASES)}")
    from rljax.sharding.mesh import spec_device_count

    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                               f"--xla_force_host_platform_device_count={spec_device_count(args.mesh)}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, ROOT)
    rows = [run_case(n, args.mesh, args.warmup, args.steps, args.reps) for n in names]
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, load "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}, --mesh {args.mesh}, {args.steps} timed steps, "
          f"{args.reps} replays each")
    print("| case | params | rows | step (median) | invariants per step | share of step (median / max) "
          "| device part: fused | per-field | fused / per-field |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['params_m']:.1f}M | {r['rows']} | {r['step_ms']:.1f} ms | {r['inv_ms']:.2f} ms "
              f"| {100 * r['share']:.2f}% / {100 * r['share_max']:.2f}% | {r['fused_ms']:.3f} ms "
              f"| {r['per_field_ms']:.3f} ms | {r['fused_ms'] / r['per_field_ms']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
