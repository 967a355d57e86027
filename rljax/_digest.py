"""Parameter digests: which weights a pass really used, not which version label it carried.

:func:`param_digest` reduces a parameter tree to 64 bits on the devices that hold it: every
element's bit pattern, as an unsigned integer, times a weight of its position (the product of
odd per-dimension hash weights), summed modulo 2**32 (two lanes with different hashes).
Integer addition is exact and order-free, so a tree resharded onto other devices (the
sampler's layout) has the same digest bit for bit, while any changed element changes it (an
odd weight is invertible mod 2**32; one optimizer step changes all of them). It is a fixed
random projection of every leaf in the integers, reduced one dimension at a time (about twice
a float sum of the parameters on CPU); nothing but the two words comes to the host.

A leaf module: the sampler (:mod:`rljax.rollout`), the update (:mod:`rljax.trainer.step`) and
the trace all use it. Who records what (:data:`LOG`, one per process, drained by the tracer
each step, :mod:`rljax.trace.recompute`):

* ``install``: what the sampler installed under a version label (after its reshard);
* ``reference`` / ``old``: the parameters the learner's reference and old log-prob passes read,
  under the version they must be (0, the initial policy; the learner's version at the update);
* ``chunk``: the weights the decode driver held, with its version label, for the chunks it
  decoded.

A digest is computed once per distinct tree: :class:`DigestLog` remembers it by the identity of
the leaves (arrays are immutable), and the learner declares the digest the update computed of
its output (:meth:`DigestLog.known`), so the passes that read those arrays do not digest them again.

The train step reports the digests of the parameters it started from and produced
(:mod:`rljax.trainer.step`), and the learner's old / reference log-prob passes the digest
of the tree they read; ``python -m rljax.trace check`` ties every version the sampler
decoded with to the learner's digest of that version (:mod:`rljax.trace.recompute`).
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from typing import Any, Optional

import numpy as np

#: Multipliers of the two lanes' position hashes (odd 32-bit constants).
_LANES = (0x9E3779B1, 0x85EBCA77)


def _mix(x):
    """murmur3's 32-bit finaliser (a bijection of uint32; jax arrays)."""
    import jax.numpy as jnp

    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _bits(x):
    """The element bit patterns of ``x`` as uint32 ``[*x.shape, k]`` (k = 1, or 2 for 64-bit)."""
    import jax
    import jax.numpy as jnp

    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)[..., None]
    size = jnp.dtype(x.dtype).itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)[..., None]
    if size == 8:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)[..., None]


def _dim_hash(n: int, dim: int, salt: int):
    """``[2, n]`` uint32: both lanes' odd hash weights of the positions ``0..n-1`` of dimension ``dim``."""
    import jax.numpy as jnp

    i = jnp.arange(n, dtype=jnp.uint32)
    key = jnp.uint32((salt + 0x165667B1 * (dim + 1)) % 2**32)
    return jnp.stack([_mix(i * jnp.uint32(mult) ^ key) | jnp.uint32(1) for mult in _LANES])


def _leaf_digest(x, salt: int):
    """``[2]`` uint32: per lane ``sum_i bits_i * w(i)`` mod 2**32, ``w(i)`` the product of the
    per-dimension weights of position ``i`` (:func:`_dim_hash`, odd, so odd).

    Reduced one dimension at a time, leading dimension first, the two lanes side by side: XLA's
    CPU reduction of a whole integer array is a scalar loop (18x a float sum of the same array),
    while one leading dimension at a time the reductions are elementwise adds of whole rows
    (about 2x a float sum; measured in bench/trace_overhead.py's digest line). Each step's
    intermediate is the leaf with one dimension fewer."""
    import jax.numpy as jnp

    bits = _bits(jnp.asarray(x))
    s = bits[None]  # [2 lanes, *shape], the lanes broadcast (one read of the leaf)
    for d, n in enumerate(bits.shape):
        w = _dim_hash(n, d, salt).reshape((2, n) + (1,) * (bits.ndim - d - 1))
        s = jnp.sum(s * w, axis=1, dtype=jnp.uint32)
    return s


def digest_traced(tree):
    """``[2]`` uint32 digest of every leaf of ``tree`` (call under ``jit``; see :func:`param_digest`)."""
    import jax
    import jax.numpy as jnp

    total = jnp.zeros((2,), jnp.uint32)
    for i, leaf in enumerate(jax.tree.leaves(tree)):
        salt = ((i + 1) * 0x27D4EB2F) % 2**32
        total = total + _mix(_leaf_digest(leaf, salt) + jnp.uint32(i))  # leaf order matters, not only the sum
    return total


@functools.lru_cache(maxsize=None)
def _jitted():
    import jax

    return jax.jit(digest_traced)


def param_digest(tree):
    """The digest of ``tree`` on its devices (a ``[2]`` uint32 jax array; :func:`hex_digest` reads it).

    A tree whose every leaf is fully replicated (e.g. a sampler's weights on a ``tp=1`` mesh: one
    copy per data-parallel device) is digested from its first device's copies: to XLA the copies
    are one value, and one device's program costs a fraction of a program over every device (on
    8 simulated CPU devices 0.18 ms against 1.1 ms for the default model's sampler tree)."""
    import jax

    leaves, treedef = jax.tree.flatten(tree)
    if leaves and all(isinstance(x, jax.Array) and len(x.sharding.device_set) > 1 and x.is_fully_replicated
                      for x in leaves):
        tree = jax.tree.unflatten(treedef, [x.addressable_data(0) for x in leaves])
    return _jitted()(tree)


