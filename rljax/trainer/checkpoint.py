"""Verified orbax checkpoints of the whole run state: params, optimizer state, step counters,
data-iterator position, weight version and the resolved config.

Saves are asynchronous (the step loop continues while arrays are written) and atomic:
orbax writes into a temporary directory and renames it when complete. After the rename
(the commit) a background thread records a SHA-256 digest of every file of the
checkpoint in ``<step>/rljax_digest.json``, together with whether every saved array was
finite. A restore verifies the digest and checks that every restored value is finite; a
damaged checkpoint is a :class:`CheckpointError` that names it, says why, and names the
newest intact one.

Checkpoint states:

* *verified*: a digest is present, the files match it and the arrays were finite;
* *unverified*: committed but no digest (the run stopped between the commit and the
  digest, or the checkpoint predates verification); never restored unless asked for
  (``allow_unverified``, the launcher's ``--resume-unverified``), because its bytes cannot be
  told from damaged ones: a resume names it with the newest verified checkpoint instead;
* *damaged*: the files do not match the digest, a file is missing, the digest is
  unreadable, the values are not finite, or orbax cannot read it.

A checkpoint that is intact but does not fit this run (another model shape, another LoRA
shape) is a :class:`CheckpointMismatch`, listing the arrays and both shapes: never
reported as damage.

The keep-N rule (``trainer.max_checkpoints``) runs after a new checkpoint is committed and
its digest written, and never deletes the newest verified checkpoint. Old checkpoints
are deleted by renaming to ``<step>.rljax-deleting`` first, so a kill during deletion never
leaves a half-deleted ``<step>`` that looks complete. Unfinished saves
(``*.orbax-checkpoint-tmp*``) and half-deleted directories are removed when the
checkpointer opens the directory, with one line each.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from rljax._rundir import DIGEST_FILE, committed_checkpoints, passed_over_line, resume_checkpoint
_DELETING = ".rljax-deleting"
_ORBAX_TMP = ".orbax-checkpoint-tmp"
_DISCARDED = "discarded"


def _no_replica_parallel_saves_on_cpu() -> bool:
    """On a CPU host, saves jax.Arrays without orbax's replica-parallel slicing; True if it did.

    Replica-parallel saving cuts an array replicated over R devices into R slices, one written
    by each replica: worth it across accelerator hosts. On one CPU host every device is the same
    memory and disk, and each slice is an eager ``slice`` compiled once per (shape, device): the
    first save of the tiny model's train state on dp8 took 8.5-12.4 s with it and 2.0-2.8 s
    without (later saves 0.6-1.4 s vs 0.2 s). orbax turns it off itself for GPUs; this does the
    same for CPU, in orbax's process-wide registry (saving options only: the files restore either
    way). Accelerator backends keep orbax's default."""
    if jax.default_backend() != "cpu":
        return False
    try:  # the default registry's handler keeps per-array metadata in this store
        from orbax.checkpoint._src.metadata import array_metadata_store
    except ImportError:  # another orbax layout: keep its default
        return False
    from absl import logging as absl_logging

    handler = ocp.type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=array_metadata_store.Store())
    verbosity = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)  # the override is ours: no "overriding jax.Array" warning per run
    try:
        ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
    finally:
        absl_logging.set_verbosity(verbosity)
    return True


def _why(e: BaseException) -> str:
    """One short reason for a failed save: the OS error when there is one (orbax / tensorstore
    wrap it as ``... [os_error_code='28']``), else the exception's first 300 characters."""
    import re

    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f" ({e.filename})" if e.filename else "")
    text = " ".join(str(e).split())
    code = re.search(r"os_error_code='?(\d+)", text)
    if code:
        return f"{os.strerror(int(code.group(1)))} (os error {code.group(1)}; {type(e).__name__})"
    return f"{type(e).__name__}: {text[:300]}"


def _codes(tb):
    """The code objects of a traceback's frames, outermost first."""
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


