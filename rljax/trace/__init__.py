"""What a run writes about itself: metrics (JSONL + TensorBoard) and the run report plot.

(The field-level trace, ledgers and the trace checker build on this package.)
"""

from rljax.trace.metrics import MetricsWriter, read_metrics
from rljax.trace.report import plot_report

__all__ = ["MetricsWriter", "plot_report", "read_metrics"]
