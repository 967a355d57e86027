"""The tracer's re-derivations of one step (:mod:`rljax.trace.rederive`, :mod:`rljax.trace.rescore`,
:mod:`rljax._digest`), their verdicts and the summary ``python -m rljax.trace check``
reads (``trace_summary.json`` ``recompute``).

The tracer calls, per step: :meth:`Recompute.device_inputs` (what the one jitted invariant
reduction also computes: the advantages re-derived, the positions, the group ids),
:meth:`Recompute.compare` (every re-derivation on this process's rows; violations in the
invariants' format, so each also fails the step's ``batch_invariant`` alert and the launch
exits non-zero), and :meth:`summary` when it writes the summary. Each check records how
many steps and rows it covered, its first violations, or why it did not apply (N/A: never
counted as a pass).
"""

from __future__ import annotations

import weakref
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from rljax import loss as rl
from rljax.trace import rederive as R
from rljax.trace.groups import traced_rows
from rljax.trace.invariants import RowKeys
from rljax.trace.observers.step import StepView
from rljax.trace.rescore import rescorer_for
from rljax._digest import LOG, hex_digest

#: The fields re-scoring reads (:meth:`Recompute.stage` starts it once the reward stage wrote the last).
RESCORE_FIELDS = ("trajectories", "uids", "prompts", "scored_rows")
#: Every check of the summary's ``recompute`` section, in report order.
CHECKS = ("advantages", "group_ids", "response_mask", "positions", "update_report", "rewards", "weights")
#: Violations kept per check.
KEEP = 10
#: Digest records of the learner's log-prob passes (``rljax._digest.LOG``, kind -> the tensor it
#: produced, its stage, and the weights it must have read: the version it is recorded under).
PASSES = {"reference": ("ref_logp", "reference", "the initial policy"),
          "old": ("old_logp", "old_log_prob", "the policy the update started from")}


def _stage_reading(events, field: str, prefer: str = "actor_minibatch"):
    """The event of ``prefer`` when it read ``field``, else the last event that did."""
    found = [ev for ev in events if field in ev.reads]
    return next((ev for ev in found if ev.stage == prefer), found[-1] if found else None)


