"""Synchronous colocated vs asynchronous disaggregated training, measured here and modelled at scale.

    python bench/async_pipeline.py [--steps 12] [--response-length 24] [--split 48,16] [--tau 2]
                                   [--measured-slots 0] [--lr 3e-4] [--task default|tool] [--filter]

``--task tool`` measures the multi-turn tool task instead (the ``tool_lookup`` preset: episodes
that park on a tool call between turns; ``--turn-tokens`` per model turn, ``--response-length``
of turns and observations); it prints part 1 only (the model is of single-turn decoding).
``--filter`` turns on DAPO dynamic sampling (``algorithm.filter_groups``) in every run: a step
draws prompt batches until ``data.train_batch_size`` groups have reward variance.

Part 1, measured (one process, 8 CPU devices, side by side): the embedded task with a
long-tailed response length (``data.max_response_length=--response-length``; the policy
ends its answers with EOS at varying positions, so a batch waits for its longest
trajectory) trained ``--steps`` steps as

* ``sync``: ``trainer.mode=sync``, colocated, learner mesh dp8, sampler on the same 8 devices;
* ``async tau=--tau batch/call`` and ``streaming``: ``trainer.mode=async``,
  ``rollout.placement=disaggregated``, learner mesh dp4 + sampler on the 4 other devices; one
  ``generate`` call per batch (``async_training.streaming=false``) and streaming admission
  (``streaming=true partial_rollout=true``: slots a batch's tail frees take the next batches'
  prompts).

Printed per run: median step wall time, slot occupancy (``rollout/slot_occupancy``: live slots
/ slots over the decode steps), prompts admitted ahead (``rollout/admitted_ahead``), learner
idle fraction (sync: the share of the step
spent generating and scoring; async: ``async/learner_wait_s`` over the wall time), rollout
idle fraction (sync: the share of the step not generating; async: the producer's time
waiting for admission or queue room, ``async/rollout_wait_s``), mean staleness, and the
train reward against wall time. Two CPU cores serve all 8 "devices", so the two sides
mostly time-share the same cores: the measured overlap here is small or negative, and
that is not what the placement gives on real devices.

Part 2, a discrete-event model fed with the measured stage times of the sync run:
``t_step`` (seconds per decode step of a replica, from the sampler's decode time over its
decode steps), the per-trajectory response-length distribution (the lengths of every
generated trajectory), the learner's time per batch (``old_log_prob`` + ``adv`` +
``update_actor``) and the weight sync time. It predicts steps per hour of both placements
for a larger split (default 64 devices: sync colocated on 64 vs async with 48 rollout +
16 learner devices) and prints the speed-up beside verl's published 2.35-2.67x
(``docs/advance/fully_async.md`` in verl, 128 GPUs). Assumptions:

1. Decode is memory-bound: a replica's decode step takes ``t_step`` whatever the number of
   busy slots, so a trajectory of length ``L`` holds a slot for ``L * t_step`` (+ one
   prefill of ``t_prefill``).
2. Continuous batching: each replica has ``--slots`` slots; a trajectory starts as soon as
   a slot is free and its batch is admitted. Lengths are drawn i.i.d. from the measured
   distribution scaled by ``--length-scale`` (long reasoning: the tail is what matters).
3. The learner scales linearly with its devices: a batch takes ``learner_s * D_meas / L``
   on ``L`` devices (``D_meas`` = 8, the measured mesh); the weight sync takes the measured
   time times ``--sync-scale`` on both placements.
4. Sync colocated: generation of batch ``k+1`` starts after the update and sync of batch
   ``k``; all devices decode, then all devices train. Async: the producer admits batch
   ``k`` when the learner version at which it will be consumed minus the newest pushed
   weight version is at most tau (the rule of :class:`rljax.rollout.queue.TrajectoryQueue`),
   and at most ``--queue`` batches wait; the learner trains batches in order.
5. No failures, no stale drops, no reward time (the rule reward takes microseconds).
6. Two producers are modelled: ``batch-at-a-time`` (rljax's rollout thread: one
   ``generate`` call per batch, so the next batch starts when the previous one is complete)
   and ``streaming`` (the next admitted batch's trajectories take slots freed by the tail of
   the previous one, as verl's fully-async rollouter does).
7. When the measured lengths have no tail (all clipped at ``max_response_length``), the
   model draws lengths from a lognormal with the measured mean and ``--sigma``.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


# ---------------------------------------------------------------------------- measured runs


def _run(label: str, overrides: list[str], steps: int, learner: int, root: str, preset: str = "default") -> dict:
    import jax

    from rljax.config import resolve
    from rljax.sharding import make_mesh
    from rljax.trainer.loop import Trainer

    cfg, _ = resolve(preset, overrides + [f"trainer.total_steps={steps}", "trace.groups=0", "trace.ledgers=false",
                                              "trainer.val_before_train=false", "trainer.test_freq=-1"])
    mesh = make_mesh(f"dp{learner}", jax.devices()[:learner])
    trainer = Trainer(cfg, mesh, os.path.join(root, label.replace(" ", "_").replace("=", "")), echo=lambda *a: None)
    lengths, decode = [], {"s": 0.0, "steps": 0}
    sampler = trainer.services.rollout.sampler
    gen, assemble = sampler.generate, sampler.assemble

    def recording_assemble(*a, **k):  # every generated batch's lengths (generate and the streaming producer)
        traj = assemble(*a, **k)
        lengths.extend(np.asarray(traj.response_length)[~np.asarray(traj.is_padding)].tolist())
        return traj

    def recording_generate(*a, **k):  # the decode time per decode step (sync: one call per batch)
        user = k.pop("on_chunk", None)
        last = {"steps": 0}

        def on_chunk(info):
            last["steps"] = info.total_steps
            if user is not None:
                user(info)

        traj = gen(*a, on_chunk=on_chunk, **k)
        decode["calls"] = decode.get("calls", 0) + 1
        if decode["calls"] > 1:  # the first call compiles the decode chunk
            decode["s"] += traj.stats.decode_s
            decode["steps"] += last["steps"]
        return traj

    sampler.generate, sampler.assemble = recording_generate, recording_assemble  # the instance's: the producer's too
    rows, t0 = [], time.perf_counter()
    try:
        for _ in range(steps):
            m = trainer.train_one_step()
            m["wall"] = time.perf_counter() - t0
            rows.append(m)
    finally:
        trainer.schedule.close()
        trainer.tracer.close()
    wall = time.perf_counter() - t0
    # Steady state: the first two steps compile (the producer also waits through the learner's compile).
    steady = rows[2:] if len(rows) > 3 else rows[1:]
    span = max(steady[-1]["wall"] - rows[rows.index(steady[0]) - 1]["wall"], 1e-9)
    step_s = [r["timing_s/step"] for r in steady]
    if cfg.trainer.mode != "async":
        busy_gen = sum(r.get("timing_s/gen", 0) + r.get("timing_s/reward", 0) for r in steady)
        learner_idle = busy_gen / max(sum(step_s), 1e-9)
        rollout_idle = 1 - learner_idle
        staleness = 0.0
    else:
        step_s = [span / len(steady)]  # wall time per trained batch (the learner's step excludes its wait)
        learner_idle = sum(r["async/learner_wait_s"] for r in steady) / span
        rollout_idle = sum(r["async/rollout_wait_s"] for r in steady) / span
        staleness = float(np.mean([r["async/staleness_mean"] for r in rows]))
    occ = [r["rollout/slot_occupancy"] for r in steady if "rollout/slot_occupancy" in r]
    occupancy = float(np.mean(occ)) if occ else float("nan")  # none: every token sampled at prefill / extend
    ahead = float(np.mean([r.get("rollout/admitted_ahead", 0) for r in steady]))
    learner_s = statistics.median(r.get("timing_s/old_log_prob", 0) + r.get("timing_s/adv", 0) +
                                  r.get("timing_s/update_actor", 0) for r in rows[1:] or rows)
    return {"label": label, "rows": rows, "wall": wall, "step_s": statistics.median(step_s),
            "learner_idle": learner_idle, "rollout_idle": rollout_idle, "staleness": staleness,
            "occupancy": occupancy, "ahead": ahead,
            "draws": float(np.mean([r.get("train/num_gen_batches", 1) for r in steady])),
            "lengths": np.asarray(lengths), "t_step": decode["s"] / max(decode["steps"], 1), "learner_s": learner_s,
            "sync_s": statistics.median(r.get("timing_s/update_weights", 0) for r in rows[1:] or rows),
            "devices": learner}


# ---------------------------------------------------------------------------- the model


def _generate(batch_start: float, lengths: np.ndarray, slots: list, t_step: float, t_prefill: float) -> float:
    """Runs one batch's trajectories through the slot heap (free times); returns its finish time."""
    done = batch_start
    for length in lengths:
        free = heapq.heappop(slots)
        start = max(free, batch_start)
        end = start + t_prefill + length * t_step
        heapq.heappush(slots, end)
        done = max(done, end)
    return done


