"""Summaries of one field for the trace: shape, dtype, sharding, per-row valid lengths, mask sums.

Summaries only, never values of tokens: a field summary carries the field's global shape
and dtype, its layout (host NumPy, or the ``PartitionSpec`` over the mesh axes with the
local shard shape and the devices holding the traced rows), and for the traced rows their
valid lengths, mask sums and padding flags. Reading the traced rows of a device array
copies only the shards that hold them (no extra computation is dispatched).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Optional, Sequence

import jax
import numpy as np

from rljax.trace.batch_fields import names


# How a summary reads a field: the columns of the one table of batch fields (rljax.trace.batch_fields).
#: ``[B, T]`` fields (response positions): their trailing dim is the response length.
RESPONSE_FIELDS = names(valid="response")
#: ``[B, S+T]`` fields of the learner layout.
SEQUENCE_FIELDS = names(valid="sequence")
#: ``[B, S]`` fields: the prompt, left-padded.
PROMPT_FIELDS = names(valid="prompt")
#: Masks: their own mask sums are reported.
MASK_FIELDS = names(mask=True)
#: Fields whose traced rows' values are summarised (row means under the mask).
VALUE_FIELDS = names(values=True)


def _is_device_array(x) -> bool:
    return isinstance(x, jax.Array)


@functools.lru_cache(maxsize=256)
def _layout(sharding, shape: tuple) -> dict:
    """Layout of a device array of ``shape`` (cached: shardings and shapes repeat every step)."""
    out: dict[str, Any] = {"placement": "device"}
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if spec is not None:
        out["spec"] = [None if a is None else (list(a) if isinstance(a, tuple) else a) for a in spec]
    if mesh is not None:
        out["mesh_axes"] = {str(k): int(v) for k, v in dict(mesh.shape).items()}
    out["local_shape"] = [int(d) for d in sharding.shard_shape(shape)]
    out["num_devices"] = len(sharding.device_set)
    rows: dict[int, tuple[int, int]] = {}
    if shape:
        for dev, idx in sharding.devices_indices_map(shape).items():
            r = idx[0]
            rows[int(dev.id)] = (r.start or 0, shape[0] if r.stop is None else r.stop)
    return {"layout": out, "rows": rows}


def layout(x) -> dict:
    """``{"placement": "host"}`` for NumPy, else spec / mesh axes / local shard shape / device count."""
    if not _is_device_array(x):
        return {"placement": "host"}
    return dict(_layout(x.sharding, tuple(x.shape))["layout"])


_SHARD_INDEX: dict = {}  # (sharding, shape) -> ((position among the addressable shards, index), ...)


def shard_index(x) -> tuple:
    """Each distinct addressable shard of ``x`` once: its position (``x.addressable_data(pos)``)
    and its index (cached: shardings and shapes repeat every step)."""
    key = (x.sharding, tuple(x.shape))
    found = _SHARD_INDEX.get(key)
    if found is None:
        seen, out = set(), []
        for pos, shard in enumerate(x.addressable_shards):
            k = tuple((s.start, s.stop) for s in shard.index)
            if k not in seen:
                seen.add(k)
                out.append((pos, shard.index))
        if len(_SHARD_INDEX) > 256:
            _SHARD_INDEX.clear()
        found = _SHARD_INDEX[key] = tuple(out)
    return found


def host_rows(x, rows: np.ndarray) -> Optional[np.ndarray]:
    """``x[rows]`` as NumPy, copying only the addressable shards that hold those rows.

    ``None`` when some of the rows live only on other processes' devices.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if not _is_device_array(x):
        return np.asarray(x)[rows]
    held = getattr(x, "_npy_value", None)  # a host copy the array already holds (e.g. the invariants' inputs on CPU)
    if held is not None:
        return np.asarray(held)[rows]
    out = np.zeros((len(rows),) + tuple(x.shape[1:]), dtype=x.dtype)
    filled = np.zeros(out.shape, dtype=bool)
    for pos, idx in shard_index(x):
        r = idx[0]
        start, stop = r.start or 0, x.shape[0] if r.stop is None else r.stop
        sel = (rows >= start) & (rows < stop)
        if not sel.any():
            continue
        local = np.asarray(x.addressable_data(pos))[rows[sel] - start]
        rest = (slice(None),) + tuple(idx[1:])
        block, done = out[sel], filled[sel]
        block[rest], done[rest] = local, True
        out[sel], filled[sel] = block, done
    return out if filled.all() else None


class FieldRead(NamedTuple):
    """What a field's summary needs of the array, read on the trainer's thread (no reference to the
    array kept: the rest of the summary is made later, e.g. by the trace's writer thread)."""

    shape: tuple
    dtype: Any
    sharding: Any  # None: a host (NumPy) array
    values: Optional[np.ndarray]  # the traced rows' values, when asked for and readable


def read(x, rows, *, values: bool = False) -> FieldRead:
    """The shape, dtype, sharding and (``values``) traced rows of ``x`` (:func:`host_rows`)."""
    device = _is_device_array(x)
    return FieldRead(tuple(map(int, x.shape)), x.dtype, x.sharding if device else None,
                     host_rows(x, rows) if values else None)


