"""Which schema keys the code reads: ``record_reads()`` (test-only; the package keeps no recorder).

Inside ``with record_reads() as reads:`` the configs that :func:`rljax.config.resolve` and
:func:`rljax.config.load_resolved` build are instances of recording subclasses of the schema's
dataclasses (installed with :func:`rljax.config.set_section_class`), equal in value; ``reads``
fills with the dotted keys that rljax code reads. Used by ``tests/config/test_config_honest.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from functools import lru_cache
from pathlib import Path

import rljax
from rljax.config import apply_model_overrides, derive, field_specs, set_section_class

_RLJAX_DIR = str(Path(rljax.__file__).resolve().parent) + os.sep
_CONFIG_DIR = _RLJAX_DIR + "config" + os.sep
_TRACE_DIR = _RLJAX_DIR + "trace" + os.sep
_TRAINER_CHECK = _RLJAX_DIR + "trainer" + os.sep + "_check.py"
_reads: set | None = None


@lru_cache(maxsize=None)
def _consumer_codes() -> frozenset:
    """The helpers in ``rljax/config`` that compute what a run uses (derived sizes, the model's
    shape): their reads count when the run calls them, not when validation does."""
    return frozenset({derive.__code__, apply_model_overrides.__code__})


@lru_cache(maxsize=None)
def _observer_setup_codes() -> frozenset:
    """The functions in ``rljax/trace`` that act on a key rather than record it: the run's
    experiment-logger set-up starts the loggers ``trainer.logger`` names (TensorBoard, wandb,
    mlflow) under ``trainer.project_name`` / ``experiment_name``. The tracer and the trace
    checks, which read keys to record or check them, stay excluded."""
    from rljax.trace.loggers import open_run_logs

    return frozenset({open_run_logs.__code__})


def _in_preflight(frame) -> bool:
    """The read happens in the trainer's preflight check (``rljax.trainer.check``: the model
    files, tokenizer, tp and loggers), which reads keys to check them, not to use them (as the
    config package's own checks before it). The other packages' ``check(cfg)`` reads count, as
    they did when the config package called them."""
    return frame.f_code.co_filename == _TRAINER_CHECK


def _counts_as_read(key: str, frame) -> bool:
    """``frame`` read ``key``. Reads in ``rljax/config`` count only when the run's code called a
    consumer helper directly (validation calling it does not count); reads elsewhere count
    when the code is in ``rljax/``."""
    entry = None  # the rljax/config function the code outside rljax/config called
    while frame is not None and frame.f_code.co_filename.startswith(_CONFIG_DIR):
        entry = frame.f_code
        frame = frame.f_back
    if frame is None or (entry is not None and entry not in _consumer_codes()):
        return False  # validation, checks and serialisation read every key and do nothing with it
    filename = frame.f_code.co_filename
    if not filename.startswith(_RLJAX_DIR):
        return False  # tests, dataclasses' generated methods
    if _in_preflight(frame):
        return False  # the trainer's input checks read every key they check
    if not filename.startswith(_TRACE_DIR) or key.startswith("trace."):
        return True
    return frame.f_code in _observer_setup_codes()  # observers only read trace.*, except to set themselves up


@lru_cache(maxsize=None)
def _recording_class(cls, prefix: str):
    names = frozenset(f.name for f in dataclasses.fields(cls))

    def __getattribute__(self, name):
        if _reads is not None and name in names:
            key = prefix + name
            if key in field_specs() and _counts_as_read(key, sys._getframe(1)):
                _reads.add(key)
        return object.__getattribute__(self, name)

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__, "__qualname__": cls.__qualname__,
                                       "__module__": cls.__module__})


@contextlib.contextmanager
def record_reads():
    """Records which fields rljax code reads from configs resolved inside the block.

    Yields a set that fills with the dotted keys read, from the configs that :func:`resolve`
    and :func:`load_resolved` build while the block runs (they are instances of recording
    subclasses of the schema's dataclasses, equal in value). A read counts when code in
    ``rljax/`` reads the attribute directly, except code in ``rljax/config`` (validation,
    checks and serialisation read every key and do nothing with it) and observers in
    ``rljax/trace`` (which count only for ``trace.*``, except the experiment loggers' set-up,
    which starts the loggers ``trainer.logger`` names). Used by the test that every schema
    key is read by the code that runs.
    """
    global _reads
    outer, _reads = _reads, set()
    previous = set_section_class(_recording_class)
    try:
        yield _reads
    finally:
        set_section_class(previous)
        inner, _reads = _reads, outer
        if outer is not None:
            outer.update(inner)
