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
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Optional

from rljax._resume import (CHANGES, ResumeRefused, nothing_to_train, plan, record_changes, resume_base,
                           summary_closed)
from rljax._rundir import (RunDirError, RunDirLock, StartupStop, check_resume_from, check_run_dir, may_run_again,
                          startup_signals, startup_stop_line)
from rljax.compilation_cache import retry_bypassed, setup as setup_compilation_cache
from rljax.config import (format_config, non_default_fields, parse_mesh_spec, resolve, resolve_run, validate_for_mesh,
                          write_resolved)
from rljax.errors import ConfigError, UsageError
from rljax.plan import parse_bytes, resolve_for_plan, run_plan
from rljax.preflight import check_inputs as preflight
from rljax.reward import RewardError
from rljax.trainer.guard import NonFiniteUpdateError, StopRequested

if TYPE_CHECKING:
    from rljax.sharding.placement import Placement

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
    p.add_argument("--plan", action="store_true",
                   help="print the per-device memory plan of this run and whether it fits, train nothing, write "
                        "nothing (exit 0 fits, 1 not; rljax.plan)")
    p.add_argument("--device-memory", help="with --plan: the memory of one device, e.g. 80GiB or 16GB "
                                           "(default: the device's own)")
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
        if getattr(args, "plan", False):  # a plan reads no data files
            cfg, prov = resolve_for_plan(args.config, _overrides(args))
        else:
            resuming = args.resume or args.resume_unverified or args.resume_from_weights
            base = resume_base(args.config, args.run_dir, resuming)  # a bare --resume: checked on the run's values
            cfg, prov = resolve(base, _overrides(args)) if base else resolve_run(args.config, _overrides(args))
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


def setup_devices(args, cfg) -> "Placement":
    """Multi-host initialisation and the CPU host device count (both before JAX's backends start),
    then the run's :class:`~rljax.sharding.placement.Placement` over the devices JAX found: the
    learner mesh's devices and this process's sampler devices, computed once here."""
    from rljax.sharding.placement import Placement  # JAX: not at import (usage errors answer without it)

    _host_devices(args, cfg)
    import jax

    if args.coordinator or args.num_processes or args.process_id is not None or args.distributed:
        _initialize_distributed(args)
    r = cfg.rollout
    try:
        return Placement.compute(mode=r.placement, num_devices=r.num_devices, mesh_spec=cfg.trainer.mesh,
                                 devices=jax.devices(), local_devices=jax.local_devices(),
                                 processes=jax.process_count())
    except ValueError as e:
        raise UsageError(str(e)) from None


def plan_run(args, cfg) -> int:
    """``--plan``: the memory plan (:mod:`rljax.plan`) on the devices a run would have; writes nothing."""
    if not args.plan:
        raise UsageError("--device-memory is read by --plan only; add --plan")
    try:
        device_bytes = parse_bytes(args.device_memory) if args.device_memory else None
    except ValueError as e:
        raise UsageError(str(e)) from None
    placement = setup_devices(args, cfg)

    def reconfigure(extra: list):  # a candidate change, resolved and checked as the launch would
        again = argparse.Namespace(**vars(args))
        again.overrides = list(args.overrides) + [e for e in extra if not e.startswith("trainer.mesh=")]
        again.mesh = next((e.split("=", 1)[1] for e in extra if e.startswith("trainer.mesh=")), args.mesh)
        return resolve_config(again)[0]

    try:
        return run_plan(cfg, placement, device_bytes=device_bytes, reconfigure=reconfigure)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def _host_devices(args, cfg) -> None:
    """On a CPU host, ``XLA_FLAGS`` creates this process's share of the mesh's devices plus the
    sampler's own (``rollout.placement=disaggregated``) as virtual CPU devices."""
    # JAX: not at import (usage errors answer without it); XLA_FLAGS is read only when its backends start
    from rljax.sharding.mesh import spec_device_count
    from rljax.sharding.placement import sampler_devices_per_process

    spec = cfg.trainer.mesh
    if _accelerator_present() or spec is None:
        return
    rollout_devices = sampler_devices_per_process(cfg.rollout.placement, cfg.rollout.num_devices)
    local = need = spec_device_count(spec)
    if args.num_processes:
        if need % args.num_processes:
            raise UsageError(f"mesh needs {need} devices, which does not split over {args.num_processes} processes")
        local = need // args.num_processes
    flags = os.environ.get("XLA_FLAGS", "")
    if _HOST_COUNT_FLAG in flags:
        return
    total = local + rollout_devices
    os.environ["XLA_FLAGS"] = f"{flags} {_HOST_COUNT_FLAG}={total}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    split = (f": {local} for the learner mesh + {rollout_devices} for the sampler (rollout.placement="
             "disaggregated)") if rollout_devices else ""
    print(f"rljax: CPU host: created {total} virtual CPU devices ({_HOST_COUNT_FLAG}={total}){split}"
          + (_VIRTUAL_DEVICE_COST.format(n=local, cores=os.cpu_count()) if local > 1 else ""))