def simulate(*, mode: str, rollout_devices: int, learner_devices: int, batch: int, slots: int, lengths: np.ndarray,
             t_step: float, t_prefill: float, learner_s: float, meas_devices: int, sync_s: float, tau: int = 1,
             queue: int = 2, steps: int = 200, seed: int = 0, streaming: bool = False) -> dict:
    """Seconds for ``steps`` learner steps under the assumptions of the module docstring."""
    rng = np.random.default_rng(seed)
    replicas = rollout_devices
    slot_heap = [0.0] * (replicas * slots)
    heapq.heapify(slot_heap)
    update = learner_s * meas_devices / learner_devices
    draws = [rng.choice(lengths, size=batch) for _ in range(steps)]
    gen_busy = 0.0
    if mode == "sync":
        t = 0.0
        for k in range(steps):
            done = _generate(t, draws[k], slot_heap, t_step, t_prefill)
            gen_busy += done - t
            t = done + update + sync_s
            slot_heap = [t] * len(slot_heap)
        return {"total_s": t, "step_s": t / steps, "learner_idle": gen_busy / t, "staleness": 0.0}
    ready = [0.0] * steps  # when batch k is in the queue
    learner_done = [0.0] * steps  # when the learner finished batch k (and pushed weights)
    start = [0.0] * steps
    t_learner, staleness = 0.0, []
    # The producer admits batch k (consumed at learner version k) when the pushed version >= k - tau,
    # i.e. after the learner finished batch k - tau (batches are 0-based: weights v = batches trained),
    # and when at most `queue` batches wait in front of it.
    for k in range(steps):
        admit = learner_done[k - tau - 1] if k - tau - 1 >= 0 else 0.0
        if k - queue - 1 >= 0:  # queue room: batch k - queue - 1 was taken by the learner
            admit = max(admit, learner_done[k - queue - 1] - update - sync_s)
        # rljax's producer generates one batch at a time (a generate() call); streaming lets the next
        # batch's trajectories take slots as soon as it is admitted (verl's fully-async rollouter).
        admit = max(admit, (start[k - 1] if streaming else ready[k - 1]) if k else 0.0)
        start[k] = admit
        ready[k] = _generate(admit, draws[k], slot_heap, t_step, t_prefill)
        gen_busy += ready[k] - admit
        begin = max(t_learner, ready[k])
        t_learner = begin + update + sync_s
        learner_done[k] = t_learner
        pushed = sum(1 for j in range(k) if learner_done[j] <= admit)
        staleness.append(k - pushed)
    total = learner_done[-1]
    learner_busy = steps * (update + sync_s)
    return {"total_s": total, "step_s": total / steps, "learner_idle": 1 - learner_busy / total,
            "staleness": float(np.mean(staleness))}


