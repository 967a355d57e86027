"""Host copies of the step's learner arrays, made in a background thread while the step's later
stages run (issue 35 item 6: the trace's time on the step's critical path).

On one process whose devices are CPUs (:func:`rljax.trace.invariants.host_memory`) the
whole-batch invariants reduce one host copy of their inputs, and the traced groups' summaries read
the same copies. Made at the step's end, those copies (~10 arrays, each assembled from its 8
simulated devices' shards) cost the trainer's thread ~1 ms a step. The tracer hands each stage's
written batch arrays to a :class:`Prefetch` instead, as the stage's event arrives: the thread
copies them (``np.asarray``, which keeps the copy on the array: ``jax.Array._npy_value``) while
the later stages run (the update's XLA work releases the GIL), and the step's end finds them
made. Nothing is computed differently: the copy the array keeps is the one the step's end would
have made.

How it copies (:func:`host_copy`): each distinct shard once, straight into one host array, which
the jax array then keeps as its host value. ``np.asarray`` of a sharded array does the same
through per-shard asynchronous-transfer requests that a CPU device does not need: on the
default run's arrays (8 shards, 512 rows) it took ~2x the CPU, and the thread's ~13 copies a
step are the trace's largest background cost (``trace/background_s``).

What is not kept: the thread drops every reference to the arrays once copied, and the tracer
waits for it (:meth:`Prefetch.wait`) at the step's end, before the runner looks for batch arrays
still alive after the step (a queued array would read as a leak otherwise). A copy that fails (an
array deleted meanwhile) is skipped: the step's end copies the array itself, as before.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np

from rljax.trace.background import Background
from rljax.trace.fields import shard_index


class Prefetch(Background):
    """Copies arrays to the host in a background thread (see the module docstring)."""

    name = "rljax-trace-prefetch"

    def put(self, arrays: Sequence) -> None:
        """Queues ``arrays`` (``jax.Array``) to be copied to the host."""
        if arrays:
            self._put(list(arrays))

    @staticmethod
    def handle(arrays: list) -> None:
        while arrays:  # each array dropped once copied
            x = arrays.pop(0)
            try:
                host_copy(x)  # the copy stays on the array (jax.Array._npy_value)
            except Exception:  # noqa: BLE001 -- deleted or not addressable: the step's end copies it itself
                pass
            del x


def host_copy(x) -> np.ndarray:
    """``np.asarray(x)`` for a ``jax.Array`` on one process's CPU devices, kept on ``x`` as
    ``np.asarray`` keeps it (``_npy_value``, read-only): every later host read of ``x`` takes it.
    Each distinct shard is copied once into its place (:func:`rljax.trace.fields.shard_index`,
    cached per sharding and shape). Anything else (a host array, an array already copied, a
    one-device array, jax without ``_npy_value``) goes to ``np.asarray``."""
    if getattr(x, "_npy_value", 0) is not None or not isinstance(x, jax.Array) or x.is_fully_replicated \
            or not x.is_fully_addressable:
        return np.asarray(x)
    out = np.empty(x.shape, x.dtype)
    for pos, index in shard_index(x):
        out[index] = np.asarray(x.addressable_data(pos))
    out.flags.writeable = False
    x._npy_value = out
    return out
