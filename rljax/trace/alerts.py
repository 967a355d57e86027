"""Alert rules of the DFX metrics: each a small pure function of what one step observed.

An alert is ``(name, message)``; the tracer writes ``alerts/<name> = 1`` into
``metrics.jsonl`` and logs the message. Thresholds come from ``trace.*``:

* ``shape_checksum_mismatch``: a traced group's trajectory keys, row count, batch size,
  response length or loss-mask sum differ between two stages.
* ``memory_near_limit``: device bytes in use (or the compiled step's peak) above
  ``trace.alert_memory_frac`` of the device limit.
* ``dp_token_imbalance``: max / mean of the per-``dp``-shard token counts above
  ``trace.alert_dp_imbalance``.
* ``kl_spike`` / ``grad_norm_spike`` / ``entropy_spike``: the value is more than
  ``trace.alert_spike_factor`` times the running median of the last
  ``trace.alert_spike_window`` steps (entropy also when it falls below median / factor);
  from the fourth step on: before the window fills, the median of the steps so far is the
  warm-up baseline.
* ``batch_leak``: a field of a finished step's batch is still referenced (the runner's
  live-batch registry).
* ``rollout_mismatch``: ``training/rollout_probs_diff_max`` (the largest gap between a token's
  sampler and learner probability) above ``trace.alert_rollout_probs_diff_max_sync`` in a
  synchronous run (the sampler decodes with the learner's very weights: the gap is float noise,
  ~1e-8 in float32 on CPU), ``trace.alert_rollout_probs_diff_max`` in an asynchronous one.
* ``batch_invariant``: a whole-batch invariant failed on some row (:mod:`rljax.trace.invariants`:
  loss tokens, mask positions, tokens under the mask, versions, observation tokens).
* ``drop_rate`` (``trainer.mode=async``): more than ``trace.alert_drop_rate`` of the rows
  the rollout side generated so far were dropped (too stale, or queue overflow).

Each alert has a severity (:data:`SEVERITY`).
"""

from __future__ import annotations

import collections
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

Alert = tuple[str, str]

#: Severity of each alert. ``error``: the run's data or update is wrong (``python -m
#: rljax.trace check`` fails the run); ``warning``: worth a look (reported, not failed).
SEVERITY = {
    "shape_checksum_mismatch": "error",
    "batch_leak": "error",
    "nonfinite_update": "error",
    "batch_invariant": "error",
    "memory_near_limit": "warning",
    "dp_token_imbalance": "warning",
    "kl_spike": "warning",
    "grad_norm_spike": "warning",
    "entropy_spike": "warning",
    "rollout_mismatch": "warning",
    "drop_rate": "warning",
}

#: metric -> (alert name, also alert when the value collapses below median / factor)
SPIKE_METRICS = {
    "actor/ppo_kl": ("kl_spike", False),
    "actor/grad_norm": ("grad_norm_spike", False),
    "actor/entropy": ("entropy_spike", True),
}
#: Spikes are judged once this many earlier steps are in the window: until the window fills, the
#: baseline is the median of the warm-up steps seen so far (a run is not left unwatched for its
#: first ``trace.alert_spike_window`` steps); a baseline at the floor (KL of exactly 0 on-policy)
#: is none.
MIN_HISTORY = 3
#: A baseline at or below this is none (a KL of exactly 0 has no meaningful ratio).
SPIKE_FLOOR = 1e-6
#: Per metric, where the floor is higher: an on-policy KL is float noise (~1e-5 in float32 on CPU),
#: so a KL baseline under 1e-4 is none (the async tau=1 run's KL rose from 1e-5 to 9e-4 as its
#: batches became stale: no spike).
SPIKE_FLOORS = {"actor/ppo_kl": 1e-4}


def dp_token_counts(attention_mask: np.ndarray, dp: int) -> np.ndarray:
    """Tokens (prompt + response) on each ``dp`` shard: rows are split into ``dp`` contiguous blocks."""
    per_row = np.asarray(attention_mask).reshape(attention_mask.shape[0], -1).sum(axis=1)
    if dp <= 1 or per_row.shape[0] % dp:
        return np.array([per_row.sum()])
    return per_row.reshape(dp, -1).sum(axis=1)


def imbalance(counts: Sequence[float]) -> float:
    """max / mean (1.0 when balanced or empty)."""
    c = np.asarray(counts, dtype=np.float64)
    mean = c.mean() if c.size else 0.0
    return float(c.max() / mean) if mean > 0 else 1.0


def dp_imbalance_alert(counts: Sequence[float], threshold: float) -> Optional[Alert]:
    r = imbalance(counts)
    if r > threshold:
        return ("dp_token_imbalance", f"per-dp-shard tokens {list(map(int, counts))}: max/mean {r:.2f} > "
                                      f"trace.alert_dp_imbalance={threshold}")
    return None


def memory_alert(stats: Iterable[Optional[Mapping]], frac: float, *, compiled_peak: Optional[int] = None) -> Optional[Alert]:
    """From ``device.memory_stats()`` dicts (``None`` where the backend does not report)."""
    worst = None
    for i, s in enumerate(stats):
        limit = (s or {}).get("bytes_limit") or 0
        if limit <= 0:
            continue
        used = max(s.get("bytes_in_use", 0), s.get("peak_bytes_in_use", 0) or 0, compiled_peak or 0)
        if worst is None or used / limit > worst[0]:
            worst = (used / limit, i, used, limit)
    if worst is not None and worst[0] > frac:
        r, i, used, limit = worst
        return ("memory_near_limit", f"device {i}: {used / 2**20:.1f} MiB of {limit / 2**20:.1f} MiB "
                                     f"({100 * r:.0f}%) > trace.alert_memory_frac={frac}")
    return None


