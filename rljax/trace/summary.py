"""``python -m rljax.trace summary RUN_DIR``: the run's topology, non-default config with
sources, shape ledger, memory ledger, stage-time split, tracing overhead and alerts as tables."""

from __future__ import annotations

import json
import os
from typing import Sequence

from rljax.config import load_resolved, non_default_fields
from rljax.trace.faults import describe as describe_faults
from rljax.trace.metrics import read_metrics


def table(rows: Sequence[Sequence], header: Sequence[str]) -> str:
    rows = [[("" if c is None else str(c)) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _load(run_dir: str, name: str):
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.3f}"


def slot_occupancy(run_dir: str, *, rows: int = 30) -> str:
    """``rollout/slot_occupancy`` (live slots / slots over each step's decode steps) and, in async
    runs, ``rollout/admitted_ahead`` per step from ``metrics.jsonl``, drawn as bars (at most
    ``rows`` steps, evenly spaced); empty when the run logged none."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return ""
    by_step = {}
    with open(path) as fh:
        for line in fh:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a killed run
                continue
            if "rollout/slot_occupancy" in r and "step" in r:
                by_step[int(r["step"])] = r  # a resumed run's re-run step: the last counts
    if not by_step:
        return ""
    steps = sorted(by_step)
    n = min(rows, len(steps))
    shown = [steps[round(i * (len(steps) - 1) / max(1, n - 1))] for i in range(n)]
    mean = sum(by_step[k]["rollout/slot_occupancy"] for k in steps) / len(steps)
    table_rows = []
    for k in dict.fromkeys(shown):
        r = by_step[k]
        occ = float(r["rollout/slot_occupancy"])
        table_rows.append((k, f"{occ:.3f}", r.get("rollout/admitted_ahead", ""), "#" * max(0, round(40 * occ))))
    return (f"\n== rollout slot occupancy (live slots / slots over the decode steps): mean {mean:.3f} over "
            f"{len(steps)} step(s)\n" + table(table_rows, ("step", "occupancy", "admitted ahead", "")))


def summarize_run(run_dir: str) -> str:
    """Every section of ``python -m rljax.trace summary``, in order, as text."""
    sections = (_topology, _asynchronous, slot_occupancy, _config, _shape_ledger, _memory_ledger, _stage_times,
                _bytes_per_field, _trace)
    return "\n".join(text for section in sections for text in _lines(section(run_dir)))


def _lines(part) -> list:
    """A section's text: a list of blocks, one block, or nothing (an empty string)."""
    if isinstance(part, list):
        return part
    return [part] if part else []


def _topology(run_dir: str) -> list:
    out = ["== topology"]
    topo = _load(run_dir, "topology.json")
    if not topo:
        return out + ["(topology.json missing)"]
    rows = [(k, json.dumps(v) if isinstance(v, (dict, list)) else v) for k, v in topo.items() if k != "placement"]
    out.append(table(rows, ("field", "value")))
    pl = topo.get("placement")
    if pl:
        ratio = pl.get("device_ratio") or {}
        out.append(f"\n== placement: {pl['mode']} (trainer.mode={pl.get('trainer_mode')}); device groups "
                   + ("disjoint" if pl.get("disjoint") else "shared (colocated)")
                   + (f"; rollout:learner devices {ratio['rollout']}:{ratio['learner']} = {ratio['ratio']}"
                      if ratio else ""))
        r = pl["rollout"]
        out.append(table([("learner", json.dumps(pl["learner"]["devices"]), json.dumps(pl["learner"]["mesh"]), "-"),
                          ("rollout", json.dumps(r["devices"]), json.dumps(r["mesh"]),
                           f"{r['replicas_per_process']} replica(s) x tp{r['tp']} per process")],
                         ("group", "devices", "mesh", "replicas")))
    return out


def _asynchronous(run_dir: str) -> list:
    a = (_load(run_dir, "trace_summary.json") or {}).get("async")
    if not a:
        return []
    out = [f"\n== asynchronous training: max_staleness {a.get('max_staleness')}, {a.get('trained_batches')} "
           f"batch(es) trained of {a.get('batches_put')} queued; dropped {a.get('final_dropped_stale')} stale, "
           f"{a.get('final_dropped_overflow')} overflow row(s); queue depth max {a.get('max_queue_depth')}"]
    before = (a.get("dropped_stale_restored", 0), a.get("dropped_overflow_restored", 0))
    if any(before):
        out.append(f"resumed: these counts are the last launch's; its checkpoint counted {before[0]} stale, {before[1]} "
                   "overflow row(s) dropped before it (async/dropped_* in metrics.jsonl are the sums)")
    gen = a.get("final_generated_rows")
    if gen is not None:
        dropped = a.get("final_dropped_stale", 0) + a.get("final_dropped_overflow", 0)
        trained = a.get("trained_rows", 0)
        pct = (lambda n: f"{100 * n / gen:.1f}%" if gen else "-")  # noqa: E731
        out.append(table([("generated", gen, pct(gen)), ("trained", trained, pct(trained)),
                          ("dropped", dropped, pct(dropped)),
                          ("  stale", a.get("final_dropped_stale", 0), pct(a.get("final_dropped_stale", 0))),
                          ("  overflow", a.get("final_dropped_overflow", 0),
                           pct(a.get("final_dropped_overflow", 0))),
                          ("queued or unused at the end", gen - trained - dropped, pct(gen - trained - dropped))],
                         ("rows", "count", "of generated")))
    hist = a.get("staleness_hist") or {}
    total = sum(hist.values()) or 1
    out.append(table([(k, n, "#" * max(1, round(40 * n / total))) for k, n in sorted(hist.items(), key=lambda kv: int(kv[0]))],
                     ("staleness", "rows", "")))
    return out


def _config(run_dir: str) -> list:
    out = ["\n== resolved config: non-default fields"]
    path = os.path.join(run_dir, "config.resolved.yaml")
    if not os.path.exists(path):
        return out + ["(config.resolved.yaml missing)"]
    cfg, prov = load_resolved(path)
    changes = non_default_fields(cfg, prov)
    return out + [table([(c.key, c.value, c.default, c.source) for c in changes], ("key", "value", "default", "source"))
                  if changes else "(all defaults)"]


def _shape_ledger(run_dir: str) -> list:
    out = ["\n== shape ledger"]
    shapes = _load(run_dir, "shape_ledger.json")
    if not shapes:
        return out + ["(shape_ledger.json missing)"]
    cols = ("stage", "tensor", "logical_shape", "local_shape", "mask_broadcast", "owner_devices", "produced_at",
            "consumed_at", "freed_after")
    out.append(table([[r.get(c) for c in cols] for r in shapes], cols))
    out.append("common bugs:\n" + "\n".join(f"  {r['tensor']}: {r['common_bug']}" for r in shapes))
    notes = [f"  {r['tensor']}: {r['note']}" for r in shapes if r.get("note")]
    if notes:
        out.append("layout notes:\n" + "\n".join(notes))
    return out


def _memory_ledger(run_dir: str) -> list:
    out = ["\n== memory ledger (per device, MiB)"]
    mem = _load(run_dir, "memory_ledger.json")
    if not mem:
        return out + ["(memory_ledger.json missing)"]
    out.append(table([(r["item"], _mib(r["estimate_bytes"]), _mib(r["measured_bytes"]), r["measured_from"])
                      for r in mem["rows"]], ("item", "estimate", "measured", "measured from")))
    st = [(k, *(_mib(v.get(x)) for x in ("argument", "output", "temp", "peak"))) if v and "error" not in v
          else (k, "not measured", "", "", "") for k, v in mem["stages"].items()]
    out.append(table(st, ("stage", "argument", "output", "temp", "peak")))
    out.append(f"peak stage: {mem.get('peak_stage')} ({_mib(mem.get('peak_bytes'))} MiB); "
               f"device memory stats: {mem.get('device_memory_stats')}")
    return out


def _stage_times(run_dir: str) -> list:
    totals: dict[str, float] = {}
    for m in read_metrics(run_dir):
        for k, v in m.items():
            if k.startswith("timing_s/") and k != "timing_s/step":
                if isinstance(v, (int, float)):
                    totals[k] = totals.get(k, 0.0) + v
    loop = {k: v for k, v in totals.items() if k.startswith("timing_s/")}
    busy = sum(loop.values()) or 1.0
    rows = [(k, f"{v:.3f}", f"{100 * v / busy:.1f}%") for k, v in sorted(loop.items(), key=lambda kv: -kv[1])]
    return ["\n== stage-time split", table(rows, ("stage", "seconds", "share")) if rows else "(metrics.jsonl missing)"]


def _bytes_per_field(run_dir: str) -> list:
    s = _load(run_dir, "trace_summary.json")
    out = []
    sizes = (s or {}).get("bytes_per_field") or {}
    if sizes:
        out.append("\n== bytes per batch field, by the stage that wrote it (global, largest step)")
        out.append(table([(stage, f, _mib(n)) for stage, fields in sizes.items() for f, n in
                          sorted(fields.items(), key=lambda kv: -kv[1])], ("stage", "field", "MiB")))
    slow = (s or {}).get("slowest_process_steps") or {}
    if len(slow) > 1 or any(k != "0" for k in slow):
        out.append("slowest process: " + ", ".join(f"process {p} in {n} step(s)" for p, n in slow.items()))
    return out


def _trace(run_dir: str) -> list:
    out = ["\n== trace"]
    s = _load(run_dir, "trace_summary.json")
    if not s:
        return out + ["(trace_summary.json missing)"]
    out.append(f"{s['records']} records over {s['steps']} steps ({s['groups_per_step']} group(s) per step); "
               f"tracing overhead {100 * s.get('overhead_frac_median', 0):.2f}% of step time (median; "
               f"max {100 * s.get('overhead_frac_max', 0):.2f}%)"
               + (f", its background threads' CPU {100 * s['background_frac']:.2f}% more" if "background_frac" in s
                  else "") + f", ledgers {s.get('ledger_s', 0):.2f} s once")
    if s.get("status") != "completed":
        out.append(f"status: {s.get('status')} (records up to step {s.get('last_step')})"
                   + (f": {s['error']}" if s.get("error") else ""))
    elif s.get("stopped"):  # completed by the resume of a run that trained every step
        out.append(f"status: completed by a resume: {s['stopped'].get('how')}")
    out.append("alerts: " + (", ".join(f"{k} x{v}" for k, v in s["alerts"].items()) if s.get("alerts") else "none"))
    if s.get("faults"):
        out.append(f"faults switched on (rljax.trace.faults, tests only): {describe_faults(s['faults'])}")
    inv = s.get("invariants") or {}
    if inv.get("error") or inv.get("skipped"):
        out.append(f"whole-batch invariants: not checked ({inv.get('error') or inv['skipped']})")
    elif inv:
        out.append(f"whole-batch invariants: {inv.get('rows', 0)} rows over {inv.get('steps', 0)} step(s), "
                   f"{inv.get('violating_rows', 0)} violating; {1000 * inv.get('s', 0.0):.1f} ms in all"
                   + ("; scores tied to their trajectories" if inv.get("scores_tied") else ""))
    return out
