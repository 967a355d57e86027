"""A reward worker process: ``python -m rljax.reward._worker IN_FD OUT_FD SPEC DATASET PARENT MEMORY_MB``.

Started by :class:`rljax.reward.RewardPool` (never by hand). It loads the reward function
once (``reward.function``), then answers ``(task_id, response, answer, extra)`` messages on
``IN_FD`` with ``(task_id, (score, extra), None)`` or ``(task_id, None, "<Type>: <message>")`` on
``OUT_FD``. Anything the reward raises, ``SystemExit`` and ``KeyboardInterrupt`` included,
is an error of that sample; a crash, ``os._exit`` or a hang ends or stalls this process,
and the pool counts the sample and starts a replacement.

Imports only the standard library and :mod:`rljax.reward` (NumPy, PyYAML): never JAX or
TensorFlow, so a worker starts in a fraction of a second.
"""

from __future__ import annotations

import os
import signal
import sys

from rljax.reward._batch import _short, as_result
from rljax.reward._plugin import get_reward_fn


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this worker when the trainer dies (even by SIGKILL), so a hung reward
    never outlives the run."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _limit_memory(memory_mb: int) -> None:
    """``reward.memory_mb``: the data-segment limit (heap and private mappings, Linux >= 4.7) of this
    worker, set before the plugin loads; not the address space, which a plugin importing a large
    library (torch) reserves by gigabytes without using it."""
    if memory_mb > 0:
        import resource

        limit = memory_mb << 20
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        resource.setrlimit(resource.RLIMIT_DATA, (limit if hard < 0 else min(limit, hard), hard))


def main(argv: list[str]) -> int:
    in_fd, out_fd, spec, dataset, parent = int(argv[0]), int(argv[1]), argv[2], argv[3] or None, int(argv[4])
    memory_mb = int(argv[5]) if len(argv) > 5 else 0
    _die_with_parent(parent)
    _limit_memory(memory_mb)
    # The terminal's Ctrl-C and the scheduler's SIGTERM to the job's processes are the trainer's
    # to handle: it finishes the step (these workers score it whole), saves, and closes the pool.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    from multiprocessing.connection import Connection

    inbox, outbox = Connection(in_fd, writable=False), Connection(out_fd, readable=False)
    try:
        fn = get_reward_fn(spec, dataset=dataset)
    except BaseException as e:  # noqa: BLE001 - reported to the pool, which stops the run
        outbox.send(("init", None, f"{type(e).__name__}: {e}"))
        return 1
    outbox.send(("init", True, None))
    while True:
        try:
            msg = inbox.recv()
        except (EOFError, OSError):
            return 0
        if msg is None:
            return 0
        task, response, answer, extra = msg
        try:
            result = (task, as_result(fn(response, answer, **extra)), None)
        except MemoryError:  # over reward.memory_mb: this sample fails, a fresh worker replaces this one
            outbox.send((task, None, f"MemoryError: over reward.memory_mb={memory_mb} MB", "retire"))
            return 3
        except BaseException as e:  # noqa: BLE001 - a user reward may raise anything, sys.exit included
            result = (task, None, f"{type(e).__name__}: {_short(e)}")
        outbox.send(result)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