def _raised_in_orbax(exc_info) -> bool:
    """True when the record's exception was raised inside orbax's code (its traceback passes
    through an ``orbax`` file)."""
    tb = exc_info[2] if exc_info and len(exc_info) == 3 else None
    return any("orbax" in code.co_filename for code in _codes(tb))


class _QuietOrbaxErrors(logging.Filter):
    """Drops the ERROR records of orbax's background save threads (a traceback each, about 300
    lines for one failed save on a full disk): :class:`Checkpointer` reports the failure itself, in
    one line, when the step loop next waits on the save. Two sources: orbax logging through absl,
    and asyncio's "Task exception was never retrieved" for orbax's own writer tasks, which its
    event loops log when they are collected (the CI run of 1 Dec printed ten of those)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        return not ("orbax" in record.pathname or _raised_in_orbax(record.exc_info) or _lost_write(record))


def _lost_write(record: logging.LogRecord) -> bool:
    """asyncio's "Future exception was never retrieved" for a tensorstore write of a failed save: the
    error is set on the future from C (no Python traceback to name orbax), an absl status such as
    ``ValueError('RESOURCE_EXHAUSTED: ...')`` on a full disk. 1 full-disk run in 4 printed it after the
    save's one-line error (issue 39)."""
    exc = record.exc_info[1] if record.exc_info and len(record.exc_info) == 3 else None
    return ("exception was never retrieved" in str(record.msg) and exc is not None and exc.__traceback__ is None
            and str(exc).split(":", 1)[0] in _STATUS_CODES)


#: absl status codes tensorstore's errors start with (``absl::StatusCode`` names).
_STATUS_CODES = ("CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
                 "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
                 "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")


_QUIET = _QuietOrbaxErrors()


def _late_callback_into_closed_loop(exc_type, exc, tb) -> bool:
    """True for the error tensorstore reports when a write it finishes after a failed save calls
    back into the asyncio loop orbax has already closed: ``RuntimeError('Event loop is closed')``
    raised by ``call_soon_threadsafe``. tensorstore reports each as unraisable (no Python caller to
    raise to; ``sys.unraisablehook`` without an object, printed as a bare traceback): 0-33 per
    failed save on a full disk, before and after the save's one-line error."""
    if exc_type is not RuntimeError or str(exc) != "Event loop is closed":
        return False
    where = os.path.join("asyncio", "base_events.py")
    return any(code.co_name == "call_soon_threadsafe" and code.co_filename.endswith(where) for code in _codes(tb))


_HOOKED = threading.Event()  # set once sys.unraisablehook is wrapped (once a process)


def _install_closed_loop_hook() -> None:
    """Wraps ``sys.unraisablehook`` once so that those late callbacks print nothing; every other
    unraisable exception reaches the previous hook unchanged."""
    import sys

    if _HOOKED.is_set():
        return
    previous = sys.unraisablehook

    def hook(unraisable):
        if not _late_callback_into_closed_loop(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback):
            previous(unraisable)

    sys.unraisablehook = hook
    _HOOKED.set()


