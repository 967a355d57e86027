"""Experiment loggers (``trainer.logger``, verl's key): Weights & Biases and MLflow beside
``metrics.jsonl`` and TensorBoard, with the same metric names, the resolved config and the
sample tables (:mod:`rljax.trace.samples`).

``console`` is the trainer's progress lines and ``tensorboard`` the event files
:class:`~rljax.trace.MetricsWriter` writes; :class:`ExperimentLoggers` adds the optional
services. Each is imported only when named (both are heavy: wandb starts a service process,
MLflow pulls SQLAlchemy and pandas), and a missing package is a one-line error naming the
extra that installs it (checked by the launcher's pre-flight before anything is written).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from rljax.config import to_flat_dict
from rljax.trace.metrics import MetricsWriter
from rljax.trace.samples import SampleLog

#: logger -> (module, extra that installs it)
SERVICES = {"wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow")}


def _numbers(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        if math.isfinite(f):
            out[k] = f
    return out


class ExperimentLoggers:
    """The service loggers of ``trainer.logger`` for one run (a no-op without any, or when
    ``enabled`` is false: only process 0 logs).

    * wandb: ``wandb.init(project=trainer.project_name, name=trainer.experiment_name,
      dir=<run dir>, config=<every resolved key>)``; ``WANDB_MODE=offline`` writes the run
      under ``<run dir>/wandb`` without network (``wandb sync`` uploads it later).
    * mlflow: the experiment ``trainer.project_name``, a run named ``trainer.experiment_name``
      in ``MLFLOW_TRACKING_URI`` (default ``sqlite:///<run dir>/mlflow.db``, artifacts in
      ``<run dir>/mlartifacts``; ``mlflow ui --backend-store-uri`` that URI shows it), the
      config as params.

    Metrics go with their ``metrics.jsonl`` names and step (MLflow: the scalar ones; lists such
    as ``perf/dp_tokens`` go to wandb as lists); sample rows go to a table per split (wandb
    ``<split>/generations``, MLflow artifact ``generations/<split>_step<k>.json``, TensorBoard's
    Text tab ``<split>/generations`` through :attr:`text`).
    """

    def __init__(self, names: Sequence[str], *, run_dir: str, config: Mapping[str, Any] | None = None,
                 project: str = "rljax", experiment: str = "default", enabled: bool = True):
        self.names = tuple(n for n in names if n in SERVICES) if enabled else ()
        self._wandb = self._mlflow = None
        self.text = None  # (tag, markdown, step) -> None: TensorBoard's Text tab (open_run_logs sets it)
        params = {k: (list(v) if isinstance(v, tuple) else v) for k, v in (config or {}).items()}
        if "wandb" in self.names:
            import wandb  # deferred: heavy, and optional (the wandb extra)

            self._wandb = wandb.init(project=project, name=experiment, dir=run_dir, config=params,
                                     reinit="create_new")
        if "mlflow" in self.names:
            import mlflow  # deferred: heavy, and optional (the mlflow extra)

            root = os.path.abspath(run_dir)
            # MLflow 3 keeps the file store read-only: a local run is a SQLite store in the run directory
            mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root}/mlflow.db")
            if mlflow.get_experiment_by_name(project) is None:
                mlflow.create_experiment(project, artifact_location=f"file://{root}/mlartifacts")
            mlflow.set_experiment(project)
            self._mlflow = mlflow
            self._mlflow_run = mlflow.start_run(run_name=experiment)
            # MLflow params are strings of at most 6000 characters, logged in batches of 100
            items = [(k, str(v)[:6000]) for k, v in params.items()]
            for i in range(0, len(items), 100):
                mlflow.log_params(dict(items[i:i + 100]))

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = _numbers(metrics)
        values.pop("step", None)
        if self._wandb is not None:  # per-shard lists (perf/dp_tokens) too: wandb keeps them as lists
            lists = {k: list(v) for k, v in metrics.items() if isinstance(v, (list, tuple)) and v
                     and all(isinstance(x, (int, float)) for x in v)}
            if values or lists:
                self._wandb.log({**values, **lists}, step=step)
        if self._mlflow is not None and values:  # MLflow metrics are scalars
            self._mlflow.log_metrics(values, step=step, run_id=self._mlflow_run.info.run_id)

    def log_samples(self, split: str, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if not rows:
            return
        columns = list(rows[0])
        if self.text is not None:
            self.text(f"{split}/generations", markdown_table(columns, rows), step)
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])
            self._wandb.log({f"{split}/generations": table}, step=step)
        if self._mlflow is not None:
            self._mlflow.log_table({c: [r.get(c) for r in rows] for c in columns},
                                   artifact_file=f"generations/{split}_step{step}.json",
                                   run_id=self._mlflow_run.info.run_id)

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._mlflow is not None:
            self._mlflow.end_run()
            self._mlflow = None


def markdown_table(columns: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> str:
    """Rows as a markdown table (TensorBoard renders it); ``|`` and newlines escaped in cells."""
    def cell(v):
        return str(v).replace("|", "\\|").replace("\n", "<br>")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c, "")) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


class LoggedMetrics:
    """A :class:`~rljax.trace.MetricsWriter` whose records also go to :class:`ExperimentLoggers`."""

    def __init__(self, writer, loggers: ExperimentLoggers):
        self.writer, self.loggers = writer, loggers

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.writer.write(step, metrics)
        self.loggers.log_metrics(step, metrics)

    def close(self) -> None:
        self.writer.close()
        self.loggers.close()

    def __getattr__(self, name):
        return getattr(self.writer, name)


def open_run_logs(config, run_dir: str, *, enabled: bool = True):
    """``(metrics, samples)`` of a run: the :class:`~rljax.trace.MetricsWriter` (TensorBoard when
    ``trainer.logger`` names it) teeing into the service loggers, and the
    :class:`~rljax.trace.samples.SampleLog` writing ``generations.jsonl`` and the loggers' tables."""
    t = config.trainer
    loggers = ExperimentLoggers(t.logger, run_dir=run_dir, config=to_flat_dict(config), project=t.project_name,
                                experiment=t.experiment_name, enabled=enabled)
    writer = MetricsWriter(run_dir, tensorboard="tensorboard" in t.logger, enabled=enabled)
    loggers.text = writer.text  # TensorBoard's sample tables (Text tab)
    return LoggedMetrics(writer, loggers), SampleLog(run_dir, loggers=loggers, enabled=enabled)
