"""DFX metrics of each step: tokens per dp shard of the learner batch and their imbalance, prompt
and response lengths, bytes of every field each stage wrote, the communication the stages
declare (timed), device memory, and each process's step time with the slowest process."""

from __future__ import annotations

import math
import time
from typing import Any, Mapping

import numpy as np

from rljax.sharding import to_host
from rljax.trace import alerts as A


#: The fractions ``np.percentile(x, [50, 90, 99])`` interpolates at (its own ``q / 100``).
_QUANTILES = tuple(np.true_divide([50, 90, 99], 100).tolist())
_EXACT = 2 ** 30  # integers below this in magnitude: their differences and floats are exact (no int32 wrap)


def percentiles(x: np.ndarray) -> tuple[float, float, float]:
    """``np.percentile(x, [50, 90, 99])`` (the default, linear method) as floats, bit for bit: one
    sort and its interpolation, for a 1-D integer array whose values are below 2**30 in magnitude
    (the lengths the trace reports; :func:`np.percentile` costs tens of microseconds in calls on
    such a small array), signed of 32 bits or more (numpy's differences of int8 / int16 values
    wrap); anything else goes to :func:`np.percentile` itself."""
    x = np.asarray(x)
    kind = x.dtype.kind
    fast = x.ndim == 1 and x.size and (kind == "u" or kind == "i" and x.dtype.itemsize >= 4)
    s = np.sort(x) if fast else None
    if not fast or not (-_EXACT < int(s[0]) and int(s[-1]) < _EXACT):
        return tuple(float(p) for p in np.percentile(x, [50, 90, 99]))
    n, out = s.shape[0], []
    for q in _QUANTILES:
        v = (n - 1) * q  # numpy's virtual index (float64), its floor and the weight between the neighbours
        if v >= n - 1:  # at or past the last value: the last value
            out.append(float(s[-1]))
            continue
        i = math.floor(v)
        t = v - i
        a, b = int(s[i]), int(s[i + 1])
        d = b - a  # numpy's lerp: from the nearer end (b - d * (1 - t) when t >= 0.5)
        out.append(b - d * (1 - t) if t >= 0.5 else a + d * t)
    return tuple(out)


def _percentiles(x: np.ndarray, prefix: str, *, stats: bool = True) -> dict:
    """``{prefix}/mean, /min, /max`` (``stats``) and ``/p50, /p90, /p99`` of ``x`` (none when empty)."""
    if x.size == 0:
        return {}
    p50, p90, p99 = percentiles(x)
    out = {f"{prefix}/mean": float(x.mean()), f"{prefix}/min": float(x.min()), f"{prefix}/max": float(x.max())} \
        if stats else {}
    out.update({f"{prefix}/p50": p50, f"{prefix}/p90": p90, f"{prefix}/p99": p99})
    return out


def is_array(x) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def local_memory_stats() -> list:
    """``memory_stats()`` of this process's devices (None where the backend reports none)."""
    import jax

    return [d.memory_stats() for d in jax.local_devices()]


