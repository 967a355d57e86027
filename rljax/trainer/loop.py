"""The trainer: a run's steps with what surrounds them (checkpoints, validation, logs, stops).

:func:`rljax.trainer.build.build` makes the run's services, its
:class:`~rljax.trainer.state.RunState` and the stage list of
:mod:`rljax.trainer.stages`; a scheduler (:class:`~rljax.trainer.sync_loop.SyncSchedule` or
:class:`~rljax.trainer.async_loop.AsyncSchedule`) runs a step and returns the next state.
:class:`Trainer` holds those, saves the state as the checkpoint, validates and writes one
``metrics.jsonl`` record per step (``Trainer(cfg, mesh, run_dir).run()``). Every computation
is a jitted pure function (:mod:`rljax.trainer.step`, :mod:`rljax.trainer.prepare`, the
sampler's decode chunks). Randomness is derived from the state's root key and the step
(``fold_in(key, step)``) and the sampler's ``(seed, uid, session)`` streams, so ``N`` steps, a
resume and ``N`` more steps give the same numbers as ``2N`` steps.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from rljax._rundir import drop_cut_records, resume_checkpoint
from rljax.config import Config, to_dict
from rljax.models.lora import check_base
from rljax.reward import DATA_SOURCES, RewardError, ValidationBySource
from rljax.trace import Tracer, plot_report
from rljax.trace.loggers import open_run_logs
from rljax.trace.mfu import mfu
from rljax.trace.recompute import attach as attach_recompute
from rljax.trace.samples import TrainSamples
from rljax.trainer import distribute, prefix
from rljax.trainer.async_loop import AsyncSchedule
from rljax.trainer.build import build
from rljax.trainer.checkpoint import CheckpointError, Checkpointer
from rljax.trainer.guard import (NONFINITE_ALERT, NonFiniteMonitor, NonFiniteUpdateError, RUN_RECORDS, StopRequested,
                                 StopSignals, MARKED_RECORDS, cut_jsonl, mark_resume, wait_for_save)
from rljax.trainer.packing import AutoPacking
from rljax.trainer.runner import StepRunner
from rljax.trainer.stages import actor_batch, model_inputs, validating
from rljax.trainer.state import checkpoint_meta, checkpoint_tree, from_checkpoint
from rljax.trainer.step import PackedTrainStep
from rljax.trainer.sync_loop import SyncSchedule

log = logging.getLogger("rljax")


@dataclasses.dataclass
class RunSummary:
    steps: int  # the step the run ended at
    first_step: int  # the step this launch started from (> 0 after a resume)
    tokens: int  # tokens of the steps this launch ran
    wall_s: float
    stage_s: dict[str, float]
    train_reward: Optional[float]
    val_reward_before: Optional[float]
    val_reward: Optional[float]
    run_dir: str
    resumed_from: Optional[int]
    trace_overhead: Optional[str] = None
    error_alerts: dict = dataclasses.field(default_factory=dict)  # name -> trace summary entry (severity error)


def _progress(step: int, total: int, reward: float, step_times: list[float]) -> None:
    """One progress line. The ETA uses the median of recent step times after this process's
    first step (which compiles everything); before there is one, it says so."""
    recent = sorted(step_times[1:][-20:])
    if recent:
        eta = (total - step) * recent[len(recent) // 2]
        eta_s = f"ETA {int(eta // 60)}m{int(eta % 60):02d}s"
    else:
        eta_s = "ETA after the compiling step"
    bar_w = 24
    filled = int(bar_w * step / total)
    line = (f"[{'#' * filled}{'.' * (bar_w - filled)}] step {step}/{total} | reward {reward:.3f} | "
            f"{step_times[-1]:.2f}s/step | {eta_s}")
    end = "\r" if sys.stderr.isatty() and step < total else "\n"
    print(line, file=sys.stderr, end=end, flush=True)


@dataclasses.dataclass
class Outputs:
    """Where a run writes: ``metrics.jsonl`` (and wandb / mlflow), generation samples, the trace;
    only the main process writes files."""

    metrics: Any
    samples: Any
    tracer: Tracer
    main: bool


@dataclasses.dataclass
class Progress:
    """What this launch's steps add up to, for the summary."""

    step: int = 0  # the step running, or the last one run (the state's step after it)
    resumed_from: Optional[int] = None
    stage_s: dict = dataclasses.field(default_factory=dict)  # seconds by timing key
    val_env: dict = dataclasses.field(default_factory=dict)  # the last validation's reward errors and tool use