def _initialize_distributed(args) -> None:
    """``jax.distributed.initialize`` from ``--coordinator`` / ``--num-processes`` / ``--process-id``
    (or the environment's auto-detection with ``--distributed``)."""
    import jax

    if not args.distributed and not (args.coordinator and args.num_processes and args.process_id is not None):
        raise UsageError("multi-host needs --coordinator HOST:PORT --num-processes N --process-id I together "
                         "(or --distributed for auto-detection)")
    kwargs = {} if args.distributed else dict(coordinator_address=args.coordinator,
                                               num_processes=args.num_processes, process_id=args.process_id)
    if not _accelerator_present():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**kwargs)


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
    with startup_signals():  # the step loop takes SIGTERM / SIGINT over while it runs
        try:
            return _run(args)
        except StartupStop as stop:
            _stderr_line(f"rljax.launch: {startup_stop_line(stop, _stopped_run_dir(args))}")
            return stop.exit_code


def _stopped_run_dir(args) -> Optional[str]:
    """The run directory of a launch stopped while it started (None when its configuration does not resolve)."""
    try:
        return args.run_dir or run_directory(resolve_config(args)[0])
    except Exception:  # noqa: BLE001 -- the line goes without the resume point
        return None


def _run(args) -> int:
    """resolve -> preflight -> train -> exit code (the module docstring lists them)."""
    held = _Held()
    try:
        ready = _preflight(args, held)
    except (UsageError, RunDirError) as e:
        held.release(undo=True)  # a refused launch leaves nothing behind
        _stderr_line(f"rljax.launch: error: {e}")
        return 2
    try:
        if isinstance(ready, int):
            return ready
        one = not (args.distributed or args.coordinator or args.num_processes)  # processes would retry apart
        again = may_run_again(ready.run_dir, new_run=not args.resume, records=RUN_FILES)
        return retry_bypassed(lambda: _train(args, ready), eligible=lambda: one and again())
    finally:
        held.release()


class _Held:
    """The run directory's lock, once a process takes it."""

    def __init__(self):
        self.lock: Optional[RunDirLock] = None

    def take(self, run_dir: str) -> None:
        self.lock = RunDirLock(run_dir).acquire()

    def release(self, *, undo: bool = False) -> None:
        if self.lock is not None:
            self.lock.release(undo=undo) if undo else self.lock.release()
            self.lock = None


@dataclasses.dataclass(frozen=True)
class _Ready:
    """What preflight hands to training: the configuration, its run directory and the placement."""

    cfg: Any
    prov: Any
    run_dir: str
    placement: Any