class Perf:
    """The DFX metrics and what they keep across steps (bytes per field, the slowest process)."""

    def __init__(self, dp: int, trace_cfg):
        self.dp, self.cfg = dp, trace_cfg
        self.bytes: dict[str, dict[str, int]] = {}  # stage -> field -> bytes (largest seen)
        self.slowest: dict[int, int] = {}  # process -> steps it was the slowest

    def tokens(self, rows, attention_mask=None, *, attended=None) -> dict:
        """Per-dp-shard tokens of the learner batch as placed (its attention mask; ``attended``: its
        per-row sums when the invariants' reduction brought them), lengths."""
        real = ~np.asarray(rows.is_padding)
        if attended is not None and attention_mask is not None:
            tokens = np.asarray(attended) * real
        elif attention_mask is not None:
            import jax.numpy as jnp

            tokens = np.asarray(to_host(jnp.sum(attention_mask, axis=1))) * real
        else:
            tokens = (np.asarray(rows.prompt_length) + np.asarray(rows.response_length)) * real
        counts = A.dp_token_counts(tokens[:, None], self.dp)
        out = {"perf/dp_tokens": [int(c) for c in counts], "perf/dp_token_imbalance": A.imbalance(counts),
               "perf/padding_rows": int((~real).sum())}
        out.update(_percentiles(np.asarray(rows.prompt_length)[real], "prompt_length"))
        out.update(_percentiles(np.asarray(rows.response_length)[real], "response_length", stats=False))
        return out

    def memory(self, stats: list, compiled_peak, dp_tokens) -> tuple[dict, list]:
        """``memory/*`` of the first local device, and the memory and dp-imbalance alerts."""
        out = {}
        if stats and stats[0]:
            out.update({f"memory/{k}": stats[0].get(k) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")})
        found = [a for a in (A.memory_alert(stats, self.cfg.alert_memory_frac, compiled_peak=compiled_peak),
                             A.dp_imbalance_alert(dp_tokens, self.cfg.alert_dp_imbalance)) if a]
        return out, found

    def bytes_and_comm(self, events, metrics: Mapping, t0: float) -> dict:
        """Bytes of every batch field each stage wrote (global, from shapes: no copy), the communication
        we issue (weight push, the rollout gather, the step-time all-gather) timed, and each process's
        step time with the slowest process (an all-gather of one float on several processes)."""
        out: dict[str, Any] = {"perf/batch_bytes": self._field_bytes(events)}
        comm = {}
        for ev in events:
            if ev.writes.get("weight_sync_s") is not None:  # the weight push the stage timed
                comm["weight_push"] = float(ev.writes["weight_sync_s"])
            if ev.comm:  # a stage that is one communication (Stage.comm): all of its time
                comm[ev.stage] = ev.t_end - ev.t_start
        step_s = float(metrics.get("timing_s/step") or (time.perf_counter() - t0))
        t = time.perf_counter()
        by_process = gather_step_times(step_s)
        if len(by_process) > 1:
            comm["step_time_allgather"] = time.perf_counter() - t
        out.update({f"comm_s/{k}": v for k, v in comm.items()})
        out["timing_s/comm"] = sum(comm.values())
        slowest = int(np.argmax(by_process))
        out.update({"perf/step_time_by_process": [round(x, 6) for x in by_process],
                    "perf/slowest_process": slowest,
                    "perf/step_time_max_over_min": float(max(by_process) / min(by_process)) if min(by_process) > 0
                    else 1.0})
        self.slowest[slowest] = self.slowest.get(slowest, 0) + 1
        return out

    def _field_bytes(self, events) -> int:
        """The bytes of the step's written fields (each stage's largest kept in :attr:`bytes`)."""
        total = 0
        for ev in events:
            sizes = self.bytes.setdefault(ev.stage, {})
            for name, x in ev.writes.items():
                arrays = x.arrays() if hasattr(x, "arrays") else {name: x} if is_array(x) else {}
                traj = name == "trajectories"
                for k, v in arrays.items():
                    if is_array(v):
                        n = nbytes(v)
                        key = f"trajectories.{k}" if traj else k
                        if n > sizes.get(key, -1):
                            sizes[key] = n
                        total += n
        return total


def nbytes(x) -> int:
    """An array's global bytes from its shape and dtype (no copy; ``np.prod`` of the shape costs more
    than the product of a few ints)."""
    dtype = x.dtype
    return int(math.prod(x.shape)) * (dtype.itemsize if isinstance(dtype, np.dtype) else np.dtype(dtype).itemsize)


def gather_step_times(step_s: float) -> list[float]:
    """Every process's step time (one process: its own)."""
    import jax

    if jax.process_count() == 1:
        return [step_s]
    from jax.experimental import multihost_utils

    return [float(x) for x in np.asarray(multihost_utils.process_allgather(np.float32(step_s))).ravel()]
