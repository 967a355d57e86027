"""What a run writes about itself: the field-level stage trace (``trace.jsonl``), shape and
memory ledgers, metrics (JSONL + TensorBoard) with DFX metrics and alerts, the run report
plot, and the ``python -m rljax.trace summary|check RUN_DIR`` tools.
"""

from rljax.trace.metrics import MetricsWriter, read_metrics
from rljax.trace.report import plot_report
from rljax.trace.facts import GroupView
from rljax.trace.tracer import Tracer, choose_groups

__all__ = ["GroupView", "MetricsWriter", "Tracer", "choose_groups", "plot_report", "read_metrics"]