class Recompute:
    """Per-run state of the re-derivations (see the module docstring)."""

    def __init__(self, cfg):
        al, a = cfg.algorithm, cfg.actor
        self.cfg = cfg
        algorithm = {"gamma": al.gamma, "lam": al.lam, "norm_adv_by_std_in_grpo": al.norm_adv_by_std_in_grpo}
        self.estimator, na = R.estimator_key(al.adv_estimator, algorithm, use_kl_in_reward=al.use_kl_in_reward,
                                             num_groups=cfg.data.train_batch_size,
                                             critic=al.adv_estimator == "gae")
        self.epochs, self.mode = int(a.ppo_epochs), a.loss_agg_mode
        self.lora = a.lora.rank > 0
        self.rescorer = None  # set by the trainer (rljax.trace.rescore.rescorer_for): it holds the reward function
        self.stats: dict[str, dict[str, Any]] = {c: {"steps": 0, "rows": 0, "violating_rows": 0, "violations": []}
                                                 for c in CHECKS}
        self._na: dict[str, str] = {}
        if na:
            self._na["advantages"] = na
        if self.lora:
            self._na["weights"] = ("actor.lora: the sampler decodes with merged weights, the update's digests are of "
                                   "the adapters and base apart")
        self.learner: dict[int, str] = {}  # version -> digest of the learner's parameters at that version
        self.sampler: dict[tuple, dict] = {}  # (kind, version, digest) -> {"step", "count"}
        self._pending: list[dict] = []  # sampler records whose version the learner has not reported yet
        self._device: dict = {}
        self._groups_of: Optional[tuple] = None  # (weak reference to the trajectories, their uid groups)
        self.last_rescore_s: Optional[float] = None
        self._early: Optional[tuple] = None  # (step, those inputs, the re-scoring's Job) started mid-step
        self.taken_mid_step = 0  # steps whose re-scoring was the one started at the reward stage's event
        #: False: nothing re-derived (bench/recompute_overhead.py alternates it to time the re-derivations).
        self.enabled = True

    def not_run(self, reason: str) -> None:
        """Every check did not run this step, for ``reason`` (said as its N/A when no step ran it)."""
        for c in CHECKS:
            self._na.setdefault(c, reason)

    # ------------------------------------------------------------------ device side

    def device_inputs(self, events, fields: Mapping, traj, batch_size: int, scores) -> dict:
        """Keyword arguments for :func:`rljax.trace.invariants.step_facts` (one reduction with the invariants)."""
        out: dict = {}
        actor = _stage_reading(events, "advantages")
        self._device = {}
        if traj.batch_size != batch_size or not self.enabled:  # several processes: run where the rows are whole
            return out
        if actor is not None and scores is not None and self.estimator is not None:
            adv = {"advantages": actor.reads["advantages"], "loss_mask": actor.reads.get("loss_mask", fields.get("loss_mask")),
                   "group_ids": self.uid_groups(traj), "row_mask": ~np.asarray(traj.is_padding, bool)}
            if self.estimator[0] == "gae" and fields.get("values") is not None:
                adv["values"] = fields["values"]
            out.update(advantages=adv, estimator=self.estimator)
            self._device["advantages"] = True
        pos = _stage_reading(events, "positions")
        if pos is not None and "attention_mask" in pos.reads:
            out["positions"] = (pos.reads["attention_mask"], pos.reads["positions"])
            self._device["positions"] = pos.stage
        if fields.get("group_id") is not None and tuple(fields["group_id"].shape) == (batch_size,):
            out["passthrough"] = {"group_id": fields["group_id"]}
        return out

    def uid_groups(self, traj) -> np.ndarray:
        """The rows' groups by uid (:func:`rljax.trace.rederive.uid_groups`), made once per trajectories
        (the whole-batch invariants make it mid-step, at the trajectories' event: rljax.trace.early)."""
        held = self._groups_of
        if held is not None and held[0]() is traj:
            return held[1]
        groups = R.uid_groups(list(traj.uid))
        try:  # a weak reference: the step's arrays are released at its end (the runner's leak check)
            self._groups_of = (weakref.ref(traj), groups)
        except TypeError:
            self._groups_of = None
        return groups

    # ------------------------------------------------------------------ started mid-step

    def stage(self, step: int, events: list, event, early) -> None:
        """A stage's event as it arrives (``events``: the step's so far, this one last): at the reward
        stage's (the one that wrote ``scored_rows``), once the step's rollout, prompts and uids are
        known, the re-scoring starts in ``early`` (:class:`rljax.trace.early.Early`), unless the
        reward function declares ``thread_safe = False``. The step's end takes its result when it
        reads the same objects (:meth:`_rescore`)."""
        r = self.rescorer
        if ("scored_rows" not in event.writes or not self.enabled or early is None or r is None or r.skip
                or not r.thread_safe):
            return
        import jax

        if jax.process_count() != 1:  # several processes: the re-derivations do not run (their N/A)
            return
        fields = StepView.of(step, events).fields  # the newest value of each field, as the step's end reads them
        inputs = {k: fields.get(k) for k in RESCORE_FIELDS}
        if any(v is None for v in inputs.values()):
            return
        traj, cfg, seed = inputs["trajectories"], self.cfg, int(self.cfg.trainer.seed)

        def job():
            rows = r.sample(traj, traced_rows(cfg, step, traj), step, seed)
            return r.check(step, traj, inputs, rows, RowKeys(traj))

        self._early = (int(step), inputs, early.submit(job))

    def end_step(self) -> None:
        """Any job's handle and inputs dropped (the step's end, whatever it did)."""
        self._early = None

    # ------------------------------------------------------------------ host side

    def compare(self, step: int, traj, fields: Mapping, events, update: Optional[Mapping], extra: Mapping,
                traced_rows: Sequence[int], *, update_stage: str, learner_version: Optional[int]) -> list[dict]:
        """Every re-derivation of the step on ``traj``'s rows (this process's); ``update``: the
        per-row facts of the loss mask the update read (the invariants' pair), ``extra``: the
        reduction's other rows. Returns the violations (also kept per check)."""
        if not self.enabled:
            LOG.drain()
            return []
        real = ~np.asarray(traj.is_padding, bool)
        keys = RowKeys(traj)
        found: dict[str, Optional[list]] = {c: None for c in CHECKS}  # None: did not run this step
        if "advantage_error" in extra:
            found["advantages"] = R.compare_advantages(step, keys, real, extra["advantage_error"],
                                                       estimator=self.estimator[0])
        if "group_id" in extra:
            found["group_ids"] = R.compare_group_ids(step, keys, real, extra["group_id"], traj.uid,
                                                     groups=self.uid_groups(traj))
        if update is not None:
            found["response_mask"] = R.compare_masks(step, keys, real, traj, update, stage=update_stage)
        if "position_errors" in extra:
            found["positions"] = R.compare_positions(step, keys, real, extra["position_errors"],
                                                     stage=self._device.get("positions", update_stage))
        report = (fields.get("actor_metrics") or {}).get("update_report")
        if report is not None and "row_sum" in extra:
            width = int(np.shape(fields["loss_mask"])[1])
            found["update_report"] = R.compare_update_report(
                step, keys, real, report, extra["row_sum"], epochs=self.epochs, mode=self.mode,
                modes=tuple(rl.AGGREGATION_MODES), width=width)
        found["rewards"] = self._rescore(step, traj, fields, traced_rows, keys)
        found["weights"] = self._weights(step, traj, fields, report, keys, learner_version)
        out = []
        for check, vs in found.items():
            if vs is None:
                continue
            for v in vs:  # every violation of a row names its session (multi-turn: the episode)
                if v["row"] >= 0:
                    v.setdefault("session", int(traj.session[v["row"]]))
            st = self.stats[check]
            st["steps"] += 1
            st["rows"] += int(real.sum()) if check not in ("rewards", "weights") else 0
            st["violating_rows"] += len({v["row"] for v in vs})
            st["violations"] += vs[:max(KEEP - len(st["violations"]), 0)]
            out += vs
        return out

    def _rescore(self, step, traj, fields, traced_rows, keys) -> Optional[list]:
        r = self.rescorer
        if r is None:
            self._na.setdefault("rewards", "no reward function handed to the trace (library use without a trainer)")
            return None
        if r.skip:
            self._na["rewards"] = r.skip
            return None
        if fields.get("scored_rows") is None or fields.get("uids") is None or fields.get("prompts") is None:
            return None
        early, self._early = self._early, None
        if early is not None and early[0] == int(step) and all(fields.get(k) is v for k, v in early[1].items()):
            counts, vs = early[2].result()  # started at the reward stage's event, on these very inputs
            self.taken_mid_step += 1
        else:
            rows = r.sample(traj, traced_rows, step, int(self.cfg.trainer.seed))
            counts, vs = r.check(step, traj, fields, rows, keys)
        st = self.stats["rewards"]
        st["rows"] += counts["rows"]
        st["skipped_rows"] = st.get("skipped_rows", 0) + counts["skipped"]
        st["s"] = st.get("s", 0.0) + counts["s"]
        self.last_rescore_s = counts["s"]
        return vs

    def _weights(self, step, traj, fields, report, keys, learner_version) -> Optional[list]:
        """The learner's digests of this step (the update's before / after) and the sampler's
        records since the last step, tied by version. The update's "before" is compared with what
        the learner already has for its version (the previous update's "after"): an update that
        started from other parameters than the last one left is a violation."""
        records = LOG.drain()
        if self.lora:
            return None
        out, tied = [], 0
        if report is not None and learner_version is not None:
            v, before = int(learner_version), hex_digest(report["param_digest_before"])
            known = self.learner.get(v)
            if known is None:
                self.learner[v] = before
            else:  # an earlier step's update left version v: this one must start from it
                tied += 1
                if known != before:
                    out.append(self._start_violation(step, traj, keys, v, before, known))
            self.learner.setdefault(v + 1, hex_digest(report["param_digest_after"]))
        pending, self._pending = self._pending + [dict(r, step=int(step)) for r in records], []
        for r in pending:
            key = (r["kind"], r["version"], r["digest"])
            seen = self.sampler.setdefault(key, {"step": r["step"], "count": 0})
            seen["count"] += r.get("chunks", 1)
            want = self.learner.get(r["version"])
            if want is None:
                self._pending.append(r)
                continue
            tied += 1
            if r["digest"] != want:
                out.append(self._weight_violation(step, traj, keys, r, want))
        self.stats["weights"]["rows"] += tied
        if not tied and not out:
            return None
        return out

    def _start_violation(self, step, traj, keys, v, before, known) -> dict:
        real = np.nonzero(~np.asarray(traj.is_padding, bool))[0]
        return R.violation("weights", step, keys, int(real[0]) if len(real) else 0, tensor="params",
                           stage="actor_minibatch", sessions=traj.session,
                           detail=f"the update started from parameters with digest {before}, the learner's version "
                                  f"{v} (what the previous update left) has {known} (every row of the step)")

    def _weight_violation(self, step, traj, keys, r, want) -> dict:
        v = r["version"]
        used = np.nonzero((np.asarray(traj.min_version) <= v) & (np.asarray(traj.max_version) >= v)
                          & ~np.asarray(traj.is_padding, bool))[0]
        i = int(used[0]) if len(used) else 0
        kind = r["kind"]
        if kind in PASSES:  # a learner log-prob pass: every row of the step read it
            tensor, stage, who = PASSES[kind]
            return R.violation("weights", r["step"], keys, i, tensor=tensor, stage=stage, sessions=traj.session,
                               detail=f"the {stage} pass read parameters with digest {r['digest']}, {who} (version "
                                      f"{v}) has {want} (every row of the step)")
        what = {"chunk": f"decoded {r.get('chunks', 1)} chunk(s)", "install": "installed"}[kind]
        stage = "weight_sync" if kind == "install" else "rollout_sessions"
        return R.violation("weights", r["step"], keys, i, tensor="params", stage=stage, sessions=traj.session,
                           detail=f"the sampler {what} weights labelled version {v} with digest {r['digest']}, the "
                                  f"learner's version {v} has digest {want} (stale or wrong weights under a new label)"
                                  + ("" if len(used) else "; no row of this step used that version"))

    # ------------------------------------------------------------------ summary

    def step_metrics(self) -> dict:
        """``trace/rescore_s``: the seconds the step's re-scored rows' reward calls took (once per step)."""
        t, self.last_rescore_s = getattr(self, "last_rescore_s", None), None
        return {} if t is None else {"trace/rescore_s": t}

    def summary(self) -> dict:
        out = {}
        for c in CHECKS:
            st = dict(self.stats[c])
            if c in self._na and not st["steps"]:
                st["na"] = self._na[c]
            out[c] = st
        out["weights"]["learner"] = {str(v): d for v, d in sorted(self.learner.items())}
        out["weights"]["sampler"] = [{"kind": k, "version": v, "digest": d, **s}
                                     for (k, v, d), s in sorted(self.sampler.items(), key=lambda x: x[1]["step"])]
        out["weights"]["untied"] = len(self._pending)
        return out


def learner_version_at_update(fields: Mapping) -> Optional[int]:
    """The learner's weight version when the step's update ran."""
    v = (fields.get("dequeue") or {}).get("learner_version")
    if v is None and fields.get("weight_version_after") is not None:
        v = int(fields["weight_version_after"]) - 1
    return v


def attach(recompute: Recompute, services) -> None:
    """The trainer's hook: the reward function to re-score with (:func:`rljax.trace.rescore.rescorer_for`)
    and the policy sampler's digest log (its installs and decode chunks are recorded from now on)."""
    recompute.rescorer = rescorer_for(recompute.cfg, services.reward.fn, services.rollout.tokenizer.decode)
    sampler = services.rollout.sampler
    LOG.clear()  # an earlier run in this process (a library user's, a test's) leaves none of its records
    if hasattr(sampler, "digest_log"):
        sampler.digest_log = LOG
