"""``python -m rljax.launch [--mesh=dp8] [--config X] [key=value ...] [--run-dir DIR] [--resume[=N]] [--print-config]``

Resolves and validates the configuration and checks it against the files it names
(:func:`rljax.preflight.check_inputs`: each package's ``check(cfg)`` — reward plugin,
environment, checkpoint, tokenizer, ``tp`` against the vocabulary, dataset) before JAX starts, so a mistake costs seconds and writes nothing;
then sets up the devices (virtual CPU devices on a CPU host; multi-host initialisation
when asked), writes ``config.resolved.yaml`` and ``topology.json`` to the run directory,
and trains. With no arguments it runs the embedded default preset. ``--print-config``
prints every key with its value, source and meaning, and exits.

Usage errors (unknown keys, bad values, contradictions, a bad mesh spec, missing or
unusable files, a device-count mismatch on an accelerator, a run directory that is a
file, not writable, or locked by another run) print one line and exit with status 2. The run directory is locked
(:class:`rljax._rundir.RunDirLock`) for the run's life.

Exit status: 0 the run completed; 1 it stopped on an error (non-finite updates, a
checkpoint error, a stage's exception); 2 a usage error; 3 it completed (the final
checkpoint saved, ``trace_summary.json`` written) but an ``error``-severity alert fired
(:data:`rljax.trace.alerts.SEVERITY`): its data or update is suspect; 130 Ctrl-C; 143 SIGTERM
(the current step saved).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

from rljax._resume import ResumeRefused, nothing_to_train, plan, summary_closed
from rljax._rundir import RunDirError, RunDirLock, check_resume_from, check_run_dir
from rljax.compilation_cache import setup as setup_compilation_cache
from rljax.config import format_config, non_default_fields, parse_mesh_spec, resolve, validate_for_mesh, write_resolved
from rljax.errors import ConfigError, UsageError
from rljax.preflight import check_inputs as preflight
from rljax.reward import RewardError
from rljax.trainer.guard import NonFiniteUpdateError, StopRequested

# JAX and what imports it (rljax.sharding, rljax.trainer's run) are imported inside functions:
# setup_devices must set XLA_FLAGS / JAX_PLATFORMS before JAX starts.

_HOST_COUNT_FLAG = "--xla_force_host_platform_device_count"
# What dp>1 on virtual CPU devices costs (bench/peer_trl.py: 31.6M model, dp8 vs dp1 on a
# 2-core host: ~1.8x the step time, ~2.3x the peak memory).
_VIRTUAL_DEVICE_COST = ("; they share {cores} cores and one RAM, so dp{n} is no faster than dp1 and every replica "
                        "holds its own parameters, gradients, optimizer state and sampler copy (~{n}x their memory); "
                        "use --mesh=dp1 for speed and memory, dp{n} to check a layout")
DEFAULT_PRESET = "default"
#: Exit status of a run that completed but whose ``error``-severity alert fired.
ALERT_EXIT = 3


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse's own convention, kept short)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m rljax.launch",
                description="Train a policy with GRPO/PPO. Overrides are key=value, e.g. rollout.n=4.",
                epilog="Every config key with its value, source and meaning: "
                       "python -m rljax.launch --print-config [--config X] [key=value ...]")
    p.add_argument("--mesh", help="mesh over dp/tp/sp, e.g. dp8 or dp2,tp2,sp2 (sets trainer.mesh; "
                                  "default: dp over all devices)")
    p.add_argument("--config", default=None, help=f"preset name in configs/ or a YAML path (default: {DEFAULT_PRESET})")
    p.add_argument("--run-dir", default=None, help="output directory (sets trainer.output_dir; "
                                                   "default: runs/<trainer.project_name>/<trainer.experiment_name>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in the run directory that has a digest (newer ones a kill "
                        "left without one are set aside; sets trainer.resume_mode=auto); --resume=N from checkpoint N "
                        "(same as trainer.resume_from=N)")
    p.add_argument("--resume-unverified", action="store_true",
                   help="with --resume: restore a checkpoint that has no digest (its bytes cannot be verified; "
                        "refused otherwise)")
    p.add_argument("--resume-from-weights", action="store_true",
                   help="with --resume under another task, dataset or reward: take the policy weights of the run's "
                        "checkpoint, start the optimizer and the data position fresh")
    p.add_argument("--print-config", action="store_true",
                   help="print every config key with its value, source and one-line doc, then exit (writes nothing)")
    p.add_argument("--coordinator", help="multi-host: HOST:PORT of process 0 (jax.distributed.initialize)")
    p.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    p.add_argument("--process-id", type=int, help="multi-host: this process's index")
    p.add_argument("--distributed", action="store_true",
                   help="multi-host with the environment's auto-detection (TPU pods, SLURM)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="configuration overrides")
    return p


def _accelerator_present() -> bool:
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p in platforms for p in ("gpu", "cuda", "rocm", "tpu"))
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("jax_cuda12_plugin", "jax_cuda13_plugin", "libtpu"))


def resolve_config(args) -> tuple:
    """``(config, provenance)`` validated (mesh included) with no JAX imported; UsageError on any mistake.

    ``--mesh``, ``--run-dir`` and ``--resume`` are overrides of ``trainer.mesh``,
    ``trainer.output_dir`` and ``trainer.resume_mode`` (after the ``key=value`` ones), so
    ``config.resolved.yaml`` records them.
    """
    try:
        cfg, prov = resolve(args.config or DEFAULT_PRESET, _overrides(args))
        _validate_mesh(cfg)
    except (ConfigError, ValueError) as e:
        raise UsageError(str(e)) from None
    return cfg, prov


def _overrides(args) -> list:
    overrides = list(args.overrides)
    if args.mesh is not None:
        overrides.append(f"trainer.mesh={args.mesh}")
    if args.run_dir is not None:
        overrides.append(f"trainer.output_dir={args.run_dir}")
    if args.resume or args.resume_unverified or args.resume_from_weights:
        overrides.append("trainer.resume_mode=auto")
    return overrides


def _validate_mesh(cfg) -> None:
    if cfg.trainer.mesh:
        validate_for_mesh(cfg, parse_mesh_spec(cfg.trainer.mesh))


def resume_config(args, cfg, prov, run_dir: str) -> tuple:
    """``(config, provenance, lines)``: a resume runs with the run's recorded configuration
    (:func:`rljax._resume.plan`), the ``lines`` (to print) list the overrides on top; a change that
    would break the run, or change its task without ``--resume-from-weights``, is a UsageError
    before anything is written."""
    try:
        planned = plan(args.config, _overrides(args), run_dir, from_weights=args.resume_from_weights)
        if planned is None:
            return cfg, prov, []
        cfg, prov, lines = planned
        _validate_mesh(cfg)
    except (ConfigError, ResumeRefused, ValueError) as e:
        raise UsageError(str(e)) from None
    return cfg, prov, lines


def finished_run(args, cfg, run_dir: str, *, main: bool) -> Optional[str]:
    """One line when a resume has nothing to train (:func:`rljax._resume.nothing_to_train`: its
    checkpoint is at ``trainer.total_steps``), else None. Nothing is written, but for a run whose
    last launch was stopped after its last step, before it closed ``trace_summary.json`` or drew
    ``report.png``: the main process completes them (:func:`rljax.trace.tracer.complete_summary`)."""
    step = nothing_to_train(run_dir, cfg, unverified=args.resume_unverified)
    if step is None:
        return None
    total = cfg.trainer.total_steps
    line = (f"resume: checkpoint {step} is {'at' if step == total else 'past'} trainer.total_steps={total}: the run "
            f"in {run_dir} is complete, nothing to train; to train on, raise it (--resume trainer.total_steps=N, "
            f"N > {step})")
    if main and not summary_closed(run_dir):
        from rljax.trace.tracer import complete_summary  # JAX: only for a launch stopped after its last step

        note = complete_summary(run_dir, step)
        line += f"; {note}" if note else ""
    if main and not os.path.exists(os.path.join(run_dir, "report.png")):  # a launch stopped before drawing it
        from rljax.trace import plot_report  # JAX and matplotlib, as above

        plot_report(run_dir)
        line += "; report.png drawn (it was missing)"
    return line


#: What a run writes beside its checkpoints; a fresh launch never appends to them.
RUN_FILES = ("metrics.jsonl", "trace.jsonl", "rollout_uids.jsonl", "generations.jsonl", "trace_summary.json")


def run_directory(cfg) -> str:
    """``trainer.output_dir``, or ``runs/<project_name>/<experiment_name>`` when it is null."""
    t = cfg.trainer
    return t.output_dir or os.path.join("runs", t.project_name, t.experiment_name)


def check_inputs(cfg) -> None:
    """:func:`rljax.preflight.check_inputs` (every package's ``check(cfg)``), as a UsageError."""
    try:
        preflight(cfg)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def check_process_split(cfg, processes) -> None:
    """Each process generates ``data.train_batch_size / processes`` whole prompt groups
    (:mod:`rljax.trainer.distribute`): the batch must split evenly."""
    if processes and processes > 1 and cfg.data.train_batch_size % processes:
        raise UsageError(f"data.train_batch_size={cfg.data.train_batch_size} prompts do not split over "
                         f"--num-processes={processes}: each process generates whole prompt groups; use a multiple "
                         f"of {processes}")


def check_cpu_placement(cfg) -> None:
    """On a CPU host the launcher creates the mesh's devices (plus the sampler's), so a
    disaggregated placement needs the mesh spelled out; refused before the run directory."""
    if cfg.rollout.placement == "disaggregated" and cfg.trainer.mesh is None and not _accelerator_present():
        raise UsageError(f"rollout.placement=disaggregated on a CPU host needs --mesh (trainer.mesh) for the "
                         f"learner: the launcher then creates mesh + rollout.num_devices={cfg.rollout.num_devices} "
                         "virtual CPU devices (e.g. --mesh=dp4)")


def setup_devices(args, spec, rollout_devices: int = 0) -> None:
    """Multi-host initialisation, then the CPU host device count; both before JAX's backends start.

    ``rollout_devices``: the sampler's own devices per process (``rollout.placement=disaggregated``),
    beyond the learner mesh's."""
    from rljax.sharding.mesh import spec_device_count  # JAX: not at import (usage errors answer without it)

    multi = args.coordinator or args.num_processes or args.process_id is not None or args.distributed
    need = None if spec is None else spec_device_count(spec)
    if not _accelerator_present() and need is not None:
        local = need
        if args.num_processes:
            if need % args.num_processes:
                raise UsageError(f"mesh needs {need} devices, which does not split over {args.num_processes} processes")
            local = need // args.num_processes
        flags = os.environ.get("XLA_FLAGS", "")
        if _HOST_COUNT_FLAG not in flags:
            total = local + rollout_devices
            os.environ["XLA_FLAGS"] = f"{flags} {_HOST_COUNT_FLAG}={total}".strip()
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
            split = (f": {local} for the learner mesh + {rollout_devices} for the sampler (rollout.placement="
                     "disaggregated)") if rollout_devices else ""
            print(f"rljax: CPU host: created {total} virtual CPU devices ({_HOST_COUNT_FLAG}={total}){split}"
                  + (_VIRTUAL_DEVICE_COST.format(n=local, cores=os.cpu_count()) if local > 1 else ""))
    import jax

    if multi:
        if not args.distributed and not (args.coordinator and args.num_processes and args.process_id is not None):
            raise UsageError("multi-host needs --coordinator HOST:PORT --num-processes N --process-id I together "
                             "(or --distributed for auto-detection)")
        kwargs = {} if args.distributed else dict(coordinator_address=args.coordinator,
                                                   num_processes=args.num_processes, process_id=args.process_id)
        if not _accelerator_present():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(**kwargs)
    extra = rollout_devices * jax.process_count()
    if need is not None and jax.device_count() != need + extra:
        more = f" + {extra} for the sampler (rollout.num_devices={rollout_devices} per process)" if extra else ""
        raise UsageError(f"mesh {spec} needs {need} devices{more}, found {jax.device_count()} "
                         f"({jax.devices()[0].platform})")
    if need is None and rollout_devices and jax.local_device_count() <= rollout_devices:
        raise UsageError(f"rollout.num_devices={rollout_devices} leaves no device for the learner: this process has "
                         f"{jax.local_device_count()} ({jax.devices()[0].platform})")


def placement_devices(cfg) -> list:
    """The learner mesh's devices (:func:`rljax.sharding.split_devices`): all of them (colocated), or
    on every process all local devices but the last ``rollout.num_devices`` (disaggregated)."""
    import jax

    from rljax.sharding import split_devices  # JAX: imported only after setup_devices has configured it

    n = cfg.rollout.num_devices if cfg.rollout.placement == "disaggregated" else 0
    return split_devices(jax.devices(), n)[0]


def placement_topology(cfg, mesh) -> dict:
    """``topology.json``'s ``placement``: both device groups, their meshes, and whether they are disjoint."""
    import jax

    from rljax.trainer.build import rollout_devices  # JAX: imported only after setup_devices has configured it

    r = cfg.rollout
    learner = [d.id for d in mesh.devices.flat]
    sampler = [d.id for d in rollout_devices(cfg, mesh)]
    n = len(sampler)
    return {"mode": r.placement, "trainer_mode": cfg.trainer.mode,
            "learner": {"devices": learner, "mesh": dict(mesh.shape)},
            "rollout": {"devices": sampler, "devices_per_process": n, "mesh": {"dp": n // r.tp, "tp": r.tp},
                        "tp": r.tp, "replicas_per_process": n // r.tp,
                        "replicas_derivation": f"sampler devices per process / rollout.tp = {n} / {r.tp}",
                        "processes": jax.process_count()},
            "disjoint": not set(learner) & set(sampler),
            "device_ratio": device_ratio(n * jax.process_count(), len(learner), shared=bool(set(learner) & set(sampler)))}


def device_ratio(rollout: int, learner: int, *, shared: bool) -> dict:
    """The rollout:learner device ratio (``topology.json``'s ``placement.device_ratio``), in lowest terms."""
    g = math.gcd(rollout, learner) or 1
    return {"rollout": rollout, "learner": learner, "ratio": f"{rollout // g}:{learner // g}",
            "shared": shared, "note": "colocated: the same devices take turns" if shared else
            "disaggregated: disjoint device groups"}


def _resume_arg(argv: list) -> list:
    """``--resume=N`` -> ``--resume trainer.resume_from=N`` (a plain ``--resume`` stays a flag)."""
    out = []
    for a in argv:
        if a.startswith("--resume="):
            out += ["--resume", f"trainer.resume_from={a.split('=', 1)[1]}"]
        else:
            out.append(a)
    return out


def _stderr_line(line: str) -> None:
    """One line on stderr in one write: the processes of a multi-process job share the stream, and
    ``print`` writes the text and its newline apart, so two processes' lines ran together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv=None) -> int:
    # intermixed: overrides may come before and after options (`... rollout.n=4 --resume trainer.total_steps=8`)
    args = _parser().parse_intermixed_args(_resume_arg(list(sys.argv[1:] if argv is None else argv)))
    lock = done = None  # done: the one line of a resume with nothing to train
    try:
        cfg, prov = resolve_config(args)
        if args.print_config:
            print(format_config(cfg, prov))
            return 0
        args.resume = cfg.trainer.resume_mode == "auto" or cfg.trainer.resume_from is not None
        run_dir = os.path.abspath(run_directory(cfg))
        plan_lines: list = []
        if args.resume:
            cfg, prov, plan_lines = resume_config(args, cfg, prov, run_dir)
            run_dir = os.path.abspath(run_directory(cfg))
        check_run_dir(run_dir)
        check_resume_from(run_dir, cfg.trainer.resume_from)
        check_inputs(cfg)  # before the lock creates the run directory
        check_process_split(cfg, args.num_processes)
        check_cpu_placement(cfg)
        if not args.distributed and (args.process_id or 0) == 0:  # process 0 locks before reading the directory
            lock = RunDirLock(run_dir).acquire()
        if args.resume and not args.distributed:  # every process reads the same directory
            done = finished_run(args, cfg, run_dir, main=(args.process_id or 0) == 0)
            if done is not None:
                if (args.process_id or 0) == 0:
                    print(f"rljax: {done}")
                return 0  # the lock is released below
        for line in plan_lines:
            print(f"rljax: {line}")
        ckpt_dir = os.path.join(run_dir, "checkpoints")
        if not args.resume and os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
            raise UsageError(f"run directory {run_dir} already holds checkpoints; pass --resume "
                             "(trainer.resume_mode=auto) to continue it or --run-dir for a new run")
        old = [f for f in RUN_FILES if os.path.exists(os.path.join(run_dir, f))]
        if not args.resume and old:
            raise UsageError(f"run directory {run_dir} holds a previous run's {', '.join(old)} (no checkpoint); a new "
                             "run does not append to them: pass --resume to start that run over from step 0 (its "
                             "records are cut back) or --run-dir for a new run")
        setup_devices(args, cfg.trainer.mesh,
                      cfg.rollout.num_devices if cfg.rollout.placement == "disaggregated" else 0)
        if args.distributed:
            import jax

            if jax.process_index() == 0:
                lock = RunDirLock(run_dir).acquire()
            done = finished_run(args, cfg, run_dir, main=jax.process_index() == 0) if args.resume else None
            if done is not None:
                if jax.process_index() == 0:
                    print(f"rljax: {done}")
                return 0
    except (UsageError, RunDirError) as e:
        if lock is not None:
            lock.release(undo=True)  # a refused launch leaves nothing behind
            lock = None
        _stderr_line(f"rljax.launch: error: {e}")
        return 2
    finally:
        if lock is not None and done is not None:  # a finished run: nothing was trained or written
            lock.release()
    try:
        return _run(args, cfg, prov, run_dir)
    finally:
        if lock is not None:
            lock.release()


class _RunRecord:
    """``config.resolved.yaml`` and ``topology.json``, written before the run starts and put back
    as they were (or removed) when the run is refused while it builds (a damaged checkpoint)."""

    NAMES = ("config.resolved.yaml", "topology.json")

    def __init__(self, run_dir: str, *, enabled: bool):
        self.run_dir, self.enabled = run_dir, enabled
        self.before: dict = {}

    def write(self, cfg, prov, topo) -> None:
        if not self.enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        for name in self.NAMES:
            path = os.path.join(self.run_dir, name)
            self.before[name] = open(path, "rb").read() if os.path.isfile(path) else None
        write_resolved(cfg, prov, os.path.join(self.run_dir, "config.resolved.yaml"))
        with open(os.path.join(self.run_dir, "topology.json"), "w") as fh:
            json.dump(topo, fh, indent=2)

    def undo(self) -> None:
        for name, data in self.before.items():
            path = os.path.join(self.run_dir, name)
            if data is None:
                os.remove(path)
            else:
                with open(path, "wb") as fh:
                    fh.write(data)


def _run(args, cfg, prov, run_dir) -> int:
    import jax

    setup_compilation_cache(cfg.trainer.compilation_cache_dir, echo=print if jax.process_index() == 0 else None)
    # JAX, flax, orbax: imported only after setup_devices has configured JAX
    from rljax.sharding import make_mesh, topology
    from rljax.trainer.loop import Trainer, format_summary

    learner_devices = placement_devices(cfg)
    spec = cfg.trainer.mesh or f"dp{len(learner_devices)}"
    mesh = make_mesh(spec, learner_devices)
    topo = topology(mesh)
    topo["placement"] = placement_topology(cfg, mesh)
    # JAX: imported only after setup_devices has configured it
    from rljax.trainer.distribute import check_async_share, rollout_share

    try:  # which prompts (uids) each process generates
        share = rollout_share(mesh, cfg.data.train_batch_size, cfg.rollout.n)
    except ValueError as e:  # --distributed: the process count is known only now
        _stderr_line(f"rljax.launch: error: {e}")
        return 2
    try:
        if cfg.trainer.mode == "async":  # the rollout threads must not communicate
            check_async_share(share, spec, filter_groups=cfg.algorithm.filter_groups.enable)
    except ValueError as e:
        _stderr_line(f"rljax.launch: error: {e}")
        return 2
    topo["rollout_share"] = share.describe()
    topo.update(rollout_tp=cfg.rollout.tp, rollout_replicas=topo["placement"]["rollout"]["replicas_per_process"],
                actor_dp_derivation=f"world_size / (tp * sp) = {topo['world_size']} / "
                                    f"({topo['mesh']['tp']} * {topo['mesh']['sp']}) = {topo['actor_dp']}",
                actor_strategy="jax-spmd: one jitted train step on the learner mesh (dp: batch rows, "
                               "tp: heads / MLP hidden / vocab, sp: sequence)",
                rollout_backend="rljax JetStream engine (process-local sampler mesh: replicas x rollout.tp)",
                rollout_replicas_derivation=topo["placement"]["rollout"]["replicas_derivation"],
                trace_groups=cfg.trace.groups)
    main_process = jax.process_index() == 0
    if main_process:
        changed = non_default_fields(cfg, prov)
        print(f"rljax: mesh {spec} on {topo['world_size']} {topo['platform']} device(s), "
              f"{topo['process_count']} process(es); actor_dp = {topo['actor_dp_derivation']}")
        pl = topo["placement"]
        print(f"rljax: placement {pl['mode']}: learner devices {pl['learner']['devices']}, sampler devices "
              f"{pl['rollout']['devices']} ({pl['rollout']['replicas_per_process']} replica(s) x tp{cfg.rollout.tp})"
              + (", disjoint" if pl["disjoint"] else ", shared") + f"; trainer.mode={cfg.trainer.mode}")
        rs = topo["rollout_share"]
        if rs["processes"] > 1:
            print(f"rljax: rollout across {rs['processes']} processes: {rs['prompts_per_process']} prompt groups "
                  f"each, by process {rs['prompts_by_process']} ({rs['assembly']} learner batch)")
        print("rljax: non-default settings:" + ("".join(f"\n  {c}" for c in changed) if changed else " none"))
    from rljax.trainer.checkpoint import CheckpointError  # orbax: imported only after setup_devices has configured it

    record = _RunRecord(run_dir, enabled=main_process)  # the trace reads config.resolved.yaml as the run starts
    record.write(cfg, prov, topo)
    try:
        trainer = Trainer(cfg, mesh, run_dir, resume=args.resume, echo=print if main_process else (lambda *a: None),
                          resume_unverified=args.resume_unverified, resume_from_weights=args.resume_from_weights)
    except ConfigError as e:  # data problems found while building the run (an empty split, a missing file)
        record.undo()
        _stderr_line(f"rljax.launch: error: {e}")
        return 2
    except CheckpointError as e:  # a refused restore leaves the run's record as it was
        record.undo()
        _stderr_line(f"rljax.launch: error: {e}")
        return 1

    try:
        summary = trainer.run()
    except (NonFiniteUpdateError, RewardError) as e:  # the run stopped itself; its saves are committed
        _stderr_line(f"rljax.launch: error: step {trainer.step}: {e}; {trainer.resume_point()}")
        return 1
    except CheckpointError as e:  # a save failed (a full disk, a read-only directory): the older ones are intact
        _stderr_line(f"rljax.launch: error: {e}; {trainer.intact_point()}")
        return 1
    except OSError as e:  # writing a record failed (a full disk, a read-only run directory): one line, no traceback
        where = f" {e.filename}" if e.filename else " the run directory"
        _stderr_line(f"rljax.launch: error: step {trainer.step} stopped: writing{where} failed: "
                     f"{e.strerror or type(e).__name__}; {trainer.intact_point()}")
        return 1
    except StopRequested as e:  # SIGTERM or SIGINT: the current step was saved
        _stderr_line(f"rljax.launch: {e}")
        return 130 if e.signal_name == "SIGINT" else 143
    except KeyboardInterrupt:  # a second Ctrl-C: the step in flight is abandoned
        _stderr_line(f"rljax.launch: interrupted during step {trainer.step}; {trainer.resume_point()}")
        return 130
    if main_process:
        print(format_summary(summary))
    if summary.error_alerts:  # the final checkpoint is saved; the run's data or update is suspect
        fired = ", ".join(f"{k} x{v.get('count')} (first at step {v.get('first_step')})"
                          for k, v in sorted(summary.error_alerts.items()))
        _stderr_line(f"rljax.launch: error-severity alert(s) fired: {fired}; exit status 3 (see python -m rljax.trace check)")
        return ALERT_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