def _preflight(args, held: _Held):
    """Resolves the configuration and checks it, its files and the run directory (a UsageError on
    a mistake, before anything is written), locks the directory and sets up the devices:
    a :class:`_Ready`, or an exit status (0: ``--print-config``, or a resume with nothing to train)."""
    cfg, prov = resolve_config(args)
    if args.print_config:
        print(format_config(cfg, prov))
        return 0
    if args.plan or args.device_memory:
        return plan_run(args, cfg)
    flag = args.resume or args.resume_unverified or args.resume_from_weights  # --resume itself, not the key
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
        held.take(run_dir)
        check_resume_target(run_dir, flag=flag)
    if args.resume and not args.distributed and _finished(args, cfg, run_dir, main=(args.process_id or 0) == 0):
        return 0  # every process reads the same directory; the lock is released by the caller
    for line in plan_lines:
        print(f"rljax: {line}")
    check_fresh_run_dir(run_dir, resume=args.resume)
    placement = setup_devices(args, cfg)
    if args.distributed:
        import jax

        if jax.process_index() == 0:
            held.take(run_dir)
        if args.resume and _finished(args, cfg, run_dir, main=jax.process_index() == 0):
            return 0
    return _Ready(cfg, prov, run_dir, placement)


def _finished(args, cfg, run_dir: str, *, main: bool) -> bool:
    """A resume with nothing to train: the main process prints :func:`finished_run`'s line."""
    done = finished_run(args, cfg, run_dir, main=main)
    if done is not None and main:
        print(f"rljax: {done}")
    return done is not None


def check_resume_target(run_dir: str, *, flag: bool) -> None:
    """``--resume`` names a directory that holds a run (checkpoints or a run's records): a mistyped
    ``--run-dir`` started a fresh run silently. verl's ``trainer.resume_mode=auto`` (the key) keeps
    its meaning: resume when there is a run, else start one."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    held = (os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir)) or any(
        os.path.exists(os.path.join(run_dir, f)) for f in (*RUN_FILES, "config.resolved.yaml"))
    if flag and not held:
        raise UsageError(f"--resume: run directory {run_dir} holds no run (no checkpoints, no config.resolved.yaml); "
                         "check --run-dir (default runs/<trainer.project_name>/<trainer.experiment_name>); drop "
                         "--resume to start a new run there, or pass trainer.resume_mode=auto to start or continue "
                         "(a requeued job)")


def check_fresh_run_dir(run_dir: str, *, resume: bool) -> None:
    """A new run (no ``--resume``) refuses a directory holding a previous run's checkpoints or records."""
    if resume:
        return
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if os.path.isdir(ckpt_dir) and os.listdir(ckpt_dir):
        raise UsageError(f"run directory {run_dir} already holds checkpoints; pass --resume "
                         "(trainer.resume_mode=auto) to continue it or --run-dir for a new run")
    old = [f for f in RUN_FILES if os.path.exists(os.path.join(run_dir, f))]
    if old:
        raise UsageError(f"run directory {run_dir} holds a previous run's {', '.join(old)} (no checkpoint); a new "
                         "run does not append to them: pass --resume to start that run over from step 0 (its "
                         "records are cut back) or --run-dir for a new run")


class _RunRecord:
    """``config.resolved.yaml`` and ``topology.json``, written before the run starts and put back
    as they were (or removed) when the run is refused while it builds (a damaged checkpoint)."""

    NAMES = ("config.resolved.yaml", "topology.json", CHANGES)

    def __init__(self, run_dir: str, *, enabled: bool, unverified: bool = False):
        self.run_dir, self.enabled, self.unverified = run_dir, enabled, unverified
        self.before: dict = {}

    def write(self, cfg, prov, topo) -> None:
        if not self.enabled:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        for name in self.NAMES:
            path = os.path.join(self.run_dir, name)
            self.before[name] = open(path, "rb").read() if os.path.isfile(path) else None
        record_changes(self.run_dir, cfg, unverified=self.unverified)  # a resume: from which step what changed
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


