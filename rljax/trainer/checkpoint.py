"""Orbax checkpoints of the whole run state: params, optimizer state, step counters, RNG,
data-iterator position, weight version and the resolved config.

Saves are asynchronous (the step loop continues while arrays are written) and atomic:
orbax writes into a temporary directory and renames it when complete, so a run killed
during a save resumes from the last *complete* checkpoint. The last ``max_to_keep`` are kept.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


class Checkpointer:
    """Thin wrapper over ``ocp.CheckpointManager`` with rljax's two items: ``state`` and ``meta``."""

    def __init__(self, directory: str, *, max_to_keep: int = 3, async_save: bool = True):
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                               create=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start saving ``state`` (a pytree of arrays) and ``meta`` (JSON) as checkpoint ``step``."""
        self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                         meta=ocp.args.JsonSave(meta)))

    def latest_step(self) -> Optional[int]:
        """The newest complete checkpoint, or None."""
        return self._manager.latest_step()

    def restore(self, step: int, like: Any) -> tuple[Any, dict]:
        """Restore checkpoint ``step`` into the structure, dtypes and shardings of ``like``."""
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                  meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def wait(self) -> None:
        """Block until the pending asynchronous save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
