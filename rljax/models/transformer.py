"""Decoder-only transformer (Llama / Qwen2 family) in Flax NNX.

Shapes: ``B`` batch, ``T`` sequence, ``H`` hidden, ``N`` query heads, ``K`` key/value
heads, ``D`` head dim, ``F`` MLP hidden, ``V`` vocab, ``L`` layers, ``S`` cache slots,
``M`` cache length. Every parameter carries its logical axes in the ``out_sharding``
metadata (``nnx.Param(..., out_sharding=("embed", "mlp"))``); :mod:`rljax.sharding`
maps them to the mesh. Activations are constrained by logical name only when a mesh is
passed in; without one the model is plain single-device code.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from rljax.models.attention import (attention, block_sparse_attention, dense_attention, live_decode_attention,
                                    slot_cache_attention)
from rljax.models.config import ModelConfig
from rljax.models.adapters import NO_LORA, LayerLoRA, layer_inputs
from rljax.sharding import logical_to_spec, with_logical_constraint

#: Logical axes of the residual stream ``[B,T,H]`` between the tensor-parallel regions:
#: the sequence is split over ``sp`` and ``tp`` (Megatron sequence parallelism, see
#: :mod:`rljax.sharding.rules`).
RESIDUAL_AXES = ("batch", "residual_length", "embed")


#: Projections as one 2-D dot over the flattened tokens (``[B*T, in] @ [in, out]``) instead of a
#: 3-D einsum, on a single device. Same products and sums; what differs is the program XLA:CPU
#: compiles for the backward pass: the einsum's weight gradient contracts over two axes
#: (batch and length) and became a plain dot with a transposed ``[F, B*T]`` copy of its
#: operand (55 GFLOP/s per core at 31.6M), the 2-D form a dot over one axis with no copy (140,
#: as torch's MKL). On a multi-device mesh the einsum stays (its sharding rules are the
#: activations' logical axes). ``bench/peer_update_torch.py`` A/Bs it (``FLAT=0``).
FLATTEN_TOKEN_DOTS = True


def remat_policy(name: str):
    """The ``jax.checkpoint`` policy of ``ModelConfig.remat_policy``: ``full`` keeps only the
    layer's input (``None``); ``minimal`` also the outputs of the dots without batch dimensions,
    i.e. the projections (q, k, v, o, gate, up, down), and recomputes the norms, rotary, SwiGLU
    and attention (whose q.k / p.v dots have batch dimensions) in the backward pass."""
    return None if name == "full" else jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def dense(x: jax.Array, w: jax.Array, mesh: Mesh | None, contract: int = 1) -> jax.Array:
    """``x [..., *in] @ w [*in, *out] -> [..., *out]`` over the last ``contract`` axes of ``x``."""
    lead, inner, out = x.shape[:-contract], x.shape[-contract:], w.shape[contract:]
    if FLATTEN_TOKEN_DOTS and (mesh is None or mesh.size == 1):
        k = math.prod(inner)
        return jnp.dot(x.reshape(-1, k), w.reshape(k, -1)).reshape(*lead, *out)
    letters = "abcdefghijklmnopqrstuvwxyz"
    xs, ins, outs = letters[: len(lead)], letters[10: 10 + contract], letters[20: 20 + len(out)]
    return jnp.einsum(f"{xs}{ins},{ins}{outs}->{xs}{outs}", x, w)


def _param(rngs: nnx.Rngs, init, shape, dtype, axes) -> nnx.Param:
    # eager_sharding=False: the logical names are resolved by rljax.sharding, not by a
    # global mesh context at construction time.
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


# --------------------------------------------------------------------------- rotary


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Inverse frequencies ``[D/2]`` (float32) with the configured ``rope_scaling``."""
    d = config.head_dim
    inv = (1.0 / (np.float32(config.rope_theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)))).astype(np.float32)
    scaling = config.rope_scaling_dict
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv / factor).astype(np.float32)
    # llama3: long wavelengths divided by `factor`, short kept, a smooth blend in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def rope_cos_sin(positions: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` of shape ``positions.shape + (D,)`` in float32 (halves repeated)."""
    angle = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope_inv_freq(config))
    angle = jnp.concatenate([angle, angle], axis=-1)
    return jnp.cos(angle), jnp.sin(angle)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x [B,T,heads,D]`` (rotate-half convention, as in HF Llama/Qwen2)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin


# --------------------------------------------------------------------------- attention core


def _axis_of(spec: PartitionSpec, dim: int):
    entries = tuple(spec) + (None,) * (dim + 1 - len(spec))
    return entries[dim]


def sequence_parallel_attention(q, k, v, k_valid, mesh: Mesh, *, rules=None, block_size: int | None = None,
                                segment_ids=None, softcap: float | None = None) -> jax.Array:
    """Causal attention with the sequence split over the mesh axis of logical ``length``.

    Runs inside ``jax.shard_map``: each device holds ``T/sp`` queries and all-gathers the
    keys, values and key mask over ``sp``, so every query sees its whole causal context.
    Batch and heads stay split as the logical-axis rules say (heads only where the head
    counts divide ``tp``; key/value heads are repeated up to ``N`` when only ``N`` does).
    Sequence indices are the token indices ``0..T-1``; ``q, k, v`` are ``[B,T,heads,D]``
    and ``k_valid`` is ``[B,T]``. Equals :func:`dense_attention` with ``q_index = k_index
    = arange(T)``; each device's local attention is blockwise when ``T > block_size``.
    ``segment_ids [B,T]`` (packed rows) are all-gathered like the key mask; a query then
    sees only keys of its own segment. ``softcap``: the scores' soft-capping (Gemma 2), as
    :func:`rljax.models.attention.dense_attention`'s.
    """
    b, t, n, d = q.shape
    kh = k.shape[2]
    q_spec = logical_to_spec(("batch", "length", "heads", "head_dim"), rules=rules, mesh=mesh, shape=q.shape)
    sp_axis = _axis_of(q_spec, 1)
    if sp_axis is None:
        raise ValueError(f"sequence_parallel_attention: sequence length {t} is not split by mesh {dict(mesh.shape)}")
    kv_spec = logical_to_spec(("batch", "length", "kv_heads", "head_dim"), rules=rules, mesh=mesh, shape=k.shape)
    if _axis_of(q_spec, 2) is not None and _axis_of(kv_spec, 2) != _axis_of(q_spec, 2):
        # query heads split but key/value heads are not: give every query head its own copy.
        k = jnp.repeat(k, n // kh, axis=2)
        v = jnp.repeat(v, n // kh, axis=2)
        kv_spec = q_spec
    elif _axis_of(q_spec, 2) is None:
        kv_spec = PartitionSpec(_axis_of(kv_spec, 0), sp_axis)
    mask_spec = PartitionSpec(_axis_of(q_spec, 0), sp_axis)
    sp_size = mesh.shape[sp_axis] if isinstance(sp_axis, str) else math.prod(mesh.shape[a] for a in sp_axis)

    def local(q, k, v, k_valid, *segments):
        t_local = q.shape[1]
        k = jax.lax.all_gather(k, sp_axis, axis=1, tiled=True)
        v = jax.lax.all_gather(v, sp_axis, axis=1, tiled=True)
        k_valid = jax.lax.all_gather(k_valid, sp_axis, axis=1, tiled=True)
        offset = jax.lax.axis_index(sp_axis) * t_local
        q_index = jnp.broadcast_to(offset + jnp.arange(t_local), q.shape[:2])
        k_index = jnp.broadcast_to(jnp.arange(t_local * sp_size), k.shape[:2])
        q_seg = k_seg = None
        if segments:
            q_seg = segments[0]
            k_seg = jax.lax.all_gather(q_seg, sp_axis, axis=1, tiled=True)
        return attention(q, k, v, q_index, k_index, k_valid, q_seg, k_seg, block_size=block_size, softcap=softcap)

    args, specs = (q, k, v, k_valid), (q_spec, kv_spec, kv_spec, mask_spec)
    if segment_ids is not None:
        args, specs = args + (segment_ids,), specs + (mask_spec,)
    fn = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=q_spec)
    return fn(*args)


def _uses_sequence_parallel(mesh: Mesh | None, shape) -> bool:
    if mesh is None:
        return False
    spec = logical_to_spec(("batch", "length"), mesh=mesh, shape=shape[:2])
    return _axis_of(spec, 1) is not None


# --------------------------------------------------------------------------- modules


def check_window(config: ModelConfig, length: int, what: str) -> None:
    """A model with ``sliding_window`` attends over whole sequences: one longer than the window
    would differ from the checkpoint's model, so it is refused (shapes are static: at trace time)."""
    if config.sliding_window is not None and length > config.sliding_window:
        raise ValueError(f"a {what} of {length} tokens is longer than the model's sliding_window="
                         f"{config.sliding_window} (config.json), which rljax does not implement; keep prompt + "
                         f"response within {config.sliding_window} tokens")


class RMSNorm(nnx.Module):
    """``scale * x / rms(x)``; with ``offset`` (Gemma) ``(offset + scale) * x / rms(x)`` in float32."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype, rngs: nnx.Rngs, offset: float = 0.0):
        init = nnx.initializers.zeros if offset else nnx.initializers.ones
        self.scale = _param(rngs, init, (dim,), param_dtype, ("norm",))
        self.eps = eps
        self.dtype = dtype
        self.offset = offset

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.offset:
            return ((self.offset + self.scale[...].astype(jnp.float32)) * y).astype(self.dtype)
        return self.scale[...].astype(self.dtype) * y.astype(self.dtype)


def _norm_kw(c: ModelConfig, rngs) -> dict:
    return dict(eps=c.rms_norm_eps, dtype=c.jnp_dtype, param_dtype=c.jnp_param_dtype, rngs=rngs, offset=c.norm_offset)


def layer_rope(positions, config: ModelConfig, layer):
    """``cos, sin`` of layer ``layer``: a local (sliding-window) layer of ``config.local_layers`` takes
    ``rope_local_theta`` and no scaling; every other the config's rotary embedding."""
    cos, sin = rope_cos_sin(positions, config)
    if config.local_layers is None or layer is None:
        return cos, sin
    lcos, lsin = rope_cos_sin(positions, config.replace(rope_theta=config.rope_local_theta, rope_scaling=None,
                                                        local_layers=None))
    local = jnp.asarray(config.local_layers)[layer]
    return jnp.where(local, lcos, cos), jnp.where(local, lsin, sin)


class Attention(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        h, n, k, d = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim
        pd = c.jnp_param_dtype
        init = nnx.initializers.normal(0.02)
        self.config = config
        self.q_proj = _param(rngs, init, (h, n, d), pd, ("embed", "heads", "head_dim"))
        self.k_proj = _param(rngs, init, (h, k, d), pd, ("embed", "kv_heads", "head_dim"))
        self.v_proj = _param(rngs, init, (h, k, d), pd, ("embed", "kv_heads", "head_dim"))
        self.o_proj = _param(rngs, init, (n, d, h), pd, ("heads", "head_dim", "embed"))
        if c.qkv_bias:
            self.q_bias = _param(rngs, nnx.initializers.zeros, (n, d), pd, ("heads", "head_dim"))
            self.k_bias = _param(rngs, nnx.initializers.zeros, (k, d), pd, ("kv_heads", "head_dim"))
            self.v_bias = _param(rngs, nnx.initializers.zeros, (k, d), pd, ("kv_heads", "head_dim"))
        if c.qk_norm:  # Qwen3, Gemma 3: each head's query and key normalised before the rotary embedding
            self.q_norm = RMSNorm(d, **_norm_kw(c, rngs))
            self.k_norm = RMSNorm(d, **_norm_kw(c, rngs))

    def project(self, x, positions, mesh, lora=NO_LORA, layer=None):
        """``x [B,T,H]`` -> rotated ``q [B,T,N,D]``, ``k, v [B,T,K,D]`` (``layer``: this layer's index,
        for a model whose layers differ in their rotary base)."""
        dt = self.config.jnp_dtype
        q = lora.add("q_proj", x, dense(x, self.q_proj[...].astype(dt), mesh))
        k = lora.add("k_proj", x, dense(x, self.k_proj[...].astype(dt), mesh))
        v = lora.add("v_proj", x, dense(x, self.v_proj[...].astype(dt), mesh))
        if self.config.qkv_bias:
            q = q + self.q_bias[...].astype(dt)
            k = k + self.k_bias[...].astype(dt)
            v = v + self.v_bias[...].astype(dt)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.config.query_scale is not None:  # scores over sqrt(query_scale), not sqrt(head_dim)
            q = q * jnp.asarray(math.sqrt(self.config.head_dim / self.config.query_scale), q.dtype)
        cos, sin = layer_rope(positions, self.config, layer)
        q = with_logical_constraint(apply_rope(q, cos, sin), ("batch", "length", "heads", "head_dim"), mesh)
        k = with_logical_constraint(apply_rope(k, cos, sin), ("batch", "length", "kv_heads", "head_dim"), mesh)
        v = with_logical_constraint(v, ("batch", "length", "kv_heads", "head_dim"), mesh)
        return q, k, v

    def output(self, attn, mesh, lora=NO_LORA):
        out = lora.add("o_proj", attn, dense(attn, self.o_proj[...].astype(self.config.jnp_dtype), mesh, 2))
        return with_logical_constraint(out, RESIDUAL_AXES, mesh)

    def __call__(self, x, positions, valid, mesh, lora=NO_LORA, segment_ids=None, layer=None, key_blocks=None):
        """Self-attention over the whole sequence; also returns the rotated ``k, v``.

        ``segment_ids [B,T]`` (packed rows): attention stays inside each segment (and a shared
        prefix's branches see their prefix: :func:`rljax.models.attention.visible`);
        ``key_blocks [B,nq,J]``: the key blocks each query block reads
        (:func:`rljax.models.attention.block_sparse_attention`; not with the sequence split over ``sp``,
        where every query reads the whole row under the same mask)."""
        q, k, v = self.project(x, positions, mesh, lora, layer)
        cap = self.config.attn_logit_softcapping
        if _uses_sequence_parallel(mesh, q.shape):
            attn = sequence_parallel_attention(q, k, v, valid, mesh, block_size=self.config.attn_block_size,
                                               segment_ids=segment_ids, softcap=cap)
        elif key_blocks is not None:
            idx = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
            attn = block_sparse_attention(q, k, v, idx, idx, valid, segment_ids, segment_ids, key_blocks, softcap=cap)
        else:
            idx = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
            attn = attention(q, k, v, idx, idx, valid, segment_ids, segment_ids, block_size=self.config.attn_block_size,
                             softcap=cap)
        return self.output(attn, mesh, lora), (k, v)

    def decode(self, x, positions, cache_k, cache_v, layer, cache_index, decode_attention="live", live=None):
        """Attention for ``x [S,Tn,H]`` new tokens per slot against layer ``layer`` of a
        cache ``[L,S,M,K,D]``.

        Writes the new keys/values at ``cache_index[s] + t`` (writes past ``M`` are
        dropped) and attends to cache entries ``<= cache_index[s] + t``: with
        ``decode_attention="live"`` only the cache blocks up to the longest live slot are
        read (:func:`live_decode_attention`; ``live [S]`` marks the slots that count), with
        ``"dense"`` the whole cache.
        """
        q, k, v = self.project(x, positions, None, layer=layer)
        s, tn = x.shape[:2]
        write = cache_index[:, None] + jnp.arange(tn)[None, :]
        rows = jnp.arange(s)[:, None]
        cache_k = cache_k.at[layer, rows, write].set(k.astype(cache_k.dtype), mode="drop")
        cache_v = cache_v.at[layer, rows, write].set(v.astype(cache_v.dtype), mode="drop")
        if decode_attention == "live":
            attn = live_decode_attention(q, cache_k, cache_v, layer, write, live=live,
                                         block_size=self.config.decode_block_size,
                                         softcap=self.config.attn_logit_softcapping)
        elif decode_attention == "dense":
            m = cache_k.shape[2]
            k_index = jnp.broadcast_to(jnp.arange(m), (s, m))
            attn = dense_attention(
                q, cache_k[layer].astype(q.dtype), cache_v[layer].astype(q.dtype), write, k_index, jnp.ones((s, m), bool),
                softcap=self.config.attn_logit_softcapping)
        else:
            raise ValueError(f"decode_attention={decode_attention!r}; accepted: 'live', 'dense'")
        return self.output(attn, None), cache_k, cache_v

    def decode_slots(self, x, positions, cache_k, cache_v, cache_index, decode_attention="live", live=None,
                     layer=None):
        """:meth:`decode` against this layer's own cache ``[S,K,M,D]`` (heads before length).

        Keys and values are written at ``cache_index[s] + t`` (writes past ``M`` are dropped)
        and read in place by :func:`slot_cache_attention` (``"dense"``: always the whole cache).
        """
        q, k, v = self.project(x, positions, None, layer=layer)
        s, tn = x.shape[:2]
        write = cache_index[:, None] + jnp.arange(tn)[None, :]
        rows = jnp.arange(s)[:, None]
        # advanced indices on axes 0 and 2: the update is laid out [S, Tn, K, D], as k and v are
        cache_k = cache_k.at[rows, :, write].set(k.astype(cache_k.dtype), mode="drop")
        cache_v = cache_v.at[rows, :, write].set(v.astype(cache_v.dtype), mode="drop")
        if decode_attention not in ("live", "dense"):
            raise ValueError(f"decode_attention={decode_attention!r}; accepted: 'live', 'dense'")
        block = self.config.decode_block_size if decode_attention == "live" else cache_k.shape[2]
        attn = slot_cache_attention(q, cache_k, cache_v, write, live=live, block_size=block,
                                    softcap=self.config.attn_logit_softcapping)
        return self.output(attn, None), cache_k, cache_v


class MLP(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        h, f, pd = config.hidden_size, config.intermediate_size, config.jnp_param_dtype
        init = nnx.initializers.normal(0.02)
        self.dtype = config.jnp_dtype
        self.act = jax.nn.silu if config.hidden_act == "silu" else partial(jax.nn.gelu, approximate=True)
        self.gate_proj = _param(rngs, init, (h, f), pd, ("embed", "mlp"))
        self.up_proj = _param(rngs, init, (h, f), pd, ("embed", "mlp"))
        self.down_proj = _param(rngs, init, (f, h), pd, ("mlp", "embed"))

    def __call__(self, x, mesh, lora=NO_LORA):
        gate = lora.add("gate_proj", x, dense(x, self.gate_proj[...].astype(self.dtype), mesh))
        up = lora.add("up_proj", x, dense(x, self.up_proj[...].astype(self.dtype), mesh))
        act = with_logical_constraint(self.act(gate) * up, ("batch", "length", "mlp"), mesh)
        out = lora.add("down_proj", act, dense(act, self.down_proj[...].astype(self.dtype), mesh))
        return with_logical_constraint(out, RESIDUAL_AXES, mesh)


class Block(nnx.Module):
    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        kw = _norm_kw(config, rngs)
        self.attn_norm = RMSNorm(config.hidden_size, **kw)
        self.attn = Attention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.hidden_size, **kw)
        self.mlp = MLP(config, rngs=rngs)
        if config.sandwich_norm:  # Gemma: the attention's and the MLP's outputs normalised before the residual add
            self.post_attn_norm = RMSNorm(config.hidden_size, **kw)
            self.post_mlp_norm = RMSNorm(config.hidden_size, **kw)

    def _post(self, name, y):
        return getattr(self, name)(y) if self.attn.config.sandwich_norm else y

    def __call__(self, x, positions, valid, mesh, lora=NO_LORA, segment_ids=None, layer=None, key_blocks=None):
        a, kv = self.attn(self.attn_norm(x), positions, valid, mesh, lora, segment_ids, layer, key_blocks)
        x = x + self._post("post_attn_norm", a)
        x = x + self._post("post_mlp_norm", self.mlp(self.mlp_norm(x), mesh, lora))
        return x, kv

    def decode(self, x, positions, cache_k, cache_v, layer, cache_index, decode_attention="live", live=None):
        a, cache_k, cache_v = self.attn.decode(self.attn_norm(x), positions, cache_k, cache_v, layer, cache_index,
                                               decode_attention, live)
        x = x + self._post("post_attn_norm", a)
        x = x + self._post("post_mlp_norm", self.mlp(self.mlp_norm(x), None))
        return x, cache_k, cache_v

    def decode_slots(self, x, positions, cache_k, cache_v, cache_index, decode_attention="live", live=None,
                     layer=None):
        a, cache_k, cache_v = self.attn.decode_slots(self.attn_norm(x), positions, cache_k, cache_v, cache_index,
                                                     decode_attention, live, layer)
        x = x + self._post("post_attn_norm", a)
        x = x + self._post("post_mlp_norm", self.mlp(self.mlp_norm(x), None))
        return x, cache_k, cache_v


class Transformer(nnx.Module):
    """Token embedding -> ``num_layers`` x (RMSNorm, GQA attention, RMSNorm, SwiGLU) -> RMSNorm.

    The layers are one :class:`Block` whose parameters are stacked along a leading
    ``layers`` axis (created with ``nnx.vmap``) and applied with ``jax.lax.scan``: the
    program holds one layer body whatever the depth (fast compiles), and with
    ``config.remat`` the backward pass keeps only each layer's input, on every backend.

    ``__call__`` returns the final hidden states ``[B,T,H]`` (after the last norm); the
    unembedding is :meth:`unembedding` (``[H,V]``: the transposed embedding when tied).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        pd = config.jnp_param_dtype
        self.embed = _param(rngs, nnx.initializers.normal(0.02), (config.vocab_size, config.hidden_size), pd, ("vocab", "embed"))

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs):
            return Block(config, rngs=rngs)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(config.hidden_size, **_norm_kw(config, rngs))
        if not config.tie_embeddings:
            self.lm_head = _param(
                rngs, nnx.initializers.normal(0.02), (config.hidden_size, config.vocab_size), pd, ("embed", "vocab")
            )

    def embed_tokens(self, tokens, mesh):
        x = jnp.take(self.embed[...], tokens, axis=0).astype(self.config.jnp_dtype)
        if self.config.embed_scale:  # Gemma: times sqrt(hidden_size), rounded to the parameter dtype
            x = x * jnp.asarray(math.sqrt(self.config.hidden_size), self.config.jnp_param_dtype).astype(x.dtype)
        return with_logical_constraint(x, RESIDUAL_AXES, mesh)

    def __call__(self, tokens, positions, valid, mesh: Mesh | None = None, *, return_kv: bool = False, lora=None,
                 segment_ids=None, key_blocks=None):
        """``lora``: a :class:`rljax.models.lora.LoRAParams` whose adapters join each layer;
        ``segment_ids [B,T]``: packed rows (attention stays inside each segment); ``key_blocks``:
        see :meth:`Attention.__call__`."""
        check_window(self.config, tokens.shape[1], "sequence")
        x = self.embed_tokens(tokens, mesh)
        block_def, block_state = nnx.split(self.layers)
        lora_xs = None if lora is None else layer_inputs(lora, self.config.num_layers)

        def body(x, xs):
            layer_state, lx, i = xs
            hook = NO_LORA if lx is None else LayerLoRA(lx[0], lx[1], lora.config, mesh)
            x, kv = nnx.merge(block_def, layer_state)(x, positions, valid, mesh, hook, segment_ids, i, key_blocks)
            return x, (kv if return_kv else None)

        if self.config.remat:
            body = jax.checkpoint(body, prevent_cse=False, policy=remat_policy(self.config.remat_policy))
        unroll = 1 if self.config.scan_layers else self.config.num_layers
        x, kv = jax.lax.scan(body, x, (block_state, lora_xs, jnp.arange(self.config.num_layers)), unroll=unroll)
        # leave the Megatron-SP layout: the unembedding (vocab on tp) needs every token's hidden state
        hidden = with_logical_constraint(self.final_norm(x), ("batch", "length", "embed"), mesh)
        return (hidden, kv) if return_kv else hidden

    def decode(self, tokens, positions, cache_k, cache_v, cache_index, decode_attention="live", live=None):
        """``tokens [S,Tn]`` at ``positions [S,Tn]``; cache ``[L,S,M,K,D]`` written at ``cache_index [S]``."""
        check_window(self.config, cache_k.shape[2], "KV cache")
        x = self.embed_tokens(tokens, None)
        block_def, block_state = nnx.split(self.layers)

        def body(carry, xs):
            x, ck, cv = carry
            layer_state, i = xs
            x, ck, cv = nnx.merge(block_def, layer_state).decode(x, positions, ck, cv, i, cache_index, decode_attention,
                                                                 live)
            return (x, ck, cv), None

        layer_ids = jnp.arange(self.config.num_layers)
        (x, cache_k, cache_v), _ = jax.lax.scan(body, (x, cache_k, cache_v), (block_state, layer_ids))
        return self.final_norm(x), cache_k, cache_v

    def layer_states(self) -> tuple:
        """``(block_def, states)``: each layer's parameters as its own arrays (sliced out of the
        stacked ``[L, ...]`` ones), for :meth:`decode_slots`. Slicing copies the weights: do it
        once outside a decode loop (per decode chunk), so the steps read them in place."""
        block_def, block_state = nnx.split(self.layers)
        return block_def, tuple(jax.tree.map(lambda a, i=i: a[i], block_state) for i in range(self.config.num_layers))

    def decode_slots(self, layers, tokens, positions, cache_k, cache_v, cache_index, decode_attention="live",
                     live=None):
        """:meth:`decode` over per-layer caches: ``cache_k, cache_v`` are tuples of ``L`` arrays
        ``[S,K,M,D]`` and ``layers`` is :meth:`layer_states`' result. The layer loop is unrolled
        (static), so neither the weights nor the caches are sliced per step."""
        check_window(self.config, cache_k[0].shape[2], "KV cache")
        x = self.embed_tokens(tokens, None)
        block_def, states = layers
        ks, vs = list(cache_k), list(cache_v)
        for i, state in enumerate(states):
            x, ks[i], vs[i] = nnx.merge(block_def, state).decode_slots(x, positions, ks[i], vs[i], cache_index,
                                                                       decode_attention, live, i)
        return self.final_norm(x), tuple(ks), tuple(vs)

    def unembedding(self) -> jax.Array:
        return self.embed[...].T if self.config.tie_embeddings else self.lm_head[...]