class UpdateWatch:
    """Logs and alerts steps whose update was skipped as non-finite (each role's ``skipped``
    counter in the state); the monitor stops the run after ``trainer.max_skipped_updates``
    such steps in a row."""

    def __init__(self, monitor: NonFiniteMonitor, state):
        self.monitor = monitor
        self.seen = {"actor": int(state.actor.skipped),
                     "critic": int(state.critic.skipped) if state.critic is not None else 0}

    def check(self, step: int, state, metrics: dict) -> bool:
        """True when the step's updates applied; adds the alert metrics to ``metrics``."""
        skipped = {}
        for role, train in (("actor", state.actor), ("critic", state.critic)):
            if train is None:
                continue
            now = int(train.skipped)
            detail = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"{role}/")}
            skipped[role], self.seen[role] = (now - self.seen[role], detail), now
        metrics.update(self.monitor.observe(step, skipped))
        return not any(n for n, _ in skipped.values())


class RunComplete(RuntimeError):
    """A resume whose checkpoint is at (or past) ``trainer.total_steps``: the run trained every
    step and there is nothing to train. Raised before anything is built or written (the
    launcher says the same in one line and exits 0)."""


class Trainer:
    """A run: :func:`~rljax.trainer.build.build`'s services and state, a scheduler, and what
    surrounds the steps (checkpoints, validation, metrics, the trace, stops).

    Args:
      cfg: the resolved configuration.
      mesh: the learner mesh (``rljax.sharding.make_mesh``).
      run_dir: where outputs and checkpoints go.
      resume: continue from the newest complete checkpoint in ``run_dir``.
      resume_unverified: also restore a checkpoint without a digest (refused otherwise).
      resume_from_weights: take only the policy (and critic) weights of the checkpoint; the
        optimizer state and the data position start fresh (a resume under another task).
      placement: the device groups (:class:`rljax.sharding.placement.Placement`) the launcher
        computed; default: the sampler's devices by the placement rule around ``mesh``.

    Raises:
      RunComplete: ``resume`` of a run whose checkpoint is at ``trainer.total_steps``; nothing in
        ``run_dir`` is touched (raise ``trainer.total_steps`` to train on).
    """

    def __init__(self, cfg: Config, mesh, run_dir: str, *, resume: bool = False, echo: Callable = print,
                 resume_unverified: bool = False, resume_from_weights: bool = False, placement=None):
        self.cfg, self.run_dir, self.echo = cfg, run_dir, echo
        if resume:  # before build and the restore write anything (records cut, resume markers, the summary)
            done, _ = resume_checkpoint(os.path.join(run_dir, "checkpoints"), cfg.trainer.resume_from,
                                        past_undigested=not resume_unverified)
            if done is not None and done >= cfg.trainer.total_steps:
                raise RunComplete(f"resume: checkpoint {done} is {'at' if done == cfg.trainer.total_steps else 'past'} "
                                  f"trainer.total_steps={cfg.trainer.total_steps}: the run in {run_dir} is complete, "
                                  "nothing to train; raise trainer.total_steps to train on")
        self.services, self.state, stages = build(cfg, mesh, run_dir=run_dir, echo=echo, placement=placement)
        self.progress = Progress()
        os.makedirs(run_dir, exist_ok=True)
        self.checkpointer = Checkpointer(os.path.join(run_dir, "checkpoints"), max_to_keep=cfg.trainer.max_checkpoints,
                                         echo=echo)
        main = jax.process_index() == 0
        if resume:
            self._restore(unverified=resume_unverified, weights_only=resume_from_weights, main=main)
        self.watch = UpdateWatch(NonFiniteMonitor(cfg.trainer.max_skipped_updates, echo=echo), self.state)
        metrics, samples = open_run_logs(cfg, run_dir, enabled=main)  # + wandb / mlflow, samples
        self.out = Outputs(metrics=metrics, samples=samples, main=main,
                           tracer=Tracer(cfg, mesh, run_dir, enabled=main, ledger_sources=self.ledger_sources))
        attach_recompute(self.out.tracer.whole_batch.recompute, self.services)  # the reward to re-score with, the sampler's digests
        probe = self.services.rollout.client.sandbox_probe
        if probe is not None:  # what the python tool's sandbox holds
            echo(probe["line"])
            self.out.tracer.sandbox = probe
        observers = [self.out.tracer]
        if cfg.trace.log_train_generations:  # several processes: process 0 writes every process's rows
            share = self.services.rollout.share
            multi = {"rows": (share.row_lo, share.num_rows),
                     "gather": lambda recs: distribute.gather_records(recs, share)} if share.processes > 1 else {}
            observers.append(TrainSamples(samples, decode=self.services.rollout.tokenizer.decode,
                                          limit=cfg.trace.log_train_generations, **multi))
        if cfg.trainer.mode == "async":
            self.schedule = AsyncSchedule(self.services, self.state, observers)
        else:
            self.schedule = SyncSchedule(self.services, stages, observers)

    @property
    def step(self) -> int:
        """The step running, or the last one run."""
        return self.progress.step

    @property
    def tracer(self) -> Tracer:
        return self.out.tracer

    @property
    def runner(self):
        """The learner's :class:`~rljax.trainer.runner.StepRunner` (its stage list and observers)."""
        return self.schedule.runner

    @property
    def version(self) -> int:
        return self.state.version

    def ledger_sources(self) -> dict:
        """What the ledgers compile and measure, named explicitly (read once, at the end of step 1:
        the state as the step's last stage returned it, the one it took having been donated)."""
        s, st = self.services, self.runner.live_state or self.state
        fns = s.learner.actor
        return {"model_config": s.model.config, "step_config": s.model.step_config, "graphdef": s.model.graphdef,
                "params": st.actor.params, "opt_state": st.actor.opt_state,
                "lower_update": lambda fields: fns.update.lower(st.actor, actor_batch(s, fields), jax.random.key(0)),
                "lower_logprob": lambda fields: fns.forward.lower(st.actor.params, model_inputs(fields)),
                "learner_layout": lambda: {"actor_minibatch": prefix.learner_layout(fns.update),
                                           "old_log_prob": prefix.learner_layout(fns.forward)},
                "sampler_engine": s.rollout.sampler.engine, "sampler_params": s.rollout.sampler.params,
                "decode": s.rollout.decode}

    # ------------------------------------------------------------------ checkpoints

    def _restore(self, *, unverified: bool = False, weights_only: bool = False, main: bool = True) -> None:
        """Restores the newest checkpoint (or ``trainer.resume_from``) after verifying it; a damaged
        or unverified one is a :class:`~rljax.trainer.checkpoint.CheckpointError` naming the newest
        intact one. ``metrics.jsonl``, ``trace.jsonl`` and ``rollout_uids.jsonl`` are cut back to the
        restored step, so every step appears once. ``weights_only``: the policy's weights alone."""
        chosen = self.cfg.trainer.resume_from
        latest = self.checkpointer.select(chosen, past_undigested=not unverified)
        if latest is None:
            self.echo(f"resume: no complete checkpoint in {self.checkpointer.directory}; starting from step 0")
            self._cut_records(-1, main)
            return
        try:
            saved = self.checkpointer.read_meta(latest)
        except Exception:  # noqa: BLE001 - unreadable: restore() below names the damage
            saved = None
        lora_base = self.services.model.lora_base
        if saved is not None and (lora_base is not None or "lora" in saved):
            self._check_lora_checkpoint(latest, saved.get("lora"))
        tree, meta = self.checkpointer.restore(latest, checkpoint_tree(self.state), allow_unverified=unverified)
        if chosen is not None or latest != self.checkpointer.latest_step():  # newer ones are saved again
            self.checkpointer.discard_newer(latest)
        self.state = from_checkpoint(self.state, tree, meta, weights_only=weights_only,
                                     kl_in_reward=self.cfg.algorithm.use_kl_in_reward)
        self.progress.step, self.progress.resumed_from = self.state.step, latest
        if weights_only:  # another task: this run's fresh optimizer states and data position, the saved weights
            task = (meta.get("config") or {}).get("data", {})
            self.echo(f"resume: --resume-from-weights: the policy weights of checkpoint {latest} (trained on "
                      f"data.dataset={task.get('dataset', '?')}); the optimizer state and the data position start "
                      f"fresh; steps continue from {self.progress.step + 1}")
        else:
            self.services.rollout.prompts.restore(self.state.data)
            self.echo(f"resume: restored step {self.progress.step} (weight version {self.state.version}) from checkpoint "
                      f"{latest}")
        r = self.services.rollout
        r.sampler.update_weights(r.to_sampler(self.state.actor.params), self.state.version)
        self._cut_records(self.progress.step, main)

    def _cut_records(self, step: int, main: bool) -> None:
        """The records a previous launch wrote after ``step`` are dropped: those steps run again."""
        if not main:
            return
        for line in drop_cut_records(self.run_dir, step):  # a record cut short: which step it was, what happens
            self.echo(line)
        for name in RUN_RECORDS:
            dropped = cut_jsonl(os.path.join(self.run_dir, name), step)
            if name in MARKED_RECORDS:
                mark_resume(os.path.join(self.run_dir, name), step, dropped)
            if dropped:
                self.echo(f"resume: removed {dropped} {name} record(s) after step {max(step, 0)} (they are run again)")

    def intact_point(self) -> str:
        """The newest verified checkpoint (hashed) and where ``--resume`` continues: for a run
        stopped by a failed write."""
        try:
            step = self.checkpointer.newest_intact()
        except OSError:
            step = None
        if step is None:
            return f"no intact checkpoint in {self.checkpointer.directory}"
        return (f"the newest intact checkpoint is step {step} in {self.checkpointer.directory}: --resume continues "
                f"from step {step + 1}")

    def resume_point(self) -> str:
        """Which checkpoint the next ``--resume`` restores and the step it starts from."""
        steps = self.checkpointer.all_steps()
        pending = self.checkpointer.pending
        if pending is not None and pending not in steps:
            steps = sorted(steps + [pending])
        if not steps:
            return "no checkpoint was saved: the next --resume starts from step 1"
        return f"the newest checkpoint is step {steps[-1]}: the next --resume starts from step {steps[-1] + 1}"

    def _check_lora_checkpoint(self, step: int, saved: Optional[dict]) -> None:
        """``CheckpointError`` unless checkpoint ``step`` holds adapters of this run's LoRA shape
        trained on this run's base (or full parameters, for a run without LoRA)."""
        rank, lora_base = self.cfg.actor.lora.rank, self.services.model.lora_base
        if saved is None or lora_base is None:
            raise CheckpointError(f"checkpoint {step} holds {'every parameter' if saved is None else 'LoRA adapters'}; "
                                  f"this run has actor.lora.rank={rank}")
        have = dataclasses.asdict(self.state.actor.params.config)
        saved = {"modules_to_save": [], **saved}  # checkpoints from before modules_to_save existed
        diff = [f"{k}={saved.get(k)!r} (now {v!r})" for k, v in have.items() if k != "dropout"
                and (list(v) if isinstance(v, tuple) else v) != saved.get(k)]
        if diff:
            raise CheckpointError(f"checkpoint {step} holds other LoRA adapters: actor.lora.{', '.join(diff)}")
        try:
            check_base(saved["base"], lora_base)
        except ValueError as e:
            raise CheckpointError(f"checkpoint {step}: {e}") from None

    def save(self) -> None:
        self.out.tracer.flush()  # the trace's writes of the steps saved are on disk before the checkpoint
        meta = {**checkpoint_meta(self.state), "config": to_dict(self.cfg), **self.schedule.checkpoint_meta(self.state)}
        lora_base = self.services.model.lora_base
        if lora_base is not None:  # adapter-only checkpoint: name the base it belongs to
            meta["lora"] = {"base": lora_base, **dataclasses.asdict(self.state.actor.params.config)}
        t = time.perf_counter()
        self.checkpointer.save(self.state.step, checkpoint_tree(self.state), meta)
        self._time("save_checkpoint", t)

    def _time(self, key: str, t0: float) -> float:
        dt = time.perf_counter() - t0
        self.progress.stage_s[key] = self.progress.stage_s.get(key, 0.0) + dt
        return dt

    # ------------------------------------------------------------------ steps

    def train_one_step(self) -> dict:
        """Runs the stage list once; returns the step's metrics (also written to ``metrics.jsonl``)."""
        self.progress.step = self.state.step + 1
        self.state, metrics, timings = self.schedule.step(self.state, self.progress.step)
        for k, v in timings.items():
            self.progress.stage_s[k] = self.progress.stage_s.get(k, 0.0) + v
        tokens = metrics["perf/total_num_tokens"]
        metrics["perf/throughput"] = tokens / metrics["timing_s/step"] / max(len(jax.devices()), 1)
        metrics.update(self._perf_metrics(metrics))
        return metrics

    def _perf_metrics(self, metrics: dict) -> dict:
        """Packed-learner statistics and MFU (``perf/mfu/*``: absent off the peak table, e.g. on CPU)."""
        out = {}
        step = self.services.learner.actor.update
        if isinstance(step, AutoPacking) and step.last_packed is not None:
            out["perf/learner_packed"] = float(step.last_packed)  # actor.use_remove_padding=auto's choice
        if isinstance(step, (PackedTrainStep, AutoPacking)) and step.stats:
            if "dp_token_imbalance" in step.stats:
                out["perf/dp_token_imbalance"] = step.stats["dp_token_imbalance"]  # of the packed learner rows
            out["perf/learner_padding_frac"] = step.stats["padding_frac"]
            if jax.process_count() > 1 and "gathered_bytes" in step.stats:  # the plan's all-gather: [B] spans only
                out["perf/packing_gather_bytes"] = step.stats["gathered_bytes"]
            out["perf/learner_compiles"] = step.compiles + getattr(self.services.learner.actor.forward, "compiles", 0)
            layout = prefix.learner_layout(step)  # actor.shared_prefix: the layout the update used, tokens saved
            if layout["layout"] in ("packed", "shared_prefix"):
                out["perf/learner_shared_prefix"] = float(layout["layout"] == "shared_prefix")
                out["perf/shared_prefix_saved_frac"] = layout["shared_saved_frac"]
        for key, timing in (("actor", "timing_s/update_actor"), ("rollout", "timing_s/gen")):
            flops = metrics.get(f"perf/model_flops/{key}")
            if flops is not None and timing in metrics:
                v = mfu(flops, metrics[timing], jax.devices())
                if v is not None:
                    out[f"perf/mfu/{key}"] = v
        return out

    def _due(self, freq: int) -> bool:
        return freq > 0 and self.progress.step % freq == 0

    def validate(self) -> float:
        """Mean reward on the held-out split with ``rollout.val_kwargs`` decoding (greedy by default).

        With several processes each validates its block of every held-out batch (whole prompt
        groups, the one-process uids ``val-{batch}-{index}``, so the same random streams): the
        per-row scores, tool use and reward error counts are all-gathered (no tokens) and every
        metric is computed over the union in batch order, as one process computes it; the
        generations log (``trainer.log_val_generations``) is written by process 0 from every
        process's rows, the first ones in batch order, as one process writes it."""
        t = time.perf_counter()
        with self.schedule.paused():  # async: the rollout thread pauses; the newest pushed weights validate
            rows, samples, by_source = self._validate_batches()
        self.out.samples.write("val", self.progress.step, samples)
        self._time("testing", t)
        errors, scored = int(rows["errors"].sum()), int(rows["scored"].sum())
        # held-out reward failures, counted like the training ones
        self.progress.val_env = {"val/reward/errors": float(errors), "val/reward/error_fraction": errors / max(scored, 1)}
        real = ~rows["is_padding"]
        if "num_turns" in rows:  # held-out tool use, logged beside val/score/mean
            self.progress.val_env.update({"val/env/tool_call_rate": float(rows["tool_called"][real].mean()),
                                          "val/env/num_turns/mean": float(rows["num_turns"][real].mean())})
        self.progress.val_env.update(by_source.metrics())  # verl's val-core/<data_source>/...
        scores = rows["scores"][real]
        return float(np.mean(scores.tolist())) if scores.size else float("nan")

    def _validate_batches(self) -> tuple[dict, list[dict], ValidationBySource]:
        """Generates and scores this process's share of every held-out batch; returns the per-row
        facts of every process's rows (``scores``, ``is_padding``, multi-turn ``tool_called`` and
        ``num_turns``; per process and batch ``errors`` and ``scored``) and the first
        ``trainer.log_val_generations`` sample records, both in batch order, and every process's rows by
        data source."""
        keep, bound = self.cfg.trainer.log_val_generations, self.cfg.reward.max_error_fraction
        r = self.services.rollout
        share = r.share
        # validation's own stage list, through a runner as the step's (rljax.trainer.stages.validating)
        by_source = ValidationBySource(DATA_SOURCES.get(self.cfg.data.dataset, self.cfg.data.dataset))
        runner = StepRunner(validating.stages(self.services, by_source=by_source))
        parts: list[dict] = []
        samples: list[dict] = []
        for i, batch in enumerate(r.val_prompts()):
            lo, hi = distribute.block(len(batch), share)
            prompts, uids = batch[lo:hi], [f"val-{i}-{j}" for j in range(lo, hi)]
            local = {"scores": np.zeros(0, np.float64), "is_padding": np.zeros(0, bool), **r.client.row_facts(None)}
            counts = np.zeros(2, np.int64)  # reward errors, rows scored
            mine: list[dict] = []
            if prompts:  # fewer prompts than processes: this process has none of this batch
                # the validation stages (the process's error bound; several processes: the whole batch's below);
                # this process's first sample rows, the batch's first are chosen below
                out, _ = runner.run(i, {"step": self.progress.step, "prompts": prompts, "uids": uids,
                                                 "sample_limit": max(keep - len(samples), 0)})
                local.update(out["rows"])
                counts[:], mine = out["counts"], out["samples"]
            part = distribute.allgather_blocks(local, share)
            part.update(distribute.allgather_blocks({"errors": counts[None, :1], "scored": counts[None, 1:]}, share))
            if share.processes > 1:
                errors, scored = int(part["errors"].sum()), int(part["scored"].sum())
                if scored and errors / scored > bound:
                    raise RewardError(f"held-out reward failed for {errors}/{scored} rows ({errors / scored:.1%}) over "
                                      f"{share.processes} processes, more than reward.max_error_fraction={bound}")
                if len(samples) < keep:
                    mine = [json.loads(x) for x in distribute.allgather_texts([json.dumps(m) for m in mine], share)]
            samples += mine[: keep - len(samples)]
            parts.append(part)
        if share.processes > 1:  # every process's rows by data source (scores and reward extras, no tokens)
            by_source.replace([json.loads(x) for x in distribute.allgather_texts(
                [json.dumps(r, default=float) for r in by_source.records()], share)])
        rows = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]} if parts else \
            {"scores": np.zeros(0), "is_padding": np.zeros(0, bool), "errors": np.zeros(0, np.int64),
             "scored": np.zeros(0, np.int64)}
        return rows, samples, by_source

    def run(self) -> RunSummary:
        """Trains to ``trainer.total_steps``. Any stop (an exception in a stage, the reward error
        bound, too many non-finite updates, Ctrl-C) first waits, at most
        ``trainer.stop_save_timeout_s``, for an in-flight checkpoint save to commit. SIGTERM ends
        the current step, saves it and raises :class:`~rljax.trainer.guard.StopRequested`."""
        timeout = self.cfg.trainer.stop_save_timeout_s  # how long a stop waits for an in-flight save
        try:
            with StopSignals() as stop:
                return self._run(stop, timeout)
        except BaseException as e:  # the trace summary says how the run ended
            totals = self.schedule.close()
            if totals is not None:
                self.out.tracer.async_totals(totals)
            if not isinstance(e, StopRequested):
                wait_for_save(self.checkpointer, timeout, self.echo)
            try:
                self.out.tracer.close(error=f"{type(e).__name__}: {e}", step=self.progress.step)
            except OSError:  # the disk that stopped the run may not take the summary either: report the first error
                pass
            raise
        finally:
            close = getattr(self.services.reward.fn, "close", None)
            if close is not None:  # the reward worker pool
                close()

    def _stop_requested(self, signal: str, timeout: float) -> None:
        """SIGTERM arrived: save this step (if not just saved), wait for it, stop."""
        if self.checkpointer.pending != self.progress.step and self.progress.step not in self.checkpointer.all_steps():
            self.save()
        done = wait_for_save(self.checkpointer, timeout, self.echo)
        saved = f"saved checkpoint {self.progress.step}" if done else f"the save of step {self.progress.step} did not finish"
        self.out.metrics.close()
        raise StopRequested(f"stopped by {signal} after step {self.progress.step}; {saved}; {self.resume_point()}",
                            signal)

    def _before(self) -> Optional[float]:
        """Step 0: the train split's prompt statistics, validation before training (when asked),
        and their ``metrics.jsonl`` record; the held-out reward before training, or None."""
        cfg = self.cfg
        val_before = None
        val_before_env: dict = {}
        stats = getattr(self.services.rollout.prompts.source, "stats", None)
        if stats is not None:  # what data.filter_overlong_prompts / data.truncation did to the train split
            no_answer = (f", {stats.no_answer} skipped for an empty answer (first: row {stats.first_no_answer})"
                         if stats.no_answer else "")
            no_answer += (f", {stats.no_prompt} skipped for an empty prompt (first: row {stats.first_no_prompt})"
                          if stats.no_prompt else "")
            self.echo(f"train prompts: {stats.total} total, {stats.kept} kept, {stats.filtered} filtered as overlong, "
                      f"{stats.truncated} truncated (max_prompt_length {stats.max_length}, longest {stats.longest})"
                      f"{no_answer}")
        if cfg.trainer.val_before_train and self.progress.step == 0:
            val_before = self.validate()
            val_before_env = dict(self.progress.val_env)
            self.echo(f"validation before training: val/score/mean = {val_before:.3f}")
        if self.progress.step == 0:
            self.out.metrics.write(0, {**({} if stats is None else stats.metrics()),
                                   **({} if val_before is None else {"val/score/mean": val_before}),
                                   **val_before_env})
        return val_before

    def _run(self, stop, timeout: float) -> RunSummary:
        cfg = self.cfg
        total = cfg.trainer.total_steps
        first = self.progress.step
        t0 = time.perf_counter()
        val_before = self._before()
        tokens = 0
        last: dict = {}
        val = None
        step_times: list[float] = []
        while self.progress.step < total:
            last = self.train_one_step()
            try:
                applied = self.watch.check(self.progress.step, self.state, last)
            except NonFiniteUpdateError:
                self.out.metrics.write(self.progress.step, {**last, NONFINITE_ALERT: 1.0})
                raise
            # Validation and the checkpoint belong to the step's one metrics.jsonl record; the
            # last step always validates (the run's final held-out score).
            if self._due(cfg.trainer.test_freq) or self.progress.step == total:
                val = last["val/score/mean"] = self.validate()
                last.update(self.progress.val_env)
                if self.out.main:
                    self.echo(f"step {self.progress.step}: val/score/mean = {val:.3f}")
            if (self._due(cfg.trainer.save_freq) or self.progress.step == total) and applied:
                self.save()  # a step whose update was skipped is not saved: the last good checkpoint stays
            tokens += int(last["perf/total_num_tokens"])
            step_times.append(last["timing_s/step"])
            self.out.metrics.write(self.progress.step, last)
            if self.out.main and "console" in cfg.trainer.logger and (self._due(cfg.trainer.log_freq)
                                                                      or self.progress.step == total):
                _progress(self.progress.step, total, last["critic/score/mean"], step_times)
            if stop.requested:
                self._stop_requested(stop.requested, timeout)
        totals = self.schedule.close()
        if totals is not None:
            self.out.tracer.async_totals(totals)
        self.checkpointer.close()
        self.out.metrics.close()
        traced = self.out.tracer.close()
        trace_overhead = Tracer.describe_overhead(traced)
        if self.out.main:
            plot_report(self.run_dir)
        return RunSummary(steps=self.progress.step, first_step=first, tokens=tokens, wall_s=time.perf_counter() - t0,
                          stage_s=dict(self.progress.stage_s), train_reward=last.get("critic/score/mean"),
                          val_reward_before=val_before, val_reward=val, run_dir=self.run_dir,
                          resumed_from=self.progress.resumed_from, trace_overhead=trace_overhead,
                          error_alerts={k: v for k, v in traced["alerts"].items() if v.get("severity") == "error"})


