"""The whole-batch invariants (:mod:`rljax.trace.invariants`) over every row of every step: what
the learner read against what the rollout produced, for each distinct ``loss_mask`` /
``input_ids`` a learner stage read, and the scores tie. ``trace_summary.json``'s ``invariants``;
one ``batch_invariant`` alert per step naming the first violation."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Mapping, Optional

import numpy as np

from rljax.sharding import to_host
from rljax.trace import invariants as I, recompute as RC
from rljax.trace.groups import traced_rows
from rljax.trace.observers.step import StepView

log = logging.getLogger("rljax.trace")
#: Why the re-derivations do not run on several processes (their N/A in ``trace check``).
SEVERAL = ("several processes: the re-derivations run where one process holds every row of the batch (each "
           "process's rows are checked by the whole-batch invariants; the digest log is per process)")


class WholeBatch:
    """The invariants' totals over the run, and the step's counts and alert."""

    def __init__(self, recompute=None):
        self.summary: dict[str, Any] = {"steps": 0, "rows": 0, "violating_rows": 0, "violations": []}
        self.recompute = recompute  # the re-derivations (rljax.trace.recompute), in the same reduction
        self.alerts: list = []  # this step's (at most one)
        self.counts: Optional[dict] = None  # this step's rows, violating rows and seconds
        self.attended: Optional[np.ndarray] = None  # this step's attended tokens per row (the reduction's)
        self._early: Optional[tuple] = None  # (step_facts' inputs, its Job) started at the update's event
        self.taken_mid_step = 0  # steps whose reduction was the one started at the update's event
        self._rollout: Optional[tuple] = None  # (trajectories, the Job making their rollout_facts) from their event
        self.taken_mid_step_rollout = 0  # steps whose rollout facts were made at the trajectories' event

    def step(self, view) -> Optional[np.ndarray]:
        """Checks the step; returns the per-row loss-mask sums of the whole learner batch (the
        reduction has them; None: not computed here). A check never stops training: a failure
        is reported in the summary (``trace check`` says what was not checked)."""
        self.attended = None
        try:
            return self._step(view.step, view.events, view.traj, view.fields, view.rows_view)
        except Exception as e:
            log.warning("rljax.trace: whole-batch invariants not computed: %s: %s", type(e).__name__, e)
            self.summary["error"] = f"step {view.step}: not computed: {type(e).__name__}: {e}"
            return None

    def metrics(self) -> dict:
        """The step's ``invariants/*`` metrics (none when the step was not checked); they restart."""
        if self.counts is None:
            return {}
        out = {"invariants/rows": self.counts["rows"], "invariants/violating_rows": self.counts["violations"],
               "trace/invariants_s": self.counts["s"], **(self.recompute.step_metrics() if self.recompute else {})}
        self.counts = None
        return out

    def take_alerts(self) -> list:
        alerts, self.alerts = self.alerts, []
        return alerts

    def _step(self, step: int, events, traj, fields: Mapping, rows_view) -> Optional[np.ndarray]:
        """Every device-side fact of the step (those pairs' per-row facts, the per-row sums of the
        step's ``loss_mask``, the scores the advantages read) comes from one jitted reduction and one
        host transfer (:func:`~rljax.trace.invariants.step_facts`). Several processes: every process
        takes part in that reduction (the learner arrays are global), checks its own rows against
        its own rollout, and the verdicts are all-gathered (one small collective)."""
        t = time.perf_counter()
        B, lo = int(traj.batch_size), 0
        if rows_view is not None:  # several processes: this process's rows are one block of the learner batch
            import jax

            owner = np.asarray(rows_view.process)
            blocks = [np.nonzero(owner == p)[0] for p in np.unique(owner)]
            mine = np.nonzero(owner == jax.process_index())[0]
            if len(mine) != B or any(len(b) and (np.diff(b) != 1).any() for b in blocks):
                self.summary["skipped"] = "several processes: a process's rows are not one block of the learner batch"
                return None
            B, lo = len(owner), int(mine[0]) if len(mine) else 0
        call, (pairs, scores, scored, on_device, obs) = self._facts_call(events, fields, traj, B, rows_view is not None)
        early, self._early = self._early, None
        if early is not None and _same(early[0], call):  # started at the update's event, on these very inputs
            per_pair, extra = early[1].result()
            self.taken_mid_step += 1
        else:
            per_pair, extra = I.step_facts(*call[0], **call[1])
        self.attended = extra.get("count/attention_mask")
        mine = slice(lo, lo + int(traj.batch_size))
        local: dict = {"rows": 0, "violations": 0, "list": [], "error": None}
        try:
            local = _local(step, traj, fields, pairs, per_pair, extra, mine, obs, scores, scored, on_device,
                           rows_view is not None, self._rollout_facts(traj))
            if self.recompute is not None and rows_view is None:  # one process's rows are the whole batch
                _rederived(self.recompute, step, traj, fields, events, pairs, per_pair, extra, local)
            elif self.recompute is not None:
                self.recompute.not_run(SEVERAL)
        except Exception as e:  # noqa: BLE001 -- reported; the other processes still wait for the combine
            local["error"] = f"step {step}: not computed: {type(e).__name__}: {e}"
        verdicts = [local] if rows_view is None else _allgather_json(local)
        self._combine(step, verdicts, pairs, several=rows_view is not None, scores=scores)
        dt = time.perf_counter() - t
        self.summary["s"] = self.summary.get("s", 0.0) + dt
        self.counts = {"rows": sum(v["rows"] for v in verdicts), "violations": sum(v["violations"] for v in verdicts),
                       "s": dt}
        return extra.get("row_sum")

    def _facts_call(self, events, fields: Mapping, traj, B: int, several: bool) -> tuple:
        """``((args, kwargs) of step_facts, (pairs, scores, scored, on_device, obs))``: the reduction's
        inputs, and what the host compares read beside its results."""
        pairs = _pairs(events, fields, B)
        loss_mask = fields.get("loss_mask")
        row_sum_mask = loss_mask if loss_mask is not None and loss_mask.shape[0] == B else None
        scored = fields.get("scored_rows")
        adv = next((ev for ev in events if "scores" in ev.reads and "advantages" in ev.writes), None)  # scores -> advantages
        scores = adv.reads["scores"] if scored is not None and adv is not None else None
        on_device = scores is not None and tuple(scores.shape) == (B,) and not isinstance(scores, np.ndarray)
        adv_scores = adv.reads["scores"] if adv is not None else None  # the re-derived advantages' input
        dev = self.recompute.device_inputs(events, fields, traj, B, adv_scores) if self.recompute else {}
        roles = getattr(traj, "roles", None)
        obs = None if roles is None else np.asarray(roles) == I.OBSERVATION_ROLE
        attention = fields.get("attention_mask")  # the DFX metrics' tokens per row, in the same transfer
        counts = {"attention_mask": attention} if attention is not None and attention.shape[0] == B else None
        # Several processes: the observation rows are this process's only; its learner rows are
        # checked against the rollout's mask (digests), so the rollout's own observation tokens
        # with mask 1 are the learner's.
        args = ([(lm, ids) for lm, ids, _ in pairs.values()], None if several else obs, row_sum_mask,
                scores if on_device else adv_scores if "advantages" in dev else None)
        return (args, dict(counts=counts, **dev)), (pairs, scores, scored, on_device, obs)

    def stage(self, step: int, events: list, event, early) -> None:
        """A stage's event as it arrives (``events``: the step's so far, this one last); what can
        start starts in ``early`` (:class:`rljax.trace.early.Early`). At the trajectories' event:
        their :func:`rollout_facts` and uid groups (the step's end takes them for the same
        trajectories). At the update's event (a stage other than ``metrics`` that read the
        advantages and the loss mask), on one process: the reduction of every fact the step's end
        needs, while the weight sync runs (the step's end takes it when its own inputs are the
        same, :func:`_same`, else reduces them itself)."""
        if early is None:
            return
        traj = event.writes.get("trajectories")
        if traj is not None:  # the rollout's own facts, and its rows' groups by uid (the re-derivations')
            recompute = self.recompute

            def made():
                if recompute is not None:
                    recompute.uid_groups(traj)
                return rollout_facts(traj)

            self._rollout = (traj, early.submit(made))
        if event.stage == "metrics" or "advantages" not in event.reads or "loss_mask" not in event.reads:
            return
        import jax

        if jax.process_count() != 1:  # a collective from a second thread could interleave with the trainer's
            return
        view = StepView.of(step, events)
        traj = view.traj
        if traj is None or view.rows_view is not None:
            return
        call, _ = self._facts_call(view.events, view.fields, traj, int(traj.batch_size), False)
        args, kwargs = call
        self._early = (call, early.submit(lambda: I.step_facts(*args, **kwargs)))

    def _rollout_facts(self, traj) -> Optional[dict]:
        """The rollout's facts made mid-step for these very trajectories (None: not made)."""
        made, self._rollout = self._rollout, None
        if made is None or made[0] is not traj:
            return None
        self.taken_mid_step_rollout += 1
        return made[1].result()

    def end_step(self) -> None:
        """The step's jobs' handles and inputs dropped (the step's end, whatever it did)."""
        self._early = self._rollout = None

    def _combine(self, step: int, verdicts: list, pairs: dict, *, several: bool, scores) -> None:
        """Every process's verdict into the run's totals; the step's alert names the first violation."""
        inv = self.summary
        for v in verdicts:
            if v.get("error"):
                inv["error"] = v["error"]
            found = v["list"]
            if found:
                inv["violations"].extend(found[:max(20 - len(inv["violations"]), 0)])
                if not self.alerts:  # one alert per step, naming the first violation
                    first = found[0]
                    self.alerts.append(
                        ("batch_invariant", f"step {step} {first['tensor']} at {first['stage']}, {first['key']} (uid "
                                            f"{first['uid']}): {first['detail']} ({v['violations']} row(s))"))
        if scores is not None:
            inv["scores_tied"] = True
        if several:
            inv["processes"] = len(verdicts)
        inv["steps"] += 1
        inv["rows"] += sum(v["rows"] for v in verdicts)
        inv["violating_rows"] += sum(v["violations"] for v in verdicts)
        inv["stages"] = sorted(set(inv.get("stages", [])) | {st for _, _, stages in pairs.values() for st in stages})