def hex_digest(value) -> str:
    """16 hex digits of a ``[2]`` uint32 digest (device or host array)."""
    a = np.asarray(value, np.uint32).reshape(-1)
    return f"{int(a[0]):08x}{int(a[1]):08x}"


class DigestLog:
    """What this process's sampler and learner recorded since the last :meth:`drain` (thread-safe:
    an asynchronous run's producer thread decodes and installs while the learner trains).

    Digests already known are not computed again: the log remembers, by the identity of its
    leaves (held by weak references, so it keeps no weights alive), the digest of every tree it
    digested and of every tree declared by :meth:`known` (the update's output, whose digest the
    update computed on device). Arrays are immutable and a live array's id is not reused, so the
    same leaves have the same digest: the old log-prob pass, which reads the tree the last update
    produced, and the reference pass, which reads the same tree every step, cost a dict lookup;
    a pass that reads any other tree (a stale copy) is digested."""

    MAX = 4096  # records kept between drains (a run that is not traced does not grow without bound)
    KNOWN = 8  # trees whose digests are remembered (the oldest is forgotten first)

    def __init__(self):
        self._lock = threading.Lock()
        self._records: list[dict] = []
        self._known: dict[tuple, tuple[list, Any]] = {}  # leaf ids -> (weak references to the leaves, digest)
        self._chunks: dict = {}  # (version, id(digest)) -> chunk record
        self._spent = 0.0  # seconds in digest() since take_spent()

    def digest(self, tree):
        """The digest of ``tree``: the known one when these very arrays were digested or declared
        (:meth:`known`), else computed on device (and remembered)."""
        import jax

        t0 = time.perf_counter()
        leaves = jax.tree.leaves(tree)
        with self._lock:
            hit = self._known.get(tuple(map(id, leaves)))
        if hit is not None and len(hit[0]) == len(leaves) and all(r() is x for r, x in zip(hit[0], leaves)):
            d = hit[1]
        else:
            d = param_digest(tree)
            self.known(tree, d)
        with self._lock:
            self._spent += time.perf_counter() - t0
        return d

    def take_spent(self) -> float:
        """The seconds spent finding or dispatching digests since the last call (the tracer counts
        them in ``trace/overhead_s``; the device's own time for a digest is not in them)."""
        with self._lock:
            spent, self._spent = self._spent, 0.0
        return spent

    def known(self, tree, digest) -> None:
        """``digest`` is the digest of ``tree`` (e.g. computed inside the update on its output):
        a later record of the same arrays takes it instead of computing it again."""
        import jax

        leaves = jax.tree.leaves(tree)
        try:
            refs = [weakref.ref(x) for x in leaves]
        except TypeError:  # a leaf that cannot be weakly referenced (a Python scalar): not remembered
            return
        with self._lock:
            for k in [k for k, (rs, _) in self._known.items() if any(r() is None for r in rs)]:
                del self._known[k]  # a leaf was freed: its id may be reused
            self._known[tuple(map(id, leaves))] = (refs, digest)
            while len(self._known) > self.KNOWN:
                del self._known[next(iter(self._known))]

    def record(self, kind: str, version: int, tree) -> None:
        """An ``install`` (or a learner pass: ``reference``, ``old``) of ``tree`` labelled ``version``."""
        d = self.digest(tree)
        with self._lock:
            if len(self._records) < self.MAX:
                self._records.append({"kind": kind, "version": int(version), "digest": d})

    def chunk(self, tree, version: int) -> None:
        """The decode driver decoded one chunk with ``tree``, labelled ``version`` (the tree's digest
        is computed once: an ``install`` of the same tree seeds it)."""
        d = self.digest(tree)
        key = (int(version), id(d))  # the record holds the digest: its id is not reused while kept
        with self._lock:
            rec = self._chunks.get(key)
            if rec is None:
                if len(self._chunks) >= self.MAX:
                    return
                rec = self._chunks[key] = {"kind": "chunk", "version": int(version), "digest": d, "chunks": 0}
            rec["chunks"] += 1

    def forget(self, tree) -> None:
        """Drops the remembered digest of ``tree`` (the sampler released it; the log holds no
        strong reference to it anyway)."""
        import jax

        with self._lock:
            self._known.pop(tuple(map(id, jax.tree.leaves(tree))), None)

    def drain(self) -> list[dict]:
        """The records since the last drain, digests as hex (one host read of every digest: a sync)."""
        import jax

        with self._lock:
            records, self._records = self._records + list(self._chunks.values()), []
            self._chunks = {}
        words = jax.device_get([r["digest"] for r in records])
        return [dict(r, digest=hex_digest(w)) for r, w in zip(records, words)]

    def clear(self) -> None:
        """Drops the records (the known digests stay: they are facts about live arrays, not records)."""
        with self._lock:
            self._records, self._chunks = [], {}


#: This process's log.
LOG = DigestLog()