def format_summary(s: RunSummary) -> str:
    """The end-of-run table: steps, tokens, wall time, time by stage, rewards, outputs."""
    ran = s.steps - s.first_step
    if s.first_step:  # a resumed run: say what this launch did and what the run holds
        rows = [("steps", f"{s.steps} in the run; {ran} run now (steps {s.first_step + 1}-{s.steps})"),
                ("tokens (this launch)", f"{s.tokens:,}"), ("wall time (this launch)", f"{s.wall_s:.1f} s")]
    else:
        rows = [("steps", f"{s.steps}"), ("tokens", f"{s.tokens:,}"), ("wall time", f"{s.wall_s:.1f} s")]
    busy = sum(s.stage_s.values()) or 1.0
    for stage, secs in sorted(s.stage_s.items(), key=lambda kv: -kv[1]):
        if secs > 0:
            rows.append((f"  {stage}", f"{secs:.1f} s ({100 * secs / busy:.0f}%)"))

    def fmt(x):
        return "n/a" if x is None or not np.isfinite(x) else f"{x:.3f}"

    rows += [("train reward (last step)", fmt(s.train_reward)), ("held-out reward before", fmt(s.val_reward_before)),
             ("held-out reward after", fmt(s.val_reward)), ("outputs", s.run_dir)]
    if s.resumed_from is not None:
        rows.append(("resumed from checkpoint", str(s.resumed_from)))
    if s.trace_overhead is not None:
        rows.append(("tracing overhead", s.trace_overhead))
    for name, a in sorted(s.error_alerts.items()):
        rows.append((f"error alert {name}", f"x{a.get('count')} from step {a.get('first_step')}: {a.get('message')}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