_DRAIN_S = 2.0  # how long a failed save's writer threads get to wind down, their stderr muted


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used (damaged, missing, or its save failed); the message is one line."""


class CheckpointMismatch(CheckpointError):
    """An intact checkpoint whose arrays do not fit this run's structure (the configuration
    changed); the message lists what differs with both values."""


def _leaf_shapes(tree) -> dict[str, tuple]:
    out = {}
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = getattr(x, "shape", None)
        if shape is not None:
            out[_leaf_name(path)] = tuple(shape)
    return out


def structure_diff(saved, like, limit: int = 4) -> list[str]:
    """What differs between the saved arrays and this run's (``name: shape (saved) vs shape
    (this run)``, ``name: only in the checkpoint`` ...); empty when they fit."""
    a, b = _leaf_shapes(saved), _leaf_shapes(like)
    out = [f"{k}: {a[k]} in the checkpoint, {b[k]} in this run" for k in a if k in b and a[k] != b[k]]
    out += [f"{k}: only in the checkpoint" for k in a if k not in b]
    out += [f"{k}: only in this run" for k in b if k not in a]
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if not rel.startswith(DIGEST_FILE):
                out.append(rel)
    return sorted(out)


def _leaf_name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _gather(x):
    if jax.process_count() == 1 or getattr(x, "is_fully_replicated", False):
        return jax.device_get(x)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x, tiled=True)


@jax.jit
def _all_finite(leaves):
    return jnp.stack([jnp.isfinite(x).all() for x in leaves])


def nonfinite_leaves(tree) -> list[str]:
    """Names (``actor.opt_state.0.mu...``) of the floating-point leaves of ``tree`` that hold a
    NaN or an infinity; one jitted reduction per device set, one small transfer."""
    flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    groups: dict = {}  # one reduction per set of devices (leaves may live on different meshes)
    for i, (_, x) in enumerate(flat):
        devices = getattr(getattr(x, "sharding", None), "device_set", None)
        groups.setdefault(frozenset(devices or ()), []).append(i)
    ok = np.ones(len(flat), bool)
    for idx in groups.values():
        ok[idx] = np.asarray(_gather(_all_finite([flat[i][1] for i in idx])))
    return [_leaf_name(p) for (p, _), good in zip(flat, ok) if not good]


class Checkpointer:
    """Verified, asynchronous checkpoints over ``ocp.CheckpointManager`` with rljax's two
    items: ``state`` (a pytree of arrays) and ``meta`` (JSON).

    Args:
      directory: the checkpoint directory (``<run_dir>/checkpoints``).
      max_to_keep: checkpoints kept (None: all); the newest verified one is never deleted.
      async_save: write arrays in the background.
      echo: where the one-line notices go (cleaned directories, unverified restores).
      primary: whether this process writes digests and deletes (default: process 0).
    """

    def __init__(self, directory: str, *, max_to_keep: Optional[int] = 3, async_save: bool = True,
                 echo: Callable[[str], None] = print, primary: Optional[bool] = None):
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        self.echo = echo
        self.primary = jax.process_index() == 0 if primary is None else primary
        if self.primary and os.path.isdir(self.directory):
            self._clean()
        _no_replica_parallel_saves_on_cpu()
        for name in ("absl", "asyncio"):  # save failures are one CheckpointError line, no tracebacks
            logging.getLogger(name).addFilter(_QUIET)
        _install_closed_loop_hook()
        options = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=async_save, create=True)
        # the items' handlers named up front: a fresh process (a resume) reads a checkpoint's metadata
        # and meta alone without orbax warning twice that "state" "could not be restored", and the
        # shape check before a restore sees the saved shapes (it got None there, and checked nothing)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
        self._verifier: Optional[threading.Thread] = None
        self._pending: Optional[int] = None
        self._failure: Optional[BaseException] = None
        self._muted: Optional[int] = None  # the stderr descriptor, saved while a failed save winds down

    # ------------------------------------------------------------------ directory hygiene

    def _clean(self) -> None:
        for name in sorted(os.listdir(self.directory)):
            path = os.path.join(self.directory, name)
            if _ORBAX_TMP in name:
                why = "an unfinished save (the run stopped while writing it)"
            elif name.endswith(_DELETING):
                why = "a half-deleted old checkpoint"
            else:
                continue
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.remove(path)
            self.echo(f"checkpoint: removed {name} in {self.directory}: {why}")

    def _delete(self, step: int) -> None:
        src = self.step_dir(step)
        dst = src + _DELETING
        os.replace(src, dst)  # atomic: from here on no directory named like a checkpoint is half-deleted
        shutil.rmtree(dst, ignore_errors=True)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start saving ``state`` and ``meta`` as checkpoint ``step``; its digest is written in
        the background once orbax has committed it."""
        self._join()
        nonfinite = nonfinite_leaves(state)
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)))
        self._pending = step
        self._verifier = threading.Thread(target=self._after_commit, args=(step, nonfinite),
                                          name=f"rljax-checkpoint-{step}", daemon=True)
        self._verifier.start()

    def _after_commit(self, step: int, nonfinite: list[str]) -> None:
        try:
            self._manager.wait_until_finished()
            if not self.primary:
                return
            self._write_digest(step, nonfinite)
            if nonfinite:
                self.echo(f"checkpoint: checkpoint {step} holds non-finite values ({', '.join(nonfinite[:3])}"
                          f"{', ...' if len(nonfinite) > 3 else ''}); it is kept but never counted as verified")
            self._keep_n()
        except BaseException as e:  # noqa: BLE001 - reported by the next save() / wait()
            self._mute_stderr()
            self._failure = e

    def _write_digest(self, step: int, nonfinite: list[str]) -> None:
        step_dir = self.step_dir(step)
        files = {rel: [os.path.getsize(os.path.join(step_dir, rel)), _sha256(os.path.join(step_dir, rel))]
                 for rel in _files(step_dir)}
        record = {"step": step, "algorithm": "sha256", "files": files, "finite": not nonfinite,
                  "nonfinite": nonfinite, "time": time.time()}
        tmp = os.path.join(step_dir, DIGEST_FILE + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(record, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(step_dir, DIGEST_FILE))

    def _keep_n(self) -> None:
        if self.max_to_keep is None:
            return
        steps = self.all_steps()
        keep = set(steps[-self.max_to_keep:])
        verified = [s for s in steps if self._digest_status(s)[0] == "verified-fast"]
        if verified:
            keep.add(verified[-1])
        gone = [s for s in steps if s not in keep]
        for s in gone:
            self._delete(s)
        if gone:
            self._manager.reload()

    def _join(self, timeout: Optional[float] = None) -> bool:
        if self._verifier is not None:
            self._verifier.join(timeout)
            if self._verifier.is_alive():
                return False
            self._verifier = None
        if self._failure is not None:
            e, self._failure = self._failure, None
            self._unmute_stderr(drain_s=_DRAIN_S)
            raise CheckpointError(f"saving checkpoint {self._pending} in {self.directory} failed: {_why(e)}") from e
        return True

    def _mute_stderr(self) -> None:
        """A failed save: orbax's writer threads are still finishing (failing) their writes, and
        tensorstore prints an "Event loop is closed" traceback to the stderr descriptor for each
        (dozens, from C, past any Python hook). The descriptor goes to /dev/null until the failure
        is reported in one line."""
        if self._muted is None:
            try:
                self._muted = os.dup(2)
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, 2)
                os.close(devnull)
            except OSError:
                self._muted = None

    def _unmute_stderr(self, drain_s: float = 0.0) -> None:
        if self._muted is not None:
            time.sleep(drain_s)  # the remaining writes fail within moments on a full or read-only disk
            os.dup2(self._muted, 2)
            os.close(self._muted)
            self._muted = None

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the pending save is committed and its digest written. Returns False when
        ``timeout`` seconds passed first; raises :class:`CheckpointError` if the save failed."""
        return self._join(timeout)

    @property
    def pending(self) -> Optional[int]:
        """The step whose save is still in flight, or None."""
        return self._pending if self._verifier is not None and self._verifier.is_alive() else None

    def close(self, timeout: Optional[float] = None) -> bool:
        """Waits (at most ``timeout`` seconds) for the pending save, then closes; False if it gave up."""
        done = self._join(timeout)
        if done:
            self._manager.close()
        return done

    # ------------------------------------------------------------------ inspect

    def all_steps(self) -> list[int]:
        """Committed checkpoints, oldest first (read from the directory)."""
        return committed_checkpoints(self.directory)

    def latest_step(self) -> Optional[int]:
        """The newest committed checkpoint (verified or not), or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _digest_status(self, step: int, *, full: bool = False) -> tuple[str, str]:
        """``("verified" | "verified-fast" | "unverified" | "damaged", reason)``; ``full`` hashes every file."""
        step_dir = self.step_dir(step)
        path = os.path.join(step_dir, DIGEST_FILE)
        if not os.path.exists(path):
            return "unverified", "has no digest (the run stopped before verifying it, or it predates verification)"
        try:
            with open(path) as fh:
                record = json.load(fh)
            files = {rel: (int(size), str(digest)) for rel, (size, digest) in record["files"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return "damaged", f"its digest file {DIGEST_FILE} is unreadable ({type(e).__name__})"
        if not record.get("finite", True):
            bad = record.get("nonfinite") or []
            return "damaged", f"it was saved with non-finite values in {', '.join(bad[:3]) or 'some arrays'}"
        for rel, (size, digest) in files.items():
            f = os.path.join(step_dir, rel)
            if not os.path.isfile(f):
                return "damaged", f"file {rel} is missing"
            if full:
                got = os.path.getsize(f)
                if got != size:
                    return "damaged", f"file {rel} has {got} bytes, {size} were written"
                if _sha256(f) != digest:
                    return "damaged", f"file {rel} does not match its SHA-256 digest (its bytes changed after the save)"
        return ("verified" if full else "verified-fast"), ""

    def verify(self, step: int) -> tuple[str, str]:
        """``(status, reason)`` of checkpoint ``step`` from its files: ``verified``,
        ``unverified`` (no digest) or ``damaged`` (the reason says why)."""
        if not os.path.isdir(self.step_dir(step)):
            return "damaged", "it does not exist"
        return self._digest_status(step, full=True)

    def newest_intact(self, before: Optional[int] = None) -> Optional[int]:
        """The newest verified checkpoint (older than ``before`` when given); hashes each candidate."""
        for s in reversed(self.all_steps()):
            if (before is None or s < before) and self.verify(s)[0] == "verified":
                return s
        return None

    def _damaged(self, step: int, reason: str, what: str = "is damaged") -> CheckpointError:
        intact = self.newest_intact(before=step)
        hint = (f"the newest intact checkpoint is {intact}: resume from it with --resume={intact} "
                f"(or trainer.resume_from={intact})" if intact is not None else "no older intact checkpoint remains")
        return CheckpointError(f"checkpoint {step} in {self.directory} {what}: {reason}; {hint}")

    def _structure_diff(self, step: int, like: Any) -> list[str]:
        """:func:`structure_diff` against checkpoint ``step``'s recorded array metadata (empty
        when the metadata is unreadable: that is damage, not a mismatch)."""
        try:
            saved = self._manager.item_metadata(step)["state"]
            saved = getattr(saved, "tree", saved)
        except Exception:  # noqa: BLE001 - unreadable metadata: reported as damage by the caller
            return []
        return structure_diff(saved, like) if saved else []

    def _mismatch(self, step: int, diff: list[str]) -> CheckpointMismatch:
        return CheckpointMismatch(f"checkpoint {step} in {self.directory} is intact but does not fit this run "
                                  f"(the configuration changed): {'; '.join(diff)}")

    # ------------------------------------------------------------------ restore

    def select(self, resume_from: Optional[int] = None, *, past_undigested: bool = False) -> Optional[int]:
        """The checkpoint a resume restores: ``resume_from`` when given (it must exist), else
        the newest committed one; None when there is none.

        ``past_undigested`` (a plain ``--resume``): newer checkpoints that merely lack a digest
        (a kill between a commit and its digest: a preempted job's automatic restart) are passed
        over, with one line, for the newest one that has a digest; :meth:`restore` still
        verifies that one. A checkpoint with a digest is never passed over, so a damaged one is
        reported, not skipped; when none has a digest the newest is chosen (and refused)."""
        if resume_from is None:
            step, newer = resume_checkpoint(self.directory, past_undigested=past_undigested)
            if newer:  # no digest, or a step's record cut short (it runs again)
                self.echo(passed_over_line(self.directory, step, newer))
            return step
        steps = self.all_steps()
        if resume_from not in steps:
            raise CheckpointError(f"trainer.resume_from={resume_from}: no checkpoint {resume_from} in "
                                  f"{self.directory}; available: {', '.join(map(str, steps)) or 'none'}")
        return resume_from

    def discard_newer(self, step: int) -> list[int]:
        """Moves the checkpoints newer than ``step`` to ``<directory>.discarded/`` (a run resumed
        from ``step`` saves those steps again); returns their steps."""
        newer = [s for s in self.all_steps() if s > step]
        if not newer:
            return newer
        if self.primary:
            dest = f"{self.directory}.{_DISCARDED}"
            os.makedirs(dest, exist_ok=True)
            for s in newer:
                os.replace(self.step_dir(s), os.path.join(dest, f"{s}-{int(time.time())}"))
            self.echo(f"checkpoint: resuming from {step}; moved newer checkpoint(s) {', '.join(map(str, newer))} "
                      f"to {dest}")
        self._manager.reload()  # orbax skips a save of a step <= the newest it knows of
        return newer

    def read_meta(self, step: int) -> dict:
        """The JSON ``meta`` of checkpoint ``step`` alone (no arrays read): what a resume checks
        before restoring arrays into this run's structure."""
        out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def restore(self, step: int, like: Any, *, allow_unverified: bool = False) -> tuple[Any, dict]:
        """Restore checkpoint ``step`` into the structure, dtypes and shardings of ``like``
        after verifying its digest, then check that every restored value is finite.

        Args:
          allow_unverified: restore a checkpoint that has no digest (``--resume-unverified``);
            otherwise it is refused like a damaged one.

        Raises:
          CheckpointMismatch: the checkpoint is intact but its arrays do not fit ``like``.
          CheckpointError: the checkpoint is damaged or unverified (names it, why, and the
            newest intact one).
        """
        self._join()  # a save this checkpointer started finishes (digest written) before any restore
        status, reason = self.verify(step)
        if status == "damaged":
            raise self._damaged(step, reason)
        if status == "unverified":
            if not allow_unverified:
                raise self._damaged(step, f"it {reason}, so its bytes cannot be checked (pass --resume-unverified "
                                          "to restore it anyway, its values still checked to be finite)",
                                    what="is unverified")
            self.echo(f"checkpoint: checkpoint {step} {reason}; restoring it unverified (--resume-unverified; "
                      "its values are still checked to be finite)")
        # An array whose saved shape differs from this run's is refused from the checkpoint's metadata,
        # before orbax starts a read: a read failing mid-restore left the other arrays' reads suspended
        # (coroutines collected later as "Exception ignored in ... _read_array_index_and_device_put").
        diff = self._structure_diff(step, like)
        if any(" in the checkpoint, " in d for d in diff):
            raise self._mismatch(step, diff)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                      meta=ocp.args.JsonRestore()))
        except Exception as e:  # noqa: BLE001 - orbax/tensorstore raise many types for unreadable files
            diff = self._structure_diff(step, like)
            if diff:
                raise self._mismatch(step, diff) from e
            first = " ".join(str(e).split())[:200]
            raise self._damaged(step, f"orbax cannot read it ({type(e).__name__}: {first})") from e
        bad = nonfinite_leaves(out["state"])
        if bad:
            raise self._damaged(step, f"restored non-finite values in {', '.join(bad[:3])}"
                                      f"{', ...' if len(bad) > 3 else ''}")
        return out["state"], dict(out["meta"])
