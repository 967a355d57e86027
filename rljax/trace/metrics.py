"""``metrics.jsonl`` (one JSON object per step, verl-style names) and TensorBoard events."""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Optional

from rljax.trace._io import append_lines
from rljax.trace.jsonl import read_jsonl

#: Metric names whose values depend on the wall clock, the machine's memory or which process was
#: slowest, not on the computation: two runs of the same computation differ only in these (with
#: every name ending in a suffix below: ``trace/invariants_s``, ``async/learner_wait_s``, ...).
WALL_CLOCK_PREFIXES = ("timing_s/", "comm_s/", "memory/", "trace/overhead", "trace/background", "perf/throughput",
                       "perf/step_time_by_process", "perf/slowest_process", "perf/step_time_max_over_min", "perf/mfu")
WALL_CLOCK_SUFFIXES = ("_s", "per_s")


def is_wall_clock(name: str) -> bool:
    """Whether metric ``name`` measures time or memory (see :data:`WALL_CLOCK_PREFIXES`);
    behaviour-preserving changes and cache-loaded programs must reproduce every other metric."""
    return name.startswith(WALL_CLOCK_PREFIXES) or name.endswith(WALL_CLOCK_SUFFIXES)


def _scalar(v: Any) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f


def _summary_writer():
    """``tensorboardX.SummaryWriter``, imported without torch.

    tensorboardX imports torch whenever it is installed (to accept torch tensors), which
    costs ~180 MB of resident memory and seconds of start-up in a JAX process that only
    writes floats. Unless torch is already loaded, ``import torch`` is made to fail while
    tensorboardX loads (its torch support is optional), then allowed again.
    """
    import sys

    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


class MetricsWriter:
    """Appends ``{"step": s, name: value, ...}`` lines to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Non-finite values are written as JSON ``null`` (and skipped in TensorBoard) so the file
    stays valid JSON for every reader.
    """

    def __init__(self, run_dir: str, *, tensorboard: bool = True, enabled: bool = True):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.enabled = enabled
        self._tb = None
        if enabled and tensorboard:
            self._tb = _summary_writer()(logdir=os.path.join(run_dir, "tensorboard"), flush_secs=10)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        record: dict[str, Any] = {"step": int(step)}
        scalars = []
        for name, value in sorted(metrics.items()):
            f = _scalar(value)
            if f is None:
                record[name] = value if isinstance(value, (str, bool, list, dict)) else None
                continue
            record[name] = f if math.isfinite(f) else None
            if math.isfinite(f):
                scalars.append((name, f))
        if self._tb is not None and scalars:
            self._write_tb(int(step), scalars)
        append_lines(self.path, json.dumps(record) + "\n")  # whole lines only, even on a full disk

    def _write_tb(self, step: int, scalars: list) -> None:
        """All of a step's scalars as one TensorBoard event (one ``add_scalar`` each costs ~13x more)."""
        try:
            from tensorboardX.proto.summary_pb2 import Summary

            summary = Summary(value=[Summary.Value(tag=n, simple_value=f) for n, f in scalars])
            self._tb._get_file_writer().add_summary(summary, global_step=step)
        except (ImportError, AttributeError):  # another tensorboardX layout: the public API
            for name, f in scalars:
                self._tb.add_scalar(name, f, global_step=step)

    def text(self, tag: str, text: str, step: int) -> None:
        """A markdown text (e.g. a sample table) to TensorBoard's Text tab; nothing without TensorBoard."""
        if self._tb is not None:
            self._tb.add_text(tag, text, global_step=int(step))

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def read_metrics(run_dir: str) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl`` in order (later records of a step win on resume); a
    cut last line (a run killed mid-write) is skipped (:func:`rljax.trace.jsonl.read_jsonl` says so)."""
    by_step: dict[int, dict] = {}
    for rec in read_jsonl(os.path.join(run_dir, "metrics.jsonl")).records:
        by_step.setdefault(rec["step"], {}).update(rec)
    return [by_step[s] for s in sorted(by_step)]