# ---------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--response-length", type=int, default=24)
    ap.add_argument("--split", default="48,16", help="rollout,learner devices of the modelled async placement")
    ap.add_argument("--batch", type=int, default=1024, help="trajectories per step in the model")
    ap.add_argument("--slots", type=int, default=32, help="decode slots per rollout device in the model")
    ap.add_argument("--length-scale", type=float, default=100.0,
                    help="model: multiply the measured lengths (long-reasoning responses)")
    ap.add_argument("--sync-scale", type=float, default=1.0)
    ap.add_argument("--sigma", type=float, default=1.0, help="model: lognormal length spread when none was measured")
    ap.add_argument("--tau", type=int, default=2, help="measured async runs' max_staleness")
    ap.add_argument("--measured-slots", type=int, default=0,
                    help="measured runs' rollout.max_slots (0: the whole batch)")
    ap.add_argument("--lr", type=float, default=3e-4,
                    help="measured runs' actor.optim.lr (a small one keeps the untrained model's length distribution)")
    ap.add_argument("--task", choices=("default", "tool"), default="default",
                    help="tool: the multi-turn tool_lookup preset (part 1 only)")
    ap.add_argument("--turn-tokens", type=int, default=3, help="--task tool: env.max_turn_tokens")
    ap.add_argument("--filter", action="store_true", help="algorithm.filter_groups.enable=true in every run")
    ap.add_argument("--save", default=None, help="write the model's measured inputs to this JSON file")
    ap.add_argument("--model-from", default=None,
                    help="skip the measured runs: feed the model the inputs a --save wrote (e.g. other --length-scale)")
    args = ap.parse_args()
    if args.model_from:
        with open(args.model_from) as fh:
            base = json.load(fh)
        base["lengths"] = np.asarray(base["lengths"])
        print(f"model inputs from {args.model_from} (measured {base.get('measured_at', '?')})")
    else:
        base = measure(args)
        if args.task == "tool":
            return
        if args.save:
            with open(args.save, "w") as fh:
                json.dump({k: base[k] for k in ("t_step", "learner_s", "sync_s", "devices")}
                          | {"lengths": base["lengths"].tolist(), "measured_at": time.strftime("%Y-%m-%d %H:%M")}, fh)
    model(args, base)