def _same(a, b) -> bool:
    """``a`` and ``b`` are the same inputs: the same objects, or host arrays / plain values equal
    (a host array derived again at the step's end, e.g. the row mask); a device array only as itself."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and bool(np.array_equal(a, b))
    if isinstance(a, (bool, int, float, str)):
        return a == b
    return False


def _pairs(events, fields: Mapping, B: int) -> dict:
    """``(id(loss_mask), id(input_ids)) -> [loss_mask, input_ids, the stages that read them]``: each
    distinct pair of the whole batch a learner stage read."""
    pairs: dict = {}
    for ev in events:
        lm = ev.reads.get("loss_mask")
        if lm is None or ev.stage in ("metrics",) or lm.shape[0] != B:
            continue
        ids = ev.reads.get("input_ids", fields.get("input_ids"))
        pairs.setdefault((id(lm), id(ids)), [lm, ids, []])[2].append(ev.stage)
    return pairs


def rollout_facts(traj) -> dict:
    """The rollout's own per-row facts, from its host arrays alone: real rows, the mask and token
    digests of its ``loss_mask`` (:func:`~rljax.trace.invariants.host_row_facts`) and the digest of
    the response tokens present (the reward tie's key)."""
    ids = np.asarray(traj.response_ids)
    present = np.arange(ids.shape[1])[None, :] < np.asarray(traj.response_length)[:, None]
    return {"real": ~np.asarray(traj.is_padding), "rollout": I.host_row_facts(np.asarray(traj.loss_mask), ids),
            "present_digest": I.position_digest(present, ids)}


def _local(step, traj, fields, pairs, per_pair, extra, mine, obs, scores, scored, on_device, several,
           facts: Optional[dict] = None) -> dict:
    """This process's rows against its own rollout (``facts``: its :func:`rollout_facts`, made
    mid-step; None: made here): ``{"rows", "violations", "list", "error"}``."""
    facts = rollout_facts(traj) if facts is None else facts
    real, rollout = facts["real"], facts["rollout"]
    keys = I.RowKeys(traj)
    learner_version = (fields.get("dequeue") or {}).get("learner_version")
    if learner_version is None and fields.get("weight_version_after") is not None:
        learner_version = int(fields["weight_version_after"]) - 1  # the sync after the update advanced it
    rows, bad, found = 0, 0, []
    for (_, _, stages), update in zip(pairs.values(), per_pair):  # one comparison per distinct array
        update = {k: v[mine] for k, v in update.items()}
        if several and obs is not None:
            update["observation_tokens"] = ((np.asarray(traj.loss_mask) != 0) & obs).sum(axis=1)
        c, v = I.compare(step, keys, real, rollout, update, stage=stages[0],
                         max_version=np.asarray(traj.max_version), learner_version=learner_version)
        rows, bad = max(rows, c["rows"]), max(bad, c["violations"])
        found += v
    if scores is not None:
        read = extra["scores"][mine] if on_device else np.asarray(to_host(scores), np.float32)[mine]
        c, v = I.compare_scores(step, keys, real, facts["present_digest"],
                                scored, read)
        bad += c["violations"]
        found += v
    return {"rows": rows, "violations": bad, "list": found[:5], "error": None}


def _rederived(recompute, step, traj, fields, events, pairs, per_pair, extra, local: dict) -> None:
    """The re-derivations of the step (:meth:`rljax.trace.recompute.Recompute.compare`) added to this
    process's verdict: their violations fail the step's invariants too."""
    actor = next((u for (_, _, st), u in zip(pairs.values(), per_pair) if "actor_minibatch" in st), None)
    v = recompute.compare(step, traj, fields, events, actor, extra, traced_rows(recompute.cfg, step, traj),
                          update_stage="actor_minibatch", learner_version=RC.learner_version_at_update(fields))
    local["violations"] += len({x["row"] for x in v} - {x["row"] for x in local["list"]})
    local["list"] = (local["list"] + v)[:5] if local["list"] else v[:5]


def _allgather_json(obj: dict, width: int = 8192) -> list[dict]:
    """Every process's ``obj`` (JSON, at most ``width`` bytes: the list of found violations is cut
    to fit), in process order; one all-gather."""
    from jax.experimental import multihost_utils

    obj = dict(obj)
    data = json.dumps(obj).encode()
    while len(data) > width and obj.get("list"):
        obj["list"] = obj["list"][:-1]
        data = json.dumps(obj).encode()
    buf = np.zeros(width, np.uint8)
    buf[:len(data)] = np.frombuffer(data[:width], np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(buf, tiled=False)).reshape(-1, width)
    return [json.loads(bytes(r).rstrip(b"\0").decode()) for r in rows]
