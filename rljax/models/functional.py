"""Functional view of the NNX model: ``graphdef, params = split(model)`` and pure functions.

``params`` is a plain nested dict of arrays (``nnx.State.to_pure_dict()``): keys are
module attribute names and, under ``"layers"``, the integer layer index. It is what the
trainer differentiates, optax updates and the sampler receives; the ``graphdef`` is static
(it holds the :class:`ModelConfig`).
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from rljax.models.config import ModelConfig
from rljax.models.adapters import LoRAParams, effective_base
from rljax.models.attention import soft_cap
from rljax.models.params import (abstract_params, create_model, merge, param_logical_axes,  # noqa: F401
                                 param_shardings, split)
from rljax.models.transformer import Transformer
from rljax.sharding import KV_CACHE_AXES, kv_cache_sharding, with_logical_constraint


@flax.struct.dataclass
class KVCache:
    """Per-layer keys and values, stacked: ``k, v [layers, slots, max_len, kv_heads, head_dim]``.

    Logical axes :data:`rljax.sharding.KV_CACHE_AXES` (slots on ``dp``, kv heads on
    ``tp``); ``rljax.sharding.kv_cache_spec`` gives the partition spec. Entry ``[l, s, j]``
    holds layer ``l``'s rotated key / value of the token at cache index ``j`` of slot ``s``.
    """

    k: jax.Array
    v: jax.Array

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


KV_CACHE_LOGICAL_AXES = KVCache(k=KV_CACHE_AXES, v=KV_CACHE_AXES)


def init_params(config: ModelConfig, *, seed: int = 0, mesh: Mesh | None = None, rules=None) -> tuple[nnx.GraphDef, dict]:
    """Initialises parameters directly in their sharded layout (or on one device without ``mesh``).

    The values do not depend on the mesh: the same ``seed`` gives the same weights.
    """

    rules = tuple(rules.items()) if isinstance(rules, dict) else (None if rules is None else tuple(rules))
    return abstract_params(config)[0], _jitted_init(config, mesh, rules)(jnp.asarray(seed, jnp.uint32))


@functools.lru_cache(maxsize=16)
def _jitted_init(config: ModelConfig, mesh: Mesh | None, rules):
    """One compiled initialiser per (config, mesh, rules); the seed is a traced argument."""

    def init(seed):
        return split(Transformer(config, rngs=nnx.Rngs(jax.random.key(seed))))[1]

    shardings = None if mesh is None else param_shardings(config, mesh, rules=rules)
    return jax.jit(init, out_shardings=shardings)


# --------------------------------------------------------------------------- input checks


def _check_tokens(tokens, name="tokens", rank=2):
    if not hasattr(tokens, "shape") or tokens.ndim != rank or not jnp.issubdtype(tokens.dtype, jnp.integer):
        shape = getattr(tokens, "shape", None)
        raise ValueError(f"{name} must be an integer array of rank {rank}, got shape {shape} dtype {getattr(tokens, 'dtype', type(tokens).__name__)}")


def _check_like(x, tokens, name):
    if x is not None and tuple(x.shape) != tuple(tokens.shape):
        raise ValueError(f"{name} must have the shape of tokens {tuple(tokens.shape)}, got {tuple(x.shape)}")


def default_positions(mask: jax.Array) -> jax.Array:
    """Position ids from a padding mask: ``cumsum(mask) - 1`` (0 on leading padding).

    Left-padded rows thus get positions ``0, 1, ...`` on their real tokens, exactly as
    the same rows without padding.
    """
    return jnp.maximum(jnp.cumsum(mask.astype(jnp.int32), axis=-1) - 1, 0)


def _split_lora(params):
    """``(base params, LoRAParams or None)``: a :class:`LoRAParams` runs its adapters in each layer
    (on its base with the trained ``modules_to_save`` in place)."""
    return (effective_base(params), params) if isinstance(params, LoRAParams) else (params, None)


def _inputs(tokens, positions, mask):
    _check_tokens(tokens)
    _check_like(positions, tokens, "positions")
    _check_like(mask, tokens, "mask")
    mask = jnp.ones(tokens.shape, bool) if mask is None else mask.astype(bool)
    positions = default_positions(mask) if positions is None else positions.astype(jnp.int32)
    return tokens, positions, mask


# --------------------------------------------------------------------------- forward modes


def forward(graphdef, params, tokens, *, positions=None, mask=None, mesh: Mesh | None = None,
            segment_ids=None, key_blocks=None) -> jax.Array:
    """Final hidden states ``[B,T,H]`` (after the last RMSNorm), in the compute dtype.

    Args:
      graphdef, params: from :func:`split` / :func:`init_params` / ``load_hf_checkpoint``.
      tokens: ``[B,T]`` int token ids.
      positions: ``[B,T]`` int position ids for the rotary embedding; default
        :func:`default_positions` of ``mask`` (``0..T-1`` without a mask).
      mask: ``[B,T]`` bool, True on real tokens; padding keys are never attended to.
        Attention is causal by token index; padding may be on either side.
      params may also be :class:`rljax.models.lora.LoRAParams` (base + adapters).
      mesh: a mesh from ``rljax.sharding.make_mesh``; activations are constrained to the
        logical layout and, when the sequence is split over ``sp``, attention runs
        sequence-parallel inside ``jax.shard_map``. ``None``: single-device semantics.
      segment_ids: ``[B,T]`` int for packed rows (several sequences per row): a token
        attends only to earlier tokens with its own segment id. Pass ``positions`` that
        restart per segment (see :mod:`rljax.trainer.packing`). Ids made by
        :func:`rljax.models.attention.branch_ids` lay a shared prefix once: each branch
        sees its group's prefix and itself.
      key_blocks: ``[B,nq,J]`` int32, the key blocks each query block reads
        (:func:`rljax.models.attention.block_sparse_attention`): the same numbers as without
        it when it lists every block a query sees, for the cost of those blocks only.
    """
    tokens, positions, mask = _inputs(tokens, positions, mask)
    _check_like(segment_ids, tokens, "segment_ids")
    if segment_ids is not None:
        segment_ids = segment_ids.astype(jnp.int32)
    base, lora = _split_lora(params)
    return merge(graphdef, base)(tokens, positions, mask, mesh, lora=lora, segment_ids=segment_ids,
                                 key_blocks=key_blocks)


def prefill(graphdef, params, tokens, *, positions=None, mask=None, mesh: Mesh | None = None) -> tuple[jax.Array, KVCache]:
    """Like :func:`forward`, also returning the rotated K/V of every position: ``KVCache [L,B,T,K,D]``.

    For the decode cache, prefill *right-padded* prompts (real tokens at indices
    ``0..len-1``), copy them into slots with :func:`insert_kv`, and continue decoding at
    ``cache_index = len``.
    """
    tokens, positions, mask = _inputs(tokens, positions, mask)
    base, lora = _split_lora(params)
    hidden, (k, v) = merge(graphdef, base)(tokens, positions, mask, mesh, return_kv=True, lora=lora)
    return hidden, KVCache(k=k, v=v)


def decode(graphdef, params, cache: KVCache, tokens, *, cache_index, positions=None, mesh: Mesh | None = None,
           attention: str = "live", live=None) -> tuple[jax.Array, KVCache]:
    """One decode step for every slot, each at its own length.

    Args:
      cache: :class:`KVCache` ``[L,S,M,K,D]``.
      tokens: ``[S]`` (one new token per slot) or ``[S,Tn]`` (a chunk per slot).
      cache_index: ``[S]`` int, where slot ``s``'s first new token is written -- the
        number of tokens already in that slot. Token ``t`` attends to cache entries
        ``0 .. cache_index[s] + t``. Writes at or past ``max_len`` are dropped, so the
        caller keeps ``cache_index + Tn <= max_len``; idle slots may carry any index.
      positions: ``[S]`` / ``[S,Tn]`` rotary positions; default ``cache_index + t``.
      mesh: used only to keep the returned cache in its ``KV_CACHE_AXES`` layout.
      attention: ``"live"`` (default) reads only the cache blocks up to the longest live
        slot (``max(cache_index) + Tn``), so a step's cost follows the live lengths;
        ``"dense"`` attends over the whole cache (the reference; same numbers).
      live: optional ``[S]`` bool, the slots whose outputs are used: the live-length bound
        is taken over these only (the other slots' hidden states are then meaningless).

    Returns ``(hidden [S,H] or [S,Tn,H], updated cache)``.
    """
    if isinstance(params, LoRAParams):
        raise ValueError("decode takes plain params; merge LoRA adapters first (rljax.models.lora.merge)")
    squeeze = hasattr(tokens, "ndim") and tokens.ndim == 1
    if squeeze:
        tokens = tokens[:, None]
        positions = None if positions is None else positions[:, None]
    _check_tokens(tokens)
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a KVCache, got {type(cache).__name__}")
    s, tn = tokens.shape
    if cache.k.shape[1] != s:
        raise ValueError(f"tokens have {s} slots but the cache has {cache.k.shape[1]}")
    cache_index = jnp.asarray(cache_index, jnp.int32)
    if cache_index.shape != (s,):
        raise ValueError(f"cache_index must have shape ({s},), got {cache_index.shape}")
    if positions is None:
        positions = cache_index[:, None] + jnp.arange(tn, dtype=jnp.int32)[None, :]
    _check_like(positions, tokens, "positions")
    if attention not in ("live", "dense"):
        raise ValueError(f"decode attention={attention!r}; accepted: 'live', 'dense'")
    live = jnp.ones((s,), bool) if live is None else jnp.asarray(live, bool)
    hidden, k, v = merge(graphdef, params).decode(tokens, positions.astype(jnp.int32), cache.k, cache.v, cache_index,
                                                  attention, live)
    if mesh is not None:
        k = with_logical_constraint(k, KV_CACHE_AXES, mesh)
        v = with_logical_constraint(v, KV_CACHE_AXES, mesh)
    return (hidden[:, 0] if squeeze else hidden), KVCache(k=k, v=v)


def init_kv_cache(config: ModelConfig, num_slots: int, max_len: int, *, mesh: Mesh | None = None, dtype=None) -> KVCache:
    """An all-zero cache ``[L, num_slots, max_len, K, D]`` in ``dtype`` (default the compute dtype)."""
    if num_slots <= 0 or max_len <= 0:
        raise ValueError(f"init_kv_cache needs positive num_slots and max_len, got {num_slots} and {max_len}")
    shape = (config.num_layers, num_slots, max_len, config.num_kv_heads, config.head_dim)
    dtype = config.jnp_dtype if dtype is None else dtype
    device = None if mesh is None else kv_cache_sharding(shape, mesh)
    return KVCache(k=jnp.zeros(shape, dtype, device=device), v=jnp.zeros(shape, dtype, device=device))


def kv_cache_shardings(cache: KVCache, mesh: Mesh, *, rules=None) -> KVCache:
    """``NamedSharding`` for each array of ``cache`` (slots on ``dp``, kv heads on ``tp``)."""
    return KVCache(k=kv_cache_sharding(cache.k.shape, mesh, rules=rules), v=kv_cache_sharding(cache.v.shape, mesh, rules=rules))


def insert_kv(cache: KVCache, kv: KVCache, slots) -> KVCache:
    """Copies prefill K/V ``[L,B,T,K,D]`` into cache slots ``slots [B]`` at indices ``0..T-1``."""
    slots = jnp.asarray(slots, jnp.int32)
    b, t = kv.k.shape[1], kv.k.shape[2]
    if slots.shape != (b,):
        raise ValueError(f"slots must have shape ({b},) for a prefill batch of {b}, got {slots.shape}")
    if t > cache.max_len:
        raise ValueError(f"prefill length {t} exceeds the cache max_len {cache.max_len}")
    k = cache.k.at[:, slots, :t].set(kv.k.astype(cache.k.dtype))
    v = cache.v.at[:, slots, :t].set(kv.v.astype(cache.v.dtype))
    return KVCache(k=k, v=v)


# --------------------------------------------------------------------------- unembedding


def unembedding(params: dict) -> jax.Array:
    """The unembedding matrix ``[H, V]`` (the transposed token embedding when tied; LoRA's trained
    copy when ``modules_to_save`` holds ``lm_head``)."""
    params = _split_lora(params)[0]
    return params["lm_head"] if "lm_head" in params else params["embed"].T


def model_config(graphdef) -> ModelConfig:
    """The :class:`ModelConfig` a graphdef (of :func:`split` / :func:`abstract_params`) was built with."""
    for name, attr in graphdef.attributes:
        if name == "config" and isinstance(getattr(attr, "value", None), ModelConfig):
            return attr.value
    raise ValueError("model_config: this graphdef holds no ModelConfig (not an rljax Transformer's)")


def logit_softcap(graphdef) -> float | None:
    """The model's final-logit soft-capping (``ModelConfig.final_logit_softcapping``; Gemma 2: 30),
    to pass as ``softcap`` to :func:`compute_logits` and to the fused log-prob functions."""
    return model_config(graphdef).final_logit_softcapping


def compute_logits(params: dict, hidden: jax.Array, *, softcap: float | None = None) -> jax.Array:
    """``hidden [..., H] @ unembedding [H, V]`` -> float32 logits ``[..., V]``, soft-capped to
    ``softcap * tanh(logits / softcap)`` when ``softcap`` is given (pass :func:`logit_softcap`'s
    value: a Gemma 2 model's logits are capped).

    Tied embeddings are contracted as stored, ``[V, H]``: through ``embed.T`` XLA:CPU copied the
    transposed ``[H, V]`` matrix every call (151,936 x 896 bf16 at Qwen2.5-0.5B: 162 ms a call
    against ~20 ms as stored; ``bench/decode_profile.py``)."""
    base = _split_lora(params)[0]
    if "lm_head" not in base:
        w = base["embed"]
        logits = jnp.einsum("...h,vh->...v", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
    else:
        w = unembedding(params)
        logits = jnp.einsum("...h,hv->...v", hidden, w.astype(hidden.dtype), preferred_element_type=jnp.float32)
    return soft_cap(logits, softcap)