def measure(args) -> dict:
    """Part 1: the measured runs, side by side; returns the sync run (the model's inputs)."""
    common = [f"data.max_response_length={args.response_length}", "data.train_batch_size=16", "rollout.n=8",
              "actor.ppo_mini_batch_size=8", f"actor.optim.lr={args.lr}"]
    preset = "default"
    if args.task == "tool":
        preset = "tool_lookup"
        common += [f"env.max_turn_tokens={args.turn_tokens}", "data.embedded.num_test=16"]
    if args.filter:
        common += ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=0"]
    if args.measured_slots:
        common.append(f"rollout.max_slots={args.measured_slots}")
    runs = []
    with tempfile.TemporaryDirectory() as root:
        runs.append(_run("sync colocated dp8", common, args.steps, 8, root, preset))
        for tau, streaming in ((args.tau, False), (args.tau, True)):
            label = f"async dp4+4 tau={tau} " + ("streaming" if streaming else "batch/call")
            runs.append(_run(label, common + [
                "trainer.mode=async", "rollout.placement=disaggregated", "rollout.num_devices=4",
                f"async_training.max_staleness={tau}", f"async_training.queue_size={tau + 1}",
                f"async_training.streaming={str(streaming).lower()}",
                f"async_training.partial_rollout={str(streaming).lower()}"], args.steps, 4, root, preset))
    base = runs[0]
    lengths = base["lengths"]  # single-turn rollouts' (episodes are assembled by rljax.env: not recorded)
    spread = (f", lengths mean {lengths.mean():.1f} p50 {np.percentile(lengths, 50):.0f} p90 "
              f"{np.percentile(lengths, 90):.0f} p99 {np.percentile(lengths, 99):.0f} max {lengths.max()}, std of "
              f"log-length {np.log(np.maximum(lengths, 1)).std():.2f}") if lengths.size else ""
    print(f"\nmeasured on 8 CPU devices (2 cores), task {args.task}{' + filter_groups' if args.filter else ''}, "
          f"{args.steps} steps, max_response_length {args.response_length}{spread}")
    print(f"{'run':30s} {'step s':>7s} {'vs sync':>8s} {'slot occ.':>9s} {'ahead':>6s} {'learner idle':>13s} "
          f"{'rollout idle':>13s} {'staleness':>9s} {'reward (wall s)':>30s}" + ("  draws/step" if args.filter else ""))
    for r in runs:
        marks = [r["rows"][i] for i in sorted({len(r["rows"]) // 3, 2 * len(r["rows"]) // 3, len(r["rows"]) - 1})]
        curve = " ".join(f"{m['critic/score/mean']:.2f}@{m['wall']:.0f}" for m in marks)
        print(f"{r['label']:30s} {r['step_s']:7.2f} {base['step_s'] / r['step_s']:7.2f}x {r['occupancy']:9.2f} "
              f"{r['ahead']:6.1f} {r['learner_idle']:13.2f} {r['rollout_idle']:13.2f} {r['staleness']:9.2f} {curve:>30s}"
              + (f"  {r['draws']:10.2f}" if args.filter else ""))

    return base


def model(args, base: dict) -> None:
    """Part 2: the discrete-event model fed with the measured costs."""
    rollout_d, learner_d = (int(x) for x in args.split.split(","))
    total_d = rollout_d + learner_d
    measured = base["lengths"]
    if np.percentile(measured, 99) < 1.5 * np.percentile(measured, 50):  # clipped at max length: no tail measured
        rng = np.random.default_rng(0)
        measured = measured.mean() * rng.lognormal(-args.sigma ** 2 / 2, args.sigma, size=4096)
        print(f"(the measured lengths have no tail; the model draws lognormal(sigma={args.sigma}) lengths with the "
              f"measured mean {base['lengths'].mean():.1f})")
    lengths = np.maximum(1, np.round(measured * args.length_scale)).astype(int)
    t_prefill = base["t_step"] * 2
    inputs = dict(batch=args.batch, slots=args.slots, lengths=lengths, t_step=base["t_step"], t_prefill=t_prefill,
                 learner_s=base["learner_s"] * args.length_scale, meas_devices=base["devices"],
                 sync_s=base["sync_s"] * args.sync_scale)
    print(f"\nmodel inputs (measured): t_step {base['t_step'] * 1e3:.2f} ms/decode step, learner {base['learner_s']:.2f} "
          f"s/batch on {base['devices']} devices (x{args.length_scale:g} for x{args.length_scale:g} lengths), weight "
          f"sync {base['sync_s'] * 1e3:.1f} ms; batch {args.batch} trajectories, {args.slots} slots/device")
    sync = simulate(mode="sync", rollout_devices=total_d, learner_devices=total_d, **inputs)
    print(f"{'placement':34s} {'step s':>8s} {'steps/h':>8s} {'speed-up':>9s} {'learner idle':>13s} {'staleness':>9s}")
    print(f"{'sync colocated ' + str(total_d):34s} {sync['step_s']:8.1f} {3600 / sync['step_s']:8.1f} {1.0:8.2f}x "
          f"{sync['learner_idle']:13.2f} {0.0:9.2f}")
    for tau, streaming in ((1, False), (2, False), (1, True), (2, True)):
        a = simulate(mode="async", rollout_devices=rollout_d, learner_devices=learner_d, tau=tau, queue=tau + 1,
                     streaming=streaming, **inputs)
        label = f"async {rollout_d}+{learner_d} tau={tau}" + (" streaming" if streaming else " batch-at-a-time")
        print(f"{label:34s} {a['step_s']:8.1f} "
              f"{3600 / a['step_s']:8.1f} {sync['step_s'] / a['step_s']:8.2f}x {a['learner_idle']:13.2f} "
              f"{a['staleness']:9.2f}")
    print("verl fully-async (published, 128 GPUs): 2.35-2.67x end-to-end")


if __name__ == "__main__":
    main()
