"""Host <-> device transfer of batch pytrees, single- and multi-process.

:func:`to_host` brings device arrays back as NumPy (all-gathered across processes when the
arrays span several; :func:`host_array` one array, gathered only when not fully addressable); :func:`place_batch` lays host NumPy batch fields out as global arrays
with the batch specs (``dp`` x ``fsdp`` on rows, ``sp`` on the sequence) from values every process
holds in full.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from rljax.sharding.specs import batch_shardings


def to_host(tree):
    """Device arrays -> NumPy, also for arrays spread over several processes (multi-host)."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def host_array(x) -> np.ndarray:
    """One array as NumPy on this process: all-gathered when other processes hold some of its
    shards (not fully addressable), else fetched."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def place_batch(host: Mapping[str, np.ndarray], mesh) -> dict:
    """Host NumPy batch fields -> global arrays laid out with the batch specs (``dp`` x ``fsdp`` on rows,
    ``sp`` on the sequence), from values every process holds in full (each fills in the shards
    it owns). Fields of the rollout, which each process generates only its share of, go through
    :func:`rljax.trainer.distribute.assemble`."""
    shardings = batch_shardings(host, mesh)
    return {k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx]) for k, v in host.items()}
