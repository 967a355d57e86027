"""The alerts a run fired (:mod:`rljax.trace.alerts` computes them): each kind with its severity
(:data:`rljax.trace.alerts.SEVERITY`), count, first step and first message, for
``trace_summary.json``; each firing is an ``alerts/<kind>`` metric of its step and a log line."""

from __future__ import annotations

import logging
from typing import Optional

from rljax.trace import alerts as A

log = logging.getLogger("rljax.trace")


class AlertLog:
    """Alerts by kind, in the order first fired, and the detectors that keep state across steps."""

    def __init__(self, trace_cfg, *, mismatch_max: Optional[float] = None):
        self.cfg = trace_cfg
        self.mismatch_max = trace_cfg.alert_rollout_probs_diff_max if mismatch_max is None else mismatch_max
        self.alerts: dict[str, dict] = {}
        self.spikes = A.SpikeDetector(factor=trace_cfg.alert_spike_factor, window=trace_cfg.alert_spike_window)

    def fire(self, step: int, name: str, msg: str, out: Optional[dict]) -> None:
        """Counts ``name`` (its first step and message kept), logs it, and marks it in the step's
        metrics ``out`` (None: an alert outside a step's metrics)."""
        sev = A.SEVERITY.get(name, "warning")
        a = self.alerts.setdefault(name, {"count": 0, "severity": sev, "first_step": int(step), "message": msg})
        a["count"] += 1
        if out is not None:
            out[f"alerts/{name}"] = 1
        (log.error if sev == "error" else log.warning)("rljax alert %s [%s] (step %d): %s", name, sev, step, msg)

    def metric_alerts(self, metrics) -> list:
        """The alerts read from the step's metrics: a spike (against the recent window), the rollout
        and learner probabilities too far apart."""
        mismatch = A.mismatch_alert(metrics, self.mismatch_max)
        return self.spikes.update(metrics) + ([mismatch] if mismatch else [])
