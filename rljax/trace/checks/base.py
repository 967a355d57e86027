"""What every check reads: the run directory's files parsed once (:class:`Run`), the result type
and its statuses, and the helpers the checks share. A check is a function ``(Run) -> Result``;
:mod:`rljax.trace.check` lists them in the order they run."""

from __future__ import annotations

import copy
import json
import os
from collections import defaultdict
from typing import Optional

from rljax._rundir import read_changes, standing, values_at
from rljax.config import load_resolved, on_policy_blockers, resolve, to_flat_dict
from rljax.trace.jsonl import JsonLines, read_jsonl
from rljax.trace.metrics import read_metrics
from rljax.trace.tracer import SUMMARY_FILE, TRACE_FILE

Result = tuple[str, str, str]
PASS, WARN, FAIL, NA = "PASS", "WARN", "FAIL", "N/A"
STATUSES = (PASS, WARN, FAIL, NA)


def read_trace(run_dir: str, cut: Optional[list] = None) -> list[dict]:
    """The complete records of ``trace.jsonl``; a line that does not parse (cut short by a full disk
    or a kill) is left out and, when ``cut`` is given, named in it."""
    f = read_jsonl(os.path.join(run_dir, TRACE_FILE))
    if cut is not None and f.problem:
        cut.append(f.problem)
    return f.records


class Run:
    """The files of one run directory, parsed once."""

    def __init__(self, run_dir: str):
        self.dir = run_dir
        self.cut: list[str] = []  # files or lines that do not parse (a write cut short)
        self.files: dict[str, JsonLines] = {name: read_jsonl(os.path.join(run_dir, name))
                                            for name in (TRACE_FILE, "metrics.jsonl", "rollout_uids.jsonl")}
        self.cut += [f.problem for f in self.files.values() if f.problem]
        self.records = self.files[TRACE_FILE].records
        self.groups: dict[tuple, dict[str, dict]] = defaultdict(dict)  # (step, uid) -> stage -> record
        for r in self.records:
            self.groups[(r["step"], r["uid"])][r["stage"]] = r
        self.topology = self._json("topology.json")
        self.summary = self._json(SUMMARY_FILE)
        # the newest launch's record: every launch (a --resume too) rewrites config.resolved.yaml, whose
        # provenance chain then starts from the earlier launch's file
        cfg = next((r.get("config") for r in self.records if r["stage"] == "config_resolve"), None) or {}
        self.config_record = next((r["config"] for r in reversed(self.records)
                                   if r["stage"] == "config_resolve" and (r.get("config") or {}).get("sources")), cfg)
        # The resolved configuration is the authority on what the run was (mode, sizes); the
        # trace's copy of the key fields stands in only when the file is missing or unreadable.
        resolved = self.resolved()
        if resolved is not None:
            self.config_values = to_flat_dict(resolved)
            self.config_from = "config.resolved.yaml"
        else:
            self.config_values = cfg.get("values", {})
            self.config_from = TRACE_FILE if self.config_values else None

        self.metrics = {m["step"]: m for m in read_metrics(run_dir)}
        self.changes = standing(read_changes(run_dir))  # resumes that changed settings (rljax._resume)
        self._views: dict = {}

    def at(self, step: int) -> "Run":
        """This run as step ``step`` ran it: ``config_values`` and :meth:`resolved` of the settings in
        force at that step (a resume with overrides changes them from its step on:
        ``config_changes.jsonl``); the run itself when no resume changed any."""
        undone = tuple(i for i, c in enumerate(self.changes) if step < c["from_step"] and c.get("changed"))
        if not undone or self.config_from != "config.resolved.yaml":
            return self
        if undone not in self._views:
            view = copy.copy(self)
            view.config_values = values_at(self.config_values, self.changes, step)
            path = os.path.join(self.dir, "config.resolved.yaml")
            overrides = [f"{k}={json.dumps(v)}" for k, v in view.config_values.items() if v != self.config_values.get(k)]
            try:  # what resolved() returns for the view (its cache)
                vars(view)["_resolved"] = resolve(path, overrides, validate=False)[0]
            except Exception:  # noqa: BLE001 -- check_config reports an unreadable file
                vars(view)["_resolved"] = None
            self._views[undone] = view
        return self._views[undone]

    def _json(self, name):
        path = os.path.join(self.dir, name)
        if not os.path.exists(path):
            return None
        try:
            with open(path) as fh:
                return json.load(fh)
        except ValueError:
            self.cut.append(name)
            return None

    def needs_reference(self) -> bool:
        return bool(self.config_values.get("actor.use_kl_loss") or self.config_values.get("algorithm.use_kl_in_reward"))

    def distills(self) -> bool:
        """``distillation.enabled``: a teacher stage scores every trajectory (``teacher_logp``)."""
        return bool(self.config_values.get("distillation.enabled"))

    def asynchronous(self) -> Optional[bool]:
        """``trainer.mode == "async"``; None when neither the resolved config nor the trace says."""
        mode = self.config_values.get("trainer.mode")
        return None if mode is None else mode == "async"

    def bypass(self) -> bool:
        return bool(self.config_values.get("algorithm.bypass_mode"))

    def resolved(self):
        """The run's whole resolved configuration (``config.resolved.yaml``), or None."""
        if not hasattr(self, "_resolved"):
            self._resolved = None
            path = os.path.join(self.dir, "config.resolved.yaml")
            if os.path.exists(path):
                try:
                    self._resolved = load_resolved(path)[0]
                except Exception:  # check_config reports an unreadable file
                    pass
        return self._resolved

    def old_logp_in_update(self) -> bool:
        """The configuration has the update produce ``old_logp`` itself (``actor.skip_old_log_prob``
        auto or true, and the update exactly on-policy): no old_log_prob stage."""
        cfg = self.resolved()
        if cfg is None or self.bypass():
            return False

        return cfg.actor.skip_old_log_prob != "false" and not on_policy_blockers(cfg)

    def required_stages(self) -> list[str]:
        """The stages the run's configuration needs (a cross-check of the runner's own record of
        the stages it ran, which is what each group's records are compared with)."""
        stages = ["config_resolve", "dataset_item", "rollout_sessions", "trajectory_fields", "reward"]
        if not self.bypass() and not self.old_logp_in_update():
            stages.append("old_log_prob")
        if self.needs_reference():
            stages.append("reference")
        if self.distills():
            stages.append("teacher")
        if self.config_values.get("algorithm.adv_estimator") == "gae":
            stages.append("values")
        stages.append("advantages")
        if self.config_values.get("algorithm.adv_estimator") == "gae":
            stages.append("update_critic")
        return stages + ["actor_minibatch", "weight_sync", "metrics", "cleanup"]

    def by_stage(self, stage: str) -> list[dict]:
        return [r for r in self.records if r["stage"] == stage]


def field(rec: dict, name: str) -> Optional[dict]:
    return next((f for f in rec.get("fields", []) if f["name"] == name), None)


def mode_result(run: Run, name: str) -> Optional[Result]:
    """N/A for a synchronous run, FAIL when the mode is unknown, None for an asynchronous one."""
    mode = run.asynchronous()
    if mode is None:
        return FAIL, name, "trainer.mode unknown: config.resolved.yaml is missing or unreadable and the trace has none"
    return None if mode else (NA, name, f"synchronous run (trainer.mode=sync in {run.config_from})")