def topology_record(cfg, mesh, placement) -> dict:
    """``topology.json``: the learner mesh (:func:`rljax.sharding.topology`), the placement
    (:meth:`~rljax.sharding.placement.Placement.describe`), each process's prompts
    (:func:`rljax.trainer.distribute.rollout_share`) and how each figure is derived.

    Raises:
      ValueError: the batch does not split over the processes, or an asynchronous run's rows would
        cross processes (:func:`rljax.trainer.distribute.check_async_share`).
    """
    # JAX: imported only after setup_devices has configured it
    from rljax.sharding import topology
    from rljax.trainer.distribute import check_async_share, rollout_share

    topo = topology(mesh)
    topo["placement"] = placement.describe(mesh, rollout_tp=cfg.rollout.tp, trainer_mode=cfg.trainer.mode)
    share = rollout_share(mesh, cfg.data.train_batch_size, cfg.rollout.n)  # which prompts (uids) each process generates
    if cfg.trainer.mode == "async":  # the rollout threads must not communicate
        check_async_share(share, placement.mesh_spec, filter_groups=cfg.algorithm.filter_groups.enable)
    topo["rollout_share"] = share.describe()
    topo.update(rollout_tp=cfg.rollout.tp, rollout_replicas=topo["placement"]["rollout"]["replicas_per_process"],
                actor_dp_derivation=f"world_size / (tp * sp) = {topo['world_size']} / "
                                    f"({topo['mesh']['tp']} * {topo['mesh']['sp']}) = {topo['actor_dp']}",
                actor_strategy="jax-spmd: one jitted train step on the learner mesh (dp: batch rows, "
                               "tp: heads / MLP hidden / vocab, sp: sequence)",
                rollout_backend="rljax JetStream engine (process-local sampler mesh: replicas x rollout.tp)",
                rollout_replicas_derivation=topo["placement"]["rollout"]["replicas_derivation"],
                trace_groups=cfg.trace.groups)
    return topo


def _print_layout(cfg, prov, topo: dict, spec: str) -> None:
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


def _train(args, ready: _Ready) -> int:
    """Builds the learner mesh on the placement, writes the run's record, builds and runs the
    trainer: the exit status."""
    import jax

    cfg, placement = ready.cfg, ready.placement
    setup_compilation_cache(cfg.trainer.compilation_cache_dir, echo=print if jax.process_index() == 0 else None)
    from rljax.sharding import make_mesh  # JAX: imported only after setup_devices has configured it

    mesh = make_mesh(placement.mesh_spec, placement.learner)
    try:
        topo = topology_record(cfg, mesh, placement)
    except ValueError as e:  # --distributed: the process count is known only now
        _stderr_line(f"rljax.launch: error: {e}")
        return 2
    main_process = jax.process_index() == 0
    if main_process:
        _print_layout(cfg, ready.prov, topo, placement.mesh_spec)
    # the trace reads config.resolved.yaml as the run starts
    record = _RunRecord(ready.run_dir, enabled=main_process, unverified=args.resume_unverified)
    record.write(cfg, ready.prov, topo)
    trainer = _build(args, ready, mesh, record, main_process)
    return trainer if isinstance(trainer, int) else _exit_status(trainer, main_process)


def _build(args, ready: _Ready, mesh, record: "_RunRecord", main_process: bool):
    """The :class:`~rljax.trainer.loop.Trainer`, or an exit status when it refuses to build (the
    run's record put back as it was)."""
    # JAX, flax, orbax: imported only after setup_devices has configured JAX
    from rljax.trainer.checkpoint import CheckpointError
    from rljax.trainer.loop import Trainer

    try:
        return Trainer(ready.cfg, mesh, ready.run_dir, resume=args.resume,
                       echo=print if main_process else (lambda *a: None), resume_unverified=args.resume_unverified,
                       resume_from_weights=args.resume_from_weights, placement=ready.placement)
    except ConfigError as e:  # data problems found while building the run (an empty split, a missing file)
        record.undo()
        _stderr_line(f"rljax.launch: error: {e}")
        return 2
    except CheckpointError as e:  # a refused restore leaves the run's record as it was
        record.undo()
        _stderr_line(f"rljax.launch: error: {e}")
        return 1


def _exit_status(trainer, main_process: bool) -> int:
    """Runs ``trainer``: 0 done, 1 it stopped on an error, 130 / 143 a signal, :data:`ALERT_EXIT`
    done with an ``error``-severity alert; a stop is one line on stderr."""
    # JAX, flax, orbax: imported only after setup_devices has configured JAX
    from rljax.trainer.checkpoint import CheckpointError
    from rljax.trainer.loop import format_summary

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
