"""Deterministic, resumable batch iteration: the order of epoch ``e`` is a function of ``(seed, e)``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rljax.data._prng import permutation


class PromptIterator:
    """Batches of items of ``source``, shuffled per epoch, resumable from a small state dict.

    Epoch ``e`` visits ``source`` in the order :func:`permutation(len(source), seed, e)`
    (or in order when ``shuffle=False``). With ``drop_last=True`` (training) every batch has
    exactly ``batch_size`` items and the tail of each epoch that does not fill a batch is
    skipped (it comes first in some later epoch's order); with ``drop_last=False`` the last
    batch of an epoch is shorter.

    The state is ``{"epoch", "position", "seed", "num_examples"}``: ``position`` is the
    number of items of epoch ``epoch`` already handed out. Saving :meth:`state` after a
    batch and building a new iterator with ``state=`` yields exactly the same subsequent
    batches. The order is computed by a splitmix64 hash, not by NumPy's generators, so it
    survives library upgrades.

    Args:
      source: a sequence (``__len__``/``__getitem__``), e.g. :class:`PreparedPrompts`.
      batch_size: items per batch (``data.train_batch_size`` prompts).
      seed: ``data.seed`` or ``trainer.seed``.
      shuffle: ``data.shuffle``.
      drop_last: see above.
      num_epochs: stop after this many epochs (None: never stop).
      state: a saved :meth:`state` to resume from.
    """

    def __init__(
        self,
        source: Sequence,
        batch_size: int,
        *,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = True,
        num_epochs: int | None = None,
        state: Mapping[str, Any] | None = None,
    ):
        n = len(source)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        if n == 0:
            raise ValueError("cannot iterate an empty dataset (were all prompts filtered?)")
        if drop_last and batch_size > n:
            raise ValueError(
                f"batch_size={batch_size} is larger than the dataset ({n} examples); "
                "lower data.train_batch_size or use more data"
            )
        self._source = source
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.num_epochs = num_epochs
        self._n = n
        self._epoch = 0
        self._position = 0
        self._order_epoch = None
        self._order = None
        if state is not None:
            self.restore(state)

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, int]:
        """The resume point: a small JSON-serialisable dict to save in a checkpoint."""
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed, "num_examples": self._n}

    def restore(self, state: Mapping[str, Any]) -> None:
        """Continues from a saved :meth:`state`; refuses one saved for another seed or dataset size."""
        for k in ("epoch", "position"):
            if k not in state:
                raise ValueError(f"data iterator state lacks {k!r}: {dict(state)}")
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(f"data iterator state was saved with seed={state['seed']}, this iterator has seed={self.seed}")
        if "num_examples" in state and int(state["num_examples"]) != self._n:
            raise ValueError(
                f"data iterator state was saved for {state['num_examples']} examples, the dataset now has {self._n}; "
                "the data (or its filtering) changed since the checkpoint"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self._n:
            raise ValueError(f"data iterator state {dict(state)} is out of range for {self._n} examples")
        self._epoch, self._position = epoch, position

    @property
    def source(self) -> Sequence:
        return self._source

    @property
    def epoch(self) -> int:
        return self._epoch

    # ------------------------------------------------------------------ order

    def order(self, epoch: int) -> np.ndarray:
        """Positions of ``source`` in the order of ``epoch``."""
        if self._order_epoch != epoch:
            self._order = permutation(self._n, self.seed, epoch) if self.shuffle else np.arange(self._n, dtype=np.int64)
            self._order_epoch = epoch
        return self._order

    def next_positions(self) -> np.ndarray:
        """Positions of the next batch (advances the state); raises StopIteration after ``num_epochs``."""
        end = self._position + self.batch_size
        if end > self._n and (self.drop_last or self._position >= self._n):
            self._epoch, self._position = self._epoch + 1, 0
            end = self.batch_size
        if self.num_epochs is not None and self._epoch >= self.num_epochs:
            raise StopIteration
        start = self._position
        end = min(end, self._n)
        self._position = end
        return self.order(self._epoch)[start:end].copy()

    def __iter__(self):
        return self

    def __next__(self) -> list:
        return [self._source[int(i)] for i in self.next_positions()]
