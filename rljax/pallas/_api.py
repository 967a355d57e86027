"""Public entry points: input checks, backend dispatch, the sharded wrapper."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from rljax.pallas import _common, _core, _reference

IMPLS = ("auto", "pallas", "pallas_tpu", "pallas_gpu", "chunked", "naive")
# The backend whose hardware each kernel is written for; elsewhere it runs in interpret mode.
_KERNEL_BACKEND = {"pallas_tpu": "tpu", "pallas_gpu": "gpu"}


def _fail(msg: str):
    raise ValueError(f"fused_logprob: {msg}")


def _check_block(name, value, impl):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        _fail(f"{name}={value!r}; accepted: None or a positive int")
    if impl == "pallas_gpu" and (value < 16 or value & (value - 1)):
        _fail(f"{name}={value} is not a power of two >= 16, which impl={impl!r} (Triton) requires")
    multiple = {"block_t": 8, "block_v": 128}[name] if impl == "pallas_tpu" else 1
    if value % multiple:
        _fail(f"{name}={value} is not a multiple of {multiple}, which impl={impl!r} requires")
    return int(value)


def _check_temperature(temperature) -> float:
    try:
        t = float(temperature)
    except (TypeError, jax.errors.ConcretizationTypeError):
        _fail(f"temperature must be a concrete real number, got {temperature!r}")
    if not np.isfinite(t) or t <= 0:
        _fail(f"temperature={temperature!r}; accepted: a finite number > 0")
    return t


def _check_arrays(hidden, unembed, targets):
    for name, x in (("hidden", hidden), ("unembed", unembed), ("targets", targets)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            _fail(f"{name} must be an array, got {type(x).__name__}")
    if hidden.ndim not in (2, 3):
        _fail(f"hidden has shape {hidden.shape}; accepted: [N, H] or [B, T, H]")
    if unembed.ndim != 2:
        _fail(f"unembed has shape {unembed.shape}; accepted: [H, V]")
    if unembed.shape[0] != hidden.shape[-1]:
        _fail(f"hidden {hidden.shape} and unembed {unembed.shape} disagree on H "
              f"(hidden's last dim must equal unembed's first)")
    if unembed.shape[1] == 0:
        _fail("unembed has an empty vocabulary (V = 0)")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        _fail(f"targets has shape {targets.shape}; accepted: hidden's leading shape "
              f"{tuple(hidden.shape[:-1])}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        _fail(f"targets has dtype {targets.dtype}; accepted: an integer dtype")
    for name, x in (("hidden", hidden), ("unembed", unembed)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            _fail(f"{name} has dtype {x.dtype}; accepted: a floating dtype (float32, bfloat16, ...)")


def check_softcap(softcap) -> float | None:
    """``softcap`` as a float (None: no cap), or the one-line ValueError."""
    try:
        return _common.softcap_value(softcap)
    except ValueError as e:
        _fail(str(e))


def _resolve(impl, temperature, block_t, block_v, vocab_axis=None, softcap=None) -> _common.Config:
    if impl not in IMPLS:
        _fail(f"impl={impl!r}; accepted: {', '.join(map(repr, IMPLS))}")
    inv_temp = 1.0 / _check_temperature(temperature)
    softcap = check_softcap(softcap)
    backend = jax.default_backend()
    if impl == "auto":  # the Pallas kernels do not soft-cap: a capped model's log-probs stay chunked
        impl = "pallas" if backend == "tpu" and softcap is None else "chunked"
    if softcap is not None and impl in ("pallas", *_KERNEL_BACKEND):
        _fail(f"softcap={softcap} (final-logit soft-capping, Gemma 2) is not implemented in the Pallas kernels "
              f"(impl={impl!r}); accepted with impl='chunked', 'naive' or 'auto' (which then runs chunked)")
    if impl == "pallas":  # the kernel of this backend; elsewhere the TPU kernel, interpreted
        impl = "pallas_gpu" if backend == "gpu" else "pallas_tpu"
    return _common.Config(
        impl=impl, inv_temp=inv_temp,
        block_t=_check_block("block_t", block_t, impl),
        block_v=_check_block("block_v", block_v, impl),
        vocab_axis=vocab_axis,
        interpret=impl in _KERNEL_BACKEND and backend != _KERNEL_BACKEND[impl],
        softcap=softcap)


def _flat_call(hidden, unembed, targets, cfg: _common.Config):
    """Runs one resolved config on [.., H] inputs; outputs have the leading shape."""
    lead = hidden.shape[:-1]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).astype(jnp.int32)
    if cfg.vocab_axis is not None and cfg.vocab_axis not in _common.vma(unembed):
        # Also catches shard_map(check_vma=False), whose transpose conventions for replicated
        # outputs would silently scale d_unembed.
        _fail(f"vocab_axis={cfg.vocab_axis!r} needs unembed split over that mesh axis inside "
              f"jax.shard_map with check_vma=True (the default); here unembed does not vary "
              f"over it (outside shard_map, a replicated unembed, or check_vma=False)")
    if cfg.impl == "naive" or h.shape[0] == 0:
        if cfg.vocab_axis is not None:
            _fail("impl='naive' does not split the vocabulary; use 'chunked' or 'pallas'")
        logp, entropy = _reference.naive(h, unembed, y, inv_temp=cfg.inv_temp, softcap=cfg.softcap)
    else:
        logp, entropy = _core.fused(h, unembed, y, cfg)
    logp, entropy = logp.reshape(lead), entropy.reshape(lead)
    chex.assert_shape([logp, entropy], lead)
    chex.assert_type([logp, entropy], jnp.float32)
    return logp, entropy


def fused_logprob(hidden: chex.Array, unembed: chex.Array, targets: chex.Array, *,
                  temperature: float = 1.0, impl: str = "auto", block_t: int | None = None,
                  block_v: int | None = None, vocab_axis: str | None = None, softcap: float | None = None):
    """Per-token log-prob of ``targets`` and entropy of ``softmax(hidden @ unembed / T)``.

    ``z = hidden @ unembed / temperature``;
    ``logp[t] = z[t, y_t] - logsumexp_v z[t, v]``;
    ``entropy[t] = logsumexp_v z[t, v] - sum_v softmax(z[t])_v z[t, v]``.

    Args:
      hidden: [N, H] or [B, T, H] final hidden states (float32 or bfloat16).
      unembed: [H, V] output projection (the transposed embedding when tied).
      targets: integer ids in [0, V) with hidden's leading shape.
      temperature: the sampling temperature the log-probs are taken at; > 0.
      impl: "pallas" (the kernel of the backend: Mosaic on TPU, Triton on GPU; elsewhere the
        TPU kernel in interpret mode), "pallas_tpu" / "pallas_gpu" (that kernel; interpret mode
        off its backend), "chunked" (lax loops over vocab chunks), "naive" (full logits, the
        reference) or "auto" (pallas on TPU, else chunked).
      block_t, block_v: token / vocab block sizes (None: the backend default); see the
        package docstring for the constraints per backend.
      vocab_axis: only inside ``jax.shard_map``: the manual mesh axis ``unembed``'s columns are
        split over (each shard passes its [H, V / n] slice and the global target ids).
      softcap: final-logit soft-capping (Gemma 2): ``z = softcap * tanh(hidden @ unembed / softcap)
        / temperature``. The chunked and naive paths apply it; the Pallas kernels refuse it (a
        ValueError), and ``impl="auto"`` then runs chunked on every backend.

    Returns:
      (logp, entropy), float32 with hidden's leading shape. Gradients flow to ``hidden`` and
      ``unembed`` from both outputs; chunked and pallas recompute logit tiles in the backward.
    """
    _check_arrays(hidden, unembed, targets)
    cfg = _resolve(impl, temperature, block_t, block_v, vocab_axis, softcap)
    return _flat_call(hidden, unembed, targets, cfg)


def _axes_tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def fused_logprob_sharded(hidden: chex.Array, unembed: chex.Array, targets: chex.Array, *,
                          mesh: Mesh, batch_axes: str | Sequence[str] | None = ("dp",),
                          seq_axis: str | None = "sp", vocab_axis: str | None = "tp",
                          temperature: float = 1.0, impl: str = "auto",
                          block_t: int | None = None, block_v: int | None = None, softcap: float | None = None):
    """``fused_logprob`` over ``mesh``: tokens split over ``batch_axes`` (B) and ``seq_axis``
    (T), the vocabulary split over ``vocab_axis``; same numbers as the single-device call.

    ``hidden`` [B, T, H] is laid out as P(batch_axes, seq_axis, None), ``unembed`` as
    P(None, vocab_axis), ``targets`` and both outputs as P(batch_axes, seq_axis). A flat
    [N, H] ``hidden`` splits N over batch_axes and seq_axis together. Inputs are resharded to
    that layout if needed. B, T (or N) and V must divide by the sizes of their axes.
    """
    _check_arrays(hidden, unembed, targets)
    if not isinstance(mesh, Mesh):
        _fail(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    batch = _axes_tuple(batch_axes)
    seq = _axes_tuple(seq_axis)
    vocab = _axes_tuple(vocab_axis)
    used = batch + seq + vocab
    for name in used:
        if name not in mesh.shape:
            _fail(f"axis {name!r} is not in the mesh; accepted: {tuple(mesh.axis_names)} or None")
    if len(set(used)) != len(used):
        _fail(f"batch_axes={batch}, seq_axis={seq_axis!r}, vocab_axis={vocab_axis!r} repeat an axis")
    if impl == "naive" and vocab:
        _fail("impl='naive' does not split the vocabulary; use 'chunked' or 'pallas' or "
              "vocab_axis=None")
    cfg = _resolve(impl, temperature, block_t, block_v, vocab[0] if vocab else None, softcap)

    size = lambda axes: int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
    if hidden.ndim == 3:
        tok_spec = P(batch or None, seq or None)
        dims = (("B", hidden.shape[0], batch), ("T", hidden.shape[1], seq))
    else:
        tok_spec = P((batch + seq) or None)
        dims = (("N", hidden.shape[0], batch + seq),)
    dims += (("V", unembed.shape[1], vocab),)
    for dim, n, axes in dims:
        if n % size(axes):
            _fail(f"{dim}={n} does not divide by the size {size(axes)} of mesh axes {axes}")
    h_spec = P(*tok_spec, None)
    w_spec = P(None, vocab or None)

    axis_types = dict(zip(mesh.axis_names, mesh.axis_types))
    if any(axis_types[a] == AxisType.Explicit for a in used):
        hidden, unembed, targets = (
            jax.reshard(x, NamedSharding(mesh, s))
            for x, s in ((hidden, h_spec), (unembed, w_spec), (targets, tok_spec)))

    def local(h, w, y):
        return _flat_call(h, w, y, cfg)

    return jax.shard_map(local, mesh=mesh, in_specs=(h_spec, w_spec, tok_spec),
                         out_specs=(tok_spec, tok_spec))(hidden, unembed, targets)