def summarize(name: str, x, *, producer: str, consumers: Sequence[str], rows: np.ndarray, valid_length=None,
              mask_rows=None, is_padding=None, values: bool = False) -> dict:
    """One field of a trace record.

    Args:
      name: field name (the batch key).
      x: the array (NumPy on the host, or a ``jax.Array``).
      producer: the stage that wrote it (as the runner observed it).
      consumers: the stages that read it during the step (as the runner observed them).
      rows: the traced rows (trajectory indices of the group).
      valid_length: ``[B]`` valid lengths (e.g. ``response_length``); the traced rows' are kept.
      mask_rows: ``[len(rows), T]`` mask governing the field on the traced rows (the learner's
        ``loss_mask`` for log-probs / advantages, the field itself for masks); its per-row
        sums are ``mask_sum``.
      is_padding: host ``[B]`` padding flags.
      values: also summarise the traced rows' values (per-row masked mean; reads only the
        shards holding them).
    """
    rows = np.asarray(rows)
    return summary_of(name, read(x, rows, values=values), producer=producer, consumers=consumers, rows=rows,
                      valid_length=None if valid_length is None else np.asarray(valid_length)[rows],
                      mask_rows=mask_rows, is_padding=None if is_padding is None else np.asarray(is_padding)[rows])


def summary_of(name: str, r: FieldRead, *, producer: str, consumers: Sequence[str], rows: np.ndarray,
               valid_length=None, mask_rows=None, is_padding=None, memo: Optional[dict] = None) -> dict:
    """:func:`summarize` from what :func:`read` read; ``valid_length`` and ``is_padding`` are the
    traced rows' already (``[len(rows)]``). ``memo``: a dict shared by the summaries of one group's
    fields that read the same ``rows``, ``valid_length``, ``is_padding`` or ``mask_rows`` objects
    (each fact derived from them is made once; every summary gets its own lists)."""
    memo = {} if memo is None else memo
    out: dict[str, Any] = {"name": name, "producer": producer, "consumers": list(consumers), "shape": list(r.shape),
                           "dtype": _dtype_name(r.dtype)}
    if r.sharding is None:
        out["sharding"] = {"placement": "host"}
    else:
        span = _memo(memo, rows, _span) if len(rows) else None
        sharding = out["sharding"] = dict(_sharding(r.sharding, r.shape, span))
        if span is not None:
            sharding["owner_devices"] = list(sharding["owner_devices"])
    if valid_length is not None:
        out["valid_length"] = list(_memo(memo, valid_length, _int_list))
    m_rows = None
    if mask_rows is not None:
        m_rows, sums = _memo(memo, mask_rows, lambda m: _mask_rows(m, len(rows)))
        out["mask_sum"] = list(sums)
    if is_padding is not None:
        out["is_padding"] = list(_memo(memo, is_padding, _bool_list))
    v = r.values
    if v is not None:
        v = v.astype(np.float64)
        if v.ndim == 1:
            out["row_value"] = [round(a, 6) for a in v.tolist()]
        else:
            m = np.ones(v.shape, bool)
            if m_rows is not None:  # the learner layout may be wider (sp rounding): pad with zeros
                m = np.zeros(v.shape, bool)
                w = min(m_rows.shape[1], v.shape[1])
                m[:, :w] = m_rows[:, :w]
            cnt = np.maximum(m.sum(axis=1), 1)
            out["row_mean"] = [round(a, 6) for a in ((v * m).sum(axis=1) / cnt).tolist()]
            out["outside_mask_abs_sum"] = round(float(np.abs(v * ~m).sum()), 6)
    return out


def _memo(memo: dict, x, make):
    """``make(x)``, once per object ``x`` in ``memo`` (which holds ``x``: its id stays its own)."""
    hit = memo.get(id(x))
    if hit is None:
        hit = memo[id(x)] = (x, make(x))
    return hit[1]


def _span(rows) -> tuple[int, int]:
    r = np.asarray(rows)
    return int(r.min()), int(r.max()) + 1


def _int_list(x) -> list:
    return np.asarray(x).astype(np.int64).tolist()


def _bool_list(x) -> list:
    return np.asarray(x).astype(bool).tolist()


def _mask_rows(mask_rows, n: int):
    m = np.asarray(mask_rows).reshape(n, -1) != 0
    return m, m.sum(axis=1).astype(np.int64).tolist()


@functools.lru_cache(maxsize=None)
def _dtype_name(dtype) -> str:
    """``str(dtype)`` (numpy's ``__str__`` is Python code: cached, dtypes repeat every step)."""
    return str(dtype)


@functools.lru_cache(maxsize=1024)
def _sharding(sharding, shape: tuple, span: Optional[tuple]) -> dict:
    """A device array's ``sharding`` summary, with the devices holding the rows ``span`` (``[lo, hi)``)
    when given (cached: shardings, shapes and spans repeat; callers copy it)."""
    out = dict(_layout(sharding, shape)["layout"])
    if span is not None:
        lo, hi = span
        spans = _layout(sharding, shape)["rows"]
        out["owner_devices"] = sorted(d for d, (a, b) in spans.items() if a < hi and b > lo)
    return out