class SpikeDetector:
    """Running medians of KL, gradient norm and entropy; alerts on a spike against them."""

    def __init__(self, *, factor: float, window: int):
        self.factor, self.window = float(factor), int(window)
        self.history = {k: collections.deque(maxlen=self.window) for k in SPIKE_METRICS}

    def update(self, metrics: Mapping) -> list[Alert]:
        alerts = []
        for key, (name, low_too) in SPIKE_METRICS.items():
            v = metrics.get(key)
            if v is None or not np.isfinite(v):
                continue
            hist = self.history[key]
            med = float(np.median(np.abs(hist))) if len(hist) >= MIN_HISTORY else 0.0
            if med > SPIKE_FLOORS.get(key, SPIKE_FLOOR):  # no baseline yet, or a noise one (on-policy KL)
                a = abs(float(v))
                if a > self.factor * med:
                    alerts.append((name, f"{key}={v:.4g} > {self.factor} x running median {med:.4g}"))
                elif low_too and a < med / self.factor:
                    alerts.append((name, f"{key}={v:.4g} < running median {med:.4g} / {self.factor}"))
            hist.append(float(v))
        return alerts


def mismatch_threshold(cfg) -> float:
    """The ``rollout_mismatch`` threshold of a run: ``trace.alert_rollout_probs_diff_max_sync`` in a
    synchronous one (the sampler decodes with the learner's very weights: the gap is float noise),
    ``trace.alert_rollout_probs_diff_max`` in an asynchronous one (the sampler's weights may lag)."""
    t = cfg.trace
    return t.alert_rollout_probs_diff_max if cfg.trainer.mode == "async" else t.alert_rollout_probs_diff_max_sync


def mismatch_alert(metrics: Mapping, threshold: float) -> Optional[Alert]:
    """The sampler's and the learner's probability of one token differ by more than ``threshold``."""
    v = metrics.get("training/rollout_probs_diff_max")
    if v is not None and (not np.isfinite(v) or v > threshold):
        mean = metrics.get("training/rollout_probs_diff_mean", float("nan"))
        return ("rollout_mismatch", f"training/rollout_probs_diff_max={v:.4g} (mean {mean:.3g}) > "
                                    f"trace.alert_rollout_probs_diff_max={threshold}: the sampler's token "
                                    "probabilities are not the learner's (stale or unsynced weights, precision)")
    return None


def drop_rate_alert(dropped_rows: int, generated_rows: int, frac: float) -> Optional[Alert]:
    """Dropped / generated rows of an asynchronous run so far, against ``trace.alert_drop_rate``."""
    if generated_rows <= 0:
        return None
    r = dropped_rows / generated_rows
    if r > frac:
        return ("drop_rate", f"{dropped_rows} of {generated_rows} generated rows dropped ({100 * r:.1f}%) > "
                             f"trace.alert_drop_rate={frac}")
    return None


def width_alerts(records, widths: Mapping[str, Optional[int]], response_fields) -> list[Alert]:
    """``shape_checksum_mismatch`` naming the tensor: a response-shaped field (``[B, T]``) of a traced
    record whose width is not its layout's exact one (``widths``: ``{"sampler": T, "learner": T'}``,
    the learner's rounded up to a multiple of ``sp``). One alert per (tensor, stage)."""
    alerts, seen = [], set()
    for r in records:
        for f in r.get("fields", []):
            want = widths.get(f.get("layout"))
            shape = f.get("shape") or []
            if f["name"] not in response_fields or len(shape) != 2 or want is None or shape[1] == want:
                continue
            if (f["name"], r["stage"]) in seen:
                continue
            seen.add((f["name"], r["stage"]))
            alerts.append(("shape_checksum_mismatch",
                           f"tensor {f['name']} at stage {r['stage']} (step {r['step']}, uid {r['uid']}): shape "
                           f"{shape}, width {shape[1]} != {want}, the {f['layout']} layout's response width"))
    return alerts


def checksum_alerts(signatures: Mapping[str, Mapping[str, dict]]) -> list[Alert]:
    """``signatures[uid][stage]`` -> alerts where a stage disagrees with ``trajectory_fields``.

    A signature holds ``keys`` (tuple), ``rows``, ``batch`` (leading dims seen), ``resp_len``
    (trailing dims of response-shaped fields) and ``mask_sum``; ``None`` parts are not compared.
    """
    alerts = []
    for uid, stages in signatures.items():
        ref = stages.get("trajectory_fields")
        if ref is None:
            continue
        for stage, sig in stages.items():
            # batch / resp_len / mask_sum are sets: trajectory_fields holds both the sampler's and
            # the learner's (sp-rounded) layouts, a later stage must use one of them.
            diffs = [k for k in ("keys", "rows", "batch", "resp_len", "mask_sum")
                     if sig.get(k) is not None and ref.get(k) is not None
                     and (sig[k] != ref[k] if k in ("keys", "rows") else not set(sig[k]) <= set(ref[k]))]
            if diffs:
                detail = ", ".join(f"{k} {sig[k]} != {ref[k]}" for k in diffs if k != "keys") or "trajectory keys differ"
                alerts.append(("shape_checksum_mismatch", f"group {uid} at stage {stage}: {detail} "
                                                          "(vs trajectory_fields)"))
    return alerts
