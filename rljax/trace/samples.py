"""Sample completions: what the policy writes, per evaluation and per training step.

``trainer.log_val_generations=N`` (verl's key) keeps the first N validation rows of each
evaluation (the same prompts every time, so they show progress); ``trace.log_train_generations=N``
the first N rows of each training batch (taken from the ``reward`` stage by
:class:`TrainSamples`, a step-runner observer). Each row is ``{"step", "split", "uid",
"session", "prompt", "response", "reward", "ground_truth"}`` (plus ``data_source`` when the
dataset names one, and the generative judge's verdict ``judge`` and its score ``judge_score``
with ``reward.judge``), appended to ``<run dir>/generations.jsonl`` and to each experiment
logger's table (:class:`~rljax.trace.loggers.ExperimentLoggers`).

``python -m rljax.trace samples RUN_DIR [--step K] [--split val|train]`` prints them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rljax.trace._io import append_lines

GENERATIONS = "generations.jsonl"


def sample_rows(traj, prompts, scores, *, decode, step: int, split: str, limit: int, judge=None) -> list[dict]:
    """The first ``limit`` real (non-padding) rows of a rollout as sample records.

    Args:
      traj: a :class:`~rljax.rollout.Trajectories` (or episodes): ``response_ids``,
        ``response_length``, ``group_id``, ``is_padding``, ``uid``, ``session``.
      prompts: the batch's :class:`~rljax.data.Prompt` s, indexed by ``group_id``.
      scores: ``[B]`` rewards (host values).
      decode: ``ids -> text`` (the tokenizer's ``decode``).
      judge: ``(texts, scores)`` per row of a generative judge (``reward.judge``): each row then
        carries ``"judge"`` (the verdict text) and ``"judge_score"`` (its parsed score).
    """
    rows: list[dict] = []
    scores = np.asarray(scores).reshape(-1)
    for i in range(len(traj.is_padding)):
        if len(rows) >= limit:
            break
        if traj.is_padding[i]:
            continue
        p = prompts[int(traj.group_id[i])]
        row = {"step": int(step), "split": split, "uid": str(traj.uid[i]), "session": int(traj.session[i]),
               "prompt": p.prompt, "response": decode(traj.response_ids[i, : int(traj.response_length[i])]),
               "reward": float(scores[i]), "ground_truth": p.answer}
        if getattr(p, "data_source", ""):
            row["data_source"] = p.data_source
        if judge is not None:
            row["judge"], row["judge_score"] = judge[0][i], float(judge[1][i])
        rows.append(row)
    return rows


class SampleLog:
    """Appends sample rows to ``<run dir>/generations.jsonl`` and hands them to ``loggers``."""

    def __init__(self, run_dir: str, *, loggers=None, enabled: bool = True):
        self.path = os.path.join(run_dir, GENERATIONS)
        self.loggers, self.enabled = loggers, enabled

    def write(self, split: str, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        if not self.enabled or not rows:
            return
        append_lines(self.path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        if self.loggers is not None:
            self.loggers.log_samples(split, step, rows)


class TrainSamples:
    """A step-runner observer: the first ``limit`` rows of each step's ``reward`` stage, written
    at the end of the step.

    Several processes (``rows`` and ``gather`` given): each process makes the sample records of
    the rows it holds at the end of the step (their scores are its rows ``[first, first + count)``
    of the learner batch's global scores, all-gathered: a ``[B]`` float) and ``gather`` hands
    process 0 every process's, in batch order: the log holds the first ``limit`` rows of the whole
    batch, as one process writes it. Every process must run :meth:`step_end` (collectives).

    Args:
      log: where the rows go (enabled on process 0 only).
      decode: ``ids -> text``.
      limit: rows per step.
      rows: ``(first row, row count)`` of this process's rows in the learner batch.
      gather: ``records -> every process's records in batch order``.
    """

    def __init__(self, log: SampleLog, *, decode, limit: int, rows=None, gather=None):
        self.log, self.decode, self.limit = log, decode, int(limit)
        self._span, self._gather = rows, gather
        self._rows: list[dict] = []
        self._judge = None  # reward.judge: (texts, scores) of this step's rows
        self._pending = None  # several processes: (trajectories, prompts, global scores, step) until step_end
        self._prompts = None  # algorithm.filter_groups: the trained groups' prompts (its reward stage reads none)

    def step_start(self, step: int, t: float) -> None:
        self._rows = []
        self._judge = self._pending = self._prompts = None

    def stage(self, event) -> None:
        if event.stage == "rollout_sessions":  # dynamic sampling writes the prompts of the groups it kept
            self._prompts = event.writes.get("prompts")
            return
        if event.stage == "reward_judge":  # reward.judge: the verdicts go with the rows
            # host copies (a list, not the batch's array: the runner's leak check follows the batch's arrays)
            self._judge = (event.writes["judge_texts"], [float(x) for x in event.writes["judge_scores"]])
            return
        if event.stage != "reward" or "scores" not in event.writes:
            return
        traj, scores = event.reads.get("trajectories"), event.writes["scores"]
        prompts = event.reads.get("prompts", self._prompts)
        if traj is None or prompts is None:
            return
        if self._gather is not None:  # several processes: this process's rows of the global scores, at step_end
            self._pending = (traj, prompts, scores, event.step)
            return
        self._rows = sample_rows(traj, prompts, np.asarray(scores), decode=self.decode, step=event.step,
                                 split="train", limit=self.limit, judge=self._judge)

    def step_end(self, step: int, metrics) -> None:
        if self._gather is not None:
            self._rows = self._gather(self._local_rows())[: self.limit]
        self.log.write("train", step, self._rows)
        self._rows, self._judge, self._pending, self._prompts = [], None, None, None

    def _local_rows(self) -> list[dict]:
        """This process's first ``limit`` sample records of the step (none when it had no ``reward`` stage)."""
        if self._pending is None:
            return []
        from rljax.sharding import host_array  # JAX: only several processes read the global scores here

        traj, prompts, scores, step = self._pending
        first, count = self._span
        mine = np.asarray(host_array(scores))[first:first + count]
        return sample_rows(traj, prompts, mine, decode=self.decode, step=step, split="train", limit=self.limit,
                           judge=self._judge)

    def cleanup(self, report) -> None:
        pass


def read_samples(run_dir: str) -> list[dict]:
    """The rows of ``generations.jsonl``; a row written again after a resume replaces the earlier one."""
    path = os.path.join(run_dir, GENERATIONS)
    out: dict[tuple, dict] = {}
    if os.path.exists(path):
        with open(path) as fh:
            for line in fh:
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a killed run
                    continue
                out[(r.get("split"), r.get("step"), r.get("uid"), r.get("session"))] = r
    return list(out.values())


def format_row(r: Mapping[str, Any]) -> str:
    head = (f"step {r['step']} {r['split']} uid {r['uid']} session {r['session']}: reward {r['reward']:.3f}, "
            f"ground truth {r['ground_truth']!r}" + (f", data_source {r['data_source']}" if r.get("data_source") else ""))
    return f"{head}\n--- prompt\n{r['prompt']}\n--- response\n{r['response']}\n"


def main(argv=None) -> int:
    """``python -m rljax.trace samples RUN_DIR [--step K] [--split val|train]``: the samples of
    step K (default: the newest step that has samples), validation first."""
    class Parser(argparse.ArgumentParser):
        def error(self, message):  # one line, exit 2
            self.exit(2, f"{self.prog}: error: {message}\n")

    p = Parser(prog="python -m rljax.trace samples", description="Print the sample completions of a run.")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, default=None, help="the step (default: the newest with samples)")
    p.add_argument("--split", choices=("val", "train"), default=None, help="only validation or training samples")
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    prog = "python -m rljax.trace samples"
    if not os.path.isdir(args.run_dir):
        print(f"{prog}: error: run directory {args.run_dir} does not exist", file=sys.stderr)
        return 2
    rows = [r for r in read_samples(args.run_dir) if args.split is None or r["split"] == args.split]
    if not rows:
        print(f"{prog}: error: {os.path.join(args.run_dir, GENERATIONS)} holds no samples; run with "
              "trainer.log_val_generations=N (validation, trainer.test_freq) or trace.log_train_generations=N",
              file=sys.stderr)
        return 2
    steps = sorted({r["step"] for r in rows})
    step = steps[-1] if args.step is None else args.step
    if step not in steps:
        print(f"{prog}: error: no samples at step {step}; steps with samples: {', '.join(map(str, steps))}",
              file=sys.stderr)
        return 2
    for r in sorted((r for r in rows if r["step"] == step), key=lambda r: (r["split"] != "val", r["uid"], r["session"])):
        print(format_row(r))
    return 0
