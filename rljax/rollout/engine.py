"""A JetStream ``Engine`` for the rljax decoder: batched prefill, slot insert, multi-step decode.

Lifecycle (the JetStream contract, plus the batched calls the RL sampler uses)::

    engine = RljaxEngine(config, num_slots=32, max_prefill_length=256, max_decode_length=512, mesh=mesh)
    params = engine.load_params(params)                    # resharded to the sampler layout
    state = engine.init_decode_state(DecodeParams(...))    # KV cache: per layer [slots, K, max_len, D]
    prefix = engine.prefill_batch(params, [[5, 6, 7], [8, 9]])     # one call for many prompts
    state = engine.insert_many(prefix, state, rows=[0, 0, 1], slots=[0, 1, 2], keys=keys)
    state, steps = engine.generate_chunk(params, state, num_steps=16)  # device-side loop
    state, logits = engine.extend_many(params, state, slots=[2], tokens=[obs_ids], keys=turn_keys)  # multi-turn

The single-request JetStream calls (``prefill`` / ``insert`` / ``generate``) are thin
wrappers over the same jitted functions. As in JetStream 0.2's contract, ``prefill``
returns only the prefix; the first response token is sampled by ``insert`` (it is in
``decode_state.out_tokens[slot, 0]``) and each ``generate`` reports the token after.
Do not use JetStream's orchestrator ``Driver``: the released one calls ``jax.tree_map``,
which current JAX removed; :class:`rljax.rollout.Sampler` is the loop that drives this
engine.

Prefix. Prompts are right-padded (real tokens at ``0..len-1``) to a power-of-two length
bucket and a power-of-two batch bucket, so few shapes are compiled. A :class:`Prefix`
holds the K/V of every prompt row, the logits at its last real token and its length; the
first response token is sampled at *insert* time with the slot's own key, so one prefix
serves the ``n`` samples of a group (insert the same row into ``n`` slots).

Extend (multi-turn). A slot whose turn ended (its decode is done) keeps its KV cache;
``extend_many`` appends the slot's pending token and an observation to that cache at the
slot's length in one chunked forward pass (rotary positions continue; the earlier context
is attended to, not recomputed), then samples the slot's next token as ``insert_many``
does, and the slot decodes on. Like JetStream / MaxText chunked prefill the new tokens are
a chunk at an offset, but written straight into the live decode slot rather than into a
prefix that ``insert`` copies back.

Decode state. Per slot: the last sampled token (not yet in the cache), its cache index,
the number of tokens generated, ``active`` / ``done`` flags, the trajectory key, and the
generated tokens and log-probs so far (``[slots, max_decode_length]``). The sampling
temperature / top-k / top-p / max-new-tokens / EOS ids / log-prob mode are arrays in
the state, so changing them does not recompile.

``generate_chunk`` runs up to ``num_steps`` decode steps in one ``lax.while_loop`` and
stops early once every active slot is done or ``exit_after`` slots have finished, so
the host synchronises once per chunk, not once per token. Only active, unfinished slots
advance; the other slots' rows are computed and discarded (``compact`` moves the live
slots into a smaller state, so they stop costing; the :class:`Sampler` does it once no
request waits).

Layout for the decode loop. The KV cache is a :class:`SlotCache`: one ``[S,K,M,D]`` array per
layer (not one stacked ``[L,S,M,K,D]``), and a chunk slices each layer's weights out of
the stacked parameters once, before its step loop; the step's layer loop is unrolled.
So a step reads weights and cache in place: XLA:CPU copied a layer's weights out of the
stacked ``[L, ...]`` arrays and made a transposed copy of every cache block it read, every
step (``bench/sampler_ab.py`` profiles both).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from rljax.models import functional as F
from rljax.models.precision import traced_at
from rljax.models.config import ModelConfig
from rljax.rollout._jetstream import jetstream_api
from rljax.rollout.sampling import DecodeParams, sample_tokens
from rljax.rollout.tokenizer import CHAR_TOKENIZER_PATH, build_jetstream_tokenizer
from rljax.sharding import kv_cache_sharding, reshard, with_logical_constraint
from rljax.sharding.rules import logical_sharding

_api = jetstream_api()
engine_api = _api.engine_api


@flax.struct.dataclass
class Prefix:
    """Prefill result for ``B`` prompt rows (JetStream's ``Prefix``).

    Attributes:
      kv: ``KVCache`` with ``k, v [L, B, T, K, D]`` (``T`` the length bucket).
      logits: ``[B, V]`` float32 logits at each row's last prompt token.
      lengths: ``[B]`` int32 prompt lengths.
      keys: ``uint32 [B, 2]`` keys used by the single-slot :meth:`RljaxEngine.insert`.
    """

    kv: F.KVCache
    logits: jax.Array
    lengths: jax.Array
    keys: jax.Array

    @property
    def batch_size(self) -> int:
        return self.logits.shape[0]


#: Logical axes of one layer's decode cache ``[slots, kv_heads, max_len, head_dim]``.
SLOT_CACHE_AXES = ("cache_batch", "kv_heads", "cache_length", "head_dim")


@flax.struct.dataclass
class SlotCache:
    """The decode state's KV cache: per layer, its own ``k`` and ``v`` arrays ``[S,K,M,D]``.

    One array per layer (not one stacked ``[L, ...]`` array) so the unrolled layer loop of a
    decode step reads and writes each in place, and the length axis after the heads so
    attention's dots read a slot's keys of a head contiguously (see
    :func:`rljax.models.attention.slot_cache_attention`). Entry ``[s, h, j]`` of layer
    ``l`` holds the rotated key / value of head ``h`` of the token at cache index ``j`` of
    slot ``s``; :meth:`stacked` gives the ``KVCache [L,S,M,K,D]`` of ``rljax.models``.
    """

    k: tuple
    v: tuple

    @property
    def num_slots(self) -> int:
        return self.k[0].shape[0]

    def stacked(self) -> F.KVCache:
        """The same entries as a ``KVCache`` ``[L,S,M,K,D]`` (a copy)."""
        stack = lambda xs: jnp.stack([jnp.swapaxes(x, 1, 2) for x in xs])
        return F.KVCache(k=stack(self.k), v=stack(self.v))


def _constrain_cache(cache: SlotCache, mesh) -> SlotCache:
    if mesh is None:
        return cache
    fix = lambda xs: tuple(with_logical_constraint(x, SLOT_CACHE_AXES, mesh) for x in xs)
    return SlotCache(k=fix(cache.k), v=fix(cache.v))


def _decode(graphdef, params, layers, cache: SlotCache, tokens, cache_index, attention, live, mesh):
    """``tokens [S,Tn]`` through the model against ``cache`` (see ``Transformer.decode_slots``);
    ``layers``: the per-layer weights, sliced once per decode chunk."""
    positions = cache_index[:, None] + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    hidden, k, v = F.merge(graphdef, params).decode_slots(layers, tokens, positions, cache.k, cache.v, cache_index,
                                                          attention, live)
    return hidden, _constrain_cache(SlotCache(k=k, v=v), mesh)


def _layers(graphdef, params):
    return F.merge(graphdef, params).layer_states()


@flax.struct.dataclass
class DecodeState:
    """Everything a decode step transforms (JetStream's ``DecodeState``); see the module docstring."""

    cache: SlotCache
    tokens: jax.Array  # [S] int32: last sampled token, written to the cache by the next step
    index: jax.Array  # [S] int32: cache index of `tokens` (= prompt length + generated - 1)
    step: jax.Array  # [S] int32: tokens generated so far
    active: jax.Array  # [S] bool: the slot holds a trajectory
    done: jax.Array  # [S] bool: that trajectory ended (EOS or max_new_tokens)
    keys: jax.Array  # [S, 2] uint32: the trajectory key
    out_tokens: jax.Array  # [S, max_decode_length] int32
    out_logp: jax.Array  # [S, max_decode_length] float32
    temperature: jax.Array  # [] float32 (0: greedy)
    top_k: jax.Array  # [] int32 (0: all)
    top_p: jax.Array  # [] float32
    max_new_tokens: jax.Array  # [] int32
    eos_ids: jax.Array  # [E] int32, padded with -1
    truncated_logprobs: jax.Array  # [] bool: DecodeParams.logprobs == "truncated"


@flax.struct.dataclass
class RljaxResultTokens(engine_api.ResultTokens):
    """JetStream ``ResultTokens`` plus ``log_probs [S, 1]``: the recorded log-prob of each token."""

    log_probs: jax.Array = None

    def convert_to_numpy(self) -> "RljaxResultTokens":
        return RljaxResultTokens(
            np.asarray(self.data), self.tokens_idx, self.valid_idx, self.length_idx, self.samples_per_slot,
            np.asarray(self.log_probs),
        )


def _bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two ``>= n`` (at least ``lo``), capped at ``hi``."""
    return min(hi, max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


def compact_size(n: int, per_octave: int = 1) -> int:
    """The smallest decode-state size ``>= n`` on the compaction ladder with ``per_octave`` sizes an octave.

    The ladder: powers of two up to 8, then multiples of 8 with at most ``log2(per_octave) + 1``
    significant bits (``per_octave`` 1: powers of two; 4: 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, ...).
    Not finer: each size compiles the decode chunk once, and a step over 10 rows costs about
    what one over 16 does (its weight reads dominate).
    """
    if per_octave not in COMPACT_PER_OCTAVE:
        raise ValueError(f"per_octave is {per_octave!r}; accepted: {', '.join(map(str, COMPACT_PER_OCTAVE))}")
    n = max(int(n), 1)
    if n <= 8:
        return 1 << (n - 1).bit_length()
    e = max(0, n.bit_length() - per_octave.bit_length())
    size = -(-n >> e) << e  # n rounded up to its leading log2(per_octave) + 1 bits
    return -(-size // 8) * 8


#: Sizes an octave the compaction ladder accepts (:func:`compact_size`).
COMPACT_PER_OCTAVE = (1, 2, 4)


def compact_sizes(num_slots: int, min_slots: int = 1, per_octave: int = 1) -> tuple[int, ...]:
    """Every size a state of ``num_slots`` slots compacts into (ascending; ``num_slots`` last)."""
    return tuple(sorted({min(num_slots, max(min_slots, compact_size(n, per_octave))) for n in range(1, num_slots + 1)}))


def _pad_eos(eos) -> np.ndarray:
    """EOS ids padded with -1 to a power of two (>= 8) entries, so their count rarely recompiles."""
    eos = np.asarray(eos, np.int32).reshape(-1)
    out = np.full(max(8, 1 << math.ceil(math.log2(max(eos.size, 1)))), -1, np.int32)
    out[: eos.size] = eos
    return out


# --------------------------------------------------------------------------- jitted bodies


def _prefill_impl(graphdef, mesh, params, tokens, lengths):
    t = tokens.shape[1]
    mask = jnp.arange(t)[None, :] < lengths[:, None]
    hidden, kv = F.prefill(graphdef, params, tokens, mask=mask, mesh=mesh)
    last = jnp.take_along_axis(hidden, jnp.maximum(lengths - 1, 0)[:, None, None], axis=1)[:, 0]
    return kv, F.compute_logits(params, last, softcap=F.logit_softcap(graphdef))


def _is_eos(tokens, eos_ids):
    return jnp.any(tokens[:, None] == eos_ids[None, :], axis=-1)


def _sample(state: DecodeState, logits, keys):
    return sample_tokens(
        logits, keys, temperature=state.temperature, top_k=state.top_k, top_p=state.top_p,
        logprobs=state.truncated_logprobs,
    )


def _insert_impl(state: DecodeState, prefix: Prefix, rows, slots, keys, count):
    """Copies prefix rows ``rows[:count]`` into cache slots ``slots[:count]``.

    One ``dynamic_update_slice`` per inserted slot in a device loop, on the donated cache:
    no intermediate of ``count`` prompt caches. Only copies, so the per-prefix-shape
    compilations are cheap; the first token is sampled by :func:`_first_token_impl`,
    compiled once per engine. Entries past ``count`` carry slot ``S`` and are dropped.
    """

    def copy(i, cache):
        def one(c, src, layer):  # prefix [L,B,T,K,D] row -> [1,K,T,D] at slot, index 0
            row = jax.lax.dynamic_slice_in_dim(src[layer], rows[i], 1, axis=0).astype(c.dtype)
            return jax.lax.dynamic_update_slice(c, jnp.swapaxes(row, 1, 2), (slots[i], 0, 0, 0))

        return SlotCache(k=tuple(one(c, prefix.kv.k, l) for l, c in enumerate(cache.k)),
                         v=tuple(one(c, prefix.kv.v, l) for l, c in enumerate(cache.v)))

    cache = jax.lax.fori_loop(0, count, copy, state.cache)
    put = lambda a, x: a.at[slots].set(x, mode="drop")
    safe_rows = jnp.minimum(rows, prefix.batch_size - 1)
    state = state.replace(
        cache=cache,
        index=put(state.index, prefix.lengths[safe_rows]),
        keys=put(state.keys, keys.astype(jnp.uint32)),
    )
    return state, prefix.logits[safe_rows]


def _first_token_impl(state: DecodeState, logits, slots):
    """Samples token 0 of the trajectories just inserted into ``slots`` from their prompt's last logits."""
    keys = state.keys[jnp.minimum(slots, state.keys.shape[0] - 1)]
    tok, logp = _sample(state, logits, jax.vmap(jax.random.fold_in)(keys, jnp.zeros(slots.shape, jnp.uint32)))
    done = _is_eos(tok, state.eos_ids) | (state.max_new_tokens <= 1)
    put = lambda a, x: a.at[slots].set(x, mode="drop")
    return state.replace(
        tokens=put(state.tokens, tok),
        step=put(state.step, jnp.ones_like(tok)),
        active=put(state.active, True),
        done=put(state.done, done),
        out_tokens=state.out_tokens.at[slots, 0].set(tok, mode="drop"),
        out_logp=state.out_logp.at[slots, 0].set(logp, mode="drop"),
    )


def _extend_impl(graphdef, mesh, attention, params, state: DecodeState, tokens, lengths, slots, keys):
    """Appends to live slots' caches in place and resumes them (see :meth:`RljaxEngine.extend_many`).

    Row ``r`` writes, at the cache index of slot ``slots[r]``'s pending token, that token
    followed by ``tokens[r, 1:1 + lengths[r]]`` (column 0 is filled here from
    ``state.tokens``); queries attend to the slot's whole cache, so the earlier context is
    read, never recomputed. The rows' cache slices are gathered, extended by the model's
    chunked decode (positions continue at the slot's length) and scattered back; entries
    with slot ``S`` are padding and are dropped. Returns the state with each slot's first
    resumed token sampled (as after an insert) and the logits it was sampled from.
    """
    s = state.tokens.shape[0]
    safe = jnp.minimum(slots, s - 1)
    real = slots < s
    tokens = tokens.at[:, 0].set(state.tokens[safe])
    start = state.index[safe]
    sub = SlotCache(k=tuple(c[safe] for c in state.cache.k), v=tuple(c[safe] for c in state.cache.v))
    hidden, sub = _decode(graphdef, params, _layers(graphdef, params), sub, tokens, start, attention, real, None)
    last = jnp.take_along_axis(hidden, lengths[:, None, None], axis=1)[:, 0]
    logits = F.compute_logits(params, last, softcap=F.logit_softcap(graphdef))
    scatter = lambda full, part: tuple(c.at[slots].set(x, mode="drop") for c, x in zip(full, part))
    cache = _constrain_cache(SlotCache(k=scatter(state.cache.k, sub.k), v=scatter(state.cache.v, sub.v)), mesh)
    put = lambda a, x: a.at[slots].set(x, mode="drop")
    state = state.replace(cache=cache, index=put(state.index, start + 1 + lengths),
                          keys=put(state.keys, keys.astype(jnp.uint32)))
    return _first_token_impl(state, logits, slots), logits


def _step_impl(graphdef, mesh, params, layers, state: DecodeState, attention="live"):
    """One decode step for every slot; returns ``(state, tokens, logp, live, finished)``.

    ``layers``: the per-layer weights (``Transformer.layer_states``). The live-length
    attention reads only the cache blocks the unfinished slots need."""
    live = state.active & ~state.done
    hidden, cache = _decode(graphdef, params, layers, state.cache, state.tokens[:, None], state.index, attention, live,
                            mesh)
    hidden = hidden[:, 0]
    logits = F.compute_logits(params, hidden, softcap=F.logit_softcap(graphdef))
    keys = jax.vmap(jax.random.fold_in)(state.keys, state.step.astype(jnp.uint32))
    tok, logp = _sample(state, logits, keys)
    rows = jnp.arange(tok.shape[0])
    col = jnp.where(live, state.step, state.out_tokens.shape[1])  # out of range: dropped
    step = state.step + live
    finished = live & (_is_eos(tok, state.eos_ids) | (step >= state.max_new_tokens))
    state = state.replace(
        cache=cache,
        tokens=jnp.where(live, tok, state.tokens),
        index=state.index + live,
        step=step,
        done=state.done | finished,
        out_tokens=state.out_tokens.at[rows, col].set(tok, mode="drop"),
        out_logp=state.out_logp.at[rows, col].set(logp, mode="drop"),
    )
    return state, tok, logp, live, finished


def _layer_states_impl(graphdef, params):
    return _layers(graphdef, params)[1]


def _chunk_impl(graphdef, mesh, attention, params, state: DecodeState, num_steps, exit_after, layer_states=None):
    # each layer's weights sliced out of the stacked [L, ...] params outside the step loop (sliced
    # inside, every step copied them): here once per chunk, or once per weight version when the
    # caller passes them (RljaxEngine.decode_layers); the steps read them in place
    block_def, sliced = _layers(graphdef, params)
    layers = (block_def, sliced if layer_states is None else layer_states)

    def cond(carry):
        i, st, finished = carry
        return (i < num_steps) & jnp.any(st.active & ~st.done) & (finished < exit_after)

    def body(carry):
        i, st, finished = carry
        st, _, _, _, fin = _step_impl(graphdef, mesh, params, layers, st, attention)
        return i + 1, st, finished + jnp.sum(fin, dtype=jnp.int32)

    steps, state, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), state, jnp.int32(0)))
    return state, steps


def _compact_impl(mesh, state: DecodeState, slots, count):
    """A state of ``len(slots)`` slots: new slot ``i < count`` is old slot ``slots[i]``; the rest idle."""
    real = jnp.arange(slots.shape[0]) < count
    take = lambda a: a[slots]
    cache = SlotCache(k=tuple(map(take, state.cache.k)), v=tuple(map(take, state.cache.v)))
    return state.replace(
        cache=_constrain_cache(cache, mesh), tokens=take(state.tokens), index=take(state.index), step=take(state.step),
        active=take(state.active) & real, done=take(state.done) & real, keys=take(state.keys),
        out_tokens=take(state.out_tokens), out_logp=take(state.out_logp),
    )


def _generate_impl(graphdef, mesh, attention, params, state: DecodeState):
    state, tok, logp, live, _ = _step_impl(graphdef, mesh, params, _layers(graphdef, params), state, attention)
    data = jnp.stack([tok, live.astype(jnp.int32), state.step], axis=1)
    return state, RljaxResultTokens(data, (0, 1), (1, 2), (2, 3), 1, logp[:, None])


# --------------------------------------------------------------------------- the engine


class RljaxEngine(engine_api.Engine):
    """JetStream ``Engine`` for an rljax ``ModelConfig``.

    Args:
      config: the model configuration.
      num_slots: concurrent decodes (``max_concurrent_decodes``), static.
      max_prefill_length: longest prompt, in tokens.
      max_decode_length: most tokens generated per request; the cache holds
        ``max_prefill_length + max_decode_length`` entries per slot.
      mesh: the sampler mesh (``dp`` replicas x ``tp``); parameters use the model's
        logical layout on it and the KV cache puts slots on ``dp`` and kv heads on ``tp``.
        ``None``: one device.
      prefill_batch_size: most prompts per prefill call.
      tokenizer_path: what :meth:`get_tokenizer` reports: ``"rljax:char"`` (the default,
        the built-in character tokenizer), a Hugging Face ``tokenizer.json`` file or a
        directory holding one, or a SentencePiece ``.model`` (JetStream's own tokenizer).
      decode_attention: ``"live"`` (default): each decode step reads the KV cache only up to
        the longest unfinished slot, in blocks (``rljax.models.live_decode_attention``), so
        its cost follows the live lengths, not ``max_prefill_length + max_decode_length``;
        ``"dense"``: attend over the whole cache every step (the previous behaviour).
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        num_slots: int,
        max_prefill_length: int,
        max_decode_length: int,
        mesh: Mesh | None = None,
        prefill_batch_size: int = 8,
        tokenizer_path: str = CHAR_TOKENIZER_PATH,
        decode_attention: str = "live",
        matmul_precision: str | None = None,
    ):
        for name, value in (
            ("num_slots", num_slots),
            ("max_prefill_length", max_prefill_length),
            ("max_decode_length", max_decode_length),
            ("prefill_batch_size", prefill_batch_size),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"RljaxEngine: {name} is {value!r}; accepted: an integer >= 1")
        if max_prefill_length + max_decode_length > config.max_position_embeddings:
            raise ValueError(
                f"RljaxEngine: max_prefill_length + max_decode_length = {max_prefill_length + max_decode_length} exceeds "
                f"the model's max_position_embeddings ({config.max_position_embeddings})"
            )
        if decode_attention not in ("live", "dense"):
            raise ValueError(f"RljaxEngine: decode_attention is {decode_attention!r}; accepted: 'live', 'dense'")
        self.config = config
        self.decode_attention = decode_attention
        self._num_slots = int(num_slots)
        self._max_prefill_length = int(max_prefill_length)
        self.max_decode_length = int(max_decode_length)
        self.max_len = self._max_prefill_length + self.max_decode_length
        self.prefill_batch_size = int(prefill_batch_size)
        self._mesh = mesh
        self.tokenizer_path = tokenizer_path
        self.graphdef, _ = F.abstract_params(config)
        #: Calls made and rows processed, for tests and metrics (prefill_calls, prefill_rows,
        #: prefill_tokens, insert_calls, inserted_slots, extend_calls, extended_slots,
        #: extended_tokens, generate_calls, decode_chunks).
        self.stats: Counter = Counter()
        g, m = self.graphdef, mesh
        # matmul_precision (model.matmul_precision; None: JAX's setting): the model programs' matmuls
        at = lambda fn: traced_at(fn, matmul_precision)  # noqa: E731
        self._prefill_fn = jax.jit(at(functools.partial(_prefill_impl, g, m)))
        self._insert_fn = jax.jit(_insert_impl, donate_argnums=0)
        self._first_token_fn = jax.jit(_first_token_impl, donate_argnums=0)
        self._extend_fn = jax.jit(at(functools.partial(_extend_impl, g, m, decode_attention)), donate_argnums=1)
        self._chunk_fn = jax.jit(at(functools.partial(_chunk_impl, g, m, decode_attention)), donate_argnums=1)
        self._generate_fn = jax.jit(at(functools.partial(_generate_impl, g, m, decode_attention)), donate_argnums=1)
        self._compact_fn = jax.jit(functools.partial(_compact_impl, m))
        self._layer_states_fn = jax.jit(at(functools.partial(_layer_states_impl, g)))

    # ----------------------------------------------------------------- properties

    @property
    def max_concurrent_decodes(self) -> int:
        return self._num_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill_length

    @property
    def mesh(self) -> Mesh | None:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None

    @property
    def num_slots(self) -> int:
        return self._num_slots

    # ----------------------------------------------------------------- layout

    def replicated(self):
        if self._mesh is None:
            return SingleDeviceSharding(jax.devices()[0])
        return NamedSharding(self._mesh, PartitionSpec())

    def param_shardings(self) -> Any:
        """The sampler layout of the parameters (a ``NamedSharding`` per leaf)."""
        if self._mesh is None:
            _, shapes = F.abstract_params(self.config)
            return jax.tree.map(lambda _: self.replicated(), shapes)
        return F.param_shardings(self.config, self._mesh)

    def get_prefix_destination_sharding(self) -> Prefix:
        """Shardings of a one-row :class:`Prefix` of ``max_prefill_length`` on this engine's mesh."""
        c = self.config
        shape = (c.num_layers, 1, self._max_prefill_length, c.num_kv_heads, c.head_dim)
        kv = self.replicated() if self._mesh is None else kv_cache_sharding(shape, self._mesh)
        rep = self.replicated()
        return Prefix(kv=F.KVCache(k=kv, v=kv), logits=rep, lengths=rep, keys=rep)

    def load_params(self, params: Any = None, *, seed: int = 0) -> Any:
        """``params`` resharded to :meth:`param_shardings`, or fresh ones from ``seed`` when ``None``.

        The result never shares buffers with ``params``: when a leaf is already in the
        sampler layout (``reshard`` then returns it as is), the tree is copied, so the
        learner may donate or delete its parameters after a weight sync.
        """
        if params is None:
            return F.init_params(self.config, seed=seed, mesh=self._mesh)[1]
        check_params(self.config, params)
        out = reshard(params, self.param_shardings())
        return jax.tree.map(lambda src, dst: jnp.copy(dst) if _shares_buffers(src, dst) else dst, params, out)

    # ----------------------------------------------------------------- tokenizer

    def get_tokenizer(self):
        return _api.tokenizer_pb2.TokenizerParameters(path=self.tokenizer_path)

    def build_tokenizer(self, metadata):
        """A JetStream ``Tokenizer`` for ``metadata.path`` (see ``tokenizer_path``)."""
        path = metadata.path
        if path.endswith(".model"):
            return super().build_tokenizer(metadata)
        c = self.config
        return build_jetstream_tokenizer(
            path, vocab_size=c.vocab_size, eos_id=c.eos_token_id, pad_id=c.pad_token_id, bos_id=c.bos_token_id
        )

    # ----------------------------------------------------------------- prefill

    def check_prompt(self, tokens, *, name: str = "prompt") -> np.ndarray:
        """``tokens`` as ``int32 [len]`` or a ``ValueError`` (empty, too long, bad ids)."""
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"{name} must be a 1-D sequence of integer token ids, got shape {arr.shape} dtype {arr.dtype}")
        if arr.size == 0:
            raise ValueError(f"{name} is empty; every prompt needs at least one token")
        if arr.size > self._max_prefill_length:
            raise ValueError(
                f"{name} has {arr.size} tokens, more than the engine's max_prefill_length ({self._max_prefill_length})"
            )
        bad = (arr < 0) | (arr >= self.config.vocab_size)
        if bad.any():
            raise ValueError(
                f"{name} has token id {int(arr[bad][0])} outside the vocabulary [0, {self.config.vocab_size})"
            )
        return arr.astype(np.int32)

    def prefill_batch(self, params, prompts: Sequence, keys=None) -> Prefix:
        """Prefills several prompts in one call; returns a :class:`Prefix` with one row per prompt.

        Rows are right-padded to a power-of-two length and the batch to a power of two
        (at most ``prefill_batch_size`` prompts per call); padding rows follow the real ones.
        """
        prompts = [self.check_prompt(p, name=f"prompt {i}") for i, p in enumerate(prompts)]
        b = len(prompts)
        if not 1 <= b <= self.prefill_batch_size:
            raise ValueError(f"prefill_batch takes 1 to prefill_batch_size={self.prefill_batch_size} prompts, got {b}")
        t = _bucket(max(len(p) for p in prompts), 8, self._max_prefill_length)
        bp = _bucket(b, 1, max(self.prefill_batch_size, 1))
        tokens = np.zeros((bp, t), np.int32)
        lengths = np.ones((bp,), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
            lengths[i] = len(p)
        kv, logits = self._prefill_fn(params, jnp.asarray(tokens), jnp.asarray(lengths))
        if keys is None:
            keys = np.zeros((bp, 2), np.uint32)
        else:
            keys = np.concatenate([np.asarray(keys, np.uint32).reshape(b, 2), np.zeros((bp - b, 2), np.uint32)])
        self.stats["prefill_calls"] += 1
        self.stats["prefill_rows"] += b
        self.stats["prefill_tokens"] += sum(len(p) for p in prompts)
        return Prefix(kv=kv, logits=logits, lengths=jnp.asarray(lengths), keys=jnp.asarray(keys))

    def prefill(self, *, params, existing_prefix=None, padded_tokens, true_length: int, rng=None) -> Prefix:
        """JetStream single-prompt prefill of ``padded_tokens[:true_length]``.

        ``rng`` (a ``uint32 [2]`` key, default ``PRNGKey(0)``) is the trajectory key the
        single-slot :meth:`insert` samples with. ``existing_prefix`` is not supported.
        """
        if existing_prefix is not None:
            raise ValueError("RljaxEngine.prefill does not continue an existing_prefix; pass existing_prefix=None")
        tokens = np.asarray(padded_tokens).reshape(-1)
        if not isinstance(true_length, (int, np.integer)) or not 1 <= true_length <= tokens.size:
            raise ValueError(f"true_length is {true_length!r}; accepted: an integer in [1, {tokens.size}]")
        key = np.asarray(jax.random.PRNGKey(0) if rng is None else rng, np.uint32).reshape(1, 2)
        return self.prefill_batch(params, [tokens[:true_length]], keys=key)

    # ----------------------------------------------------------------- decode

    def init_decode_state(self, decode: DecodeParams | None = None, *args, **kwargs) -> DecodeState:
        """An empty decode state (zero KV cache) sampling with ``decode`` (default ``DecodeParams()``)."""
        del args, kwargs
        decode = DecodeParams() if decode is None else decode
        self.check_decode(decode)
        s, t = self._num_slots, self.max_decode_length
        cache = self.init_cache(s)
        dev = self.replicated()
        put = lambda x: jax.device_put(x, dev)
        eos = self.eos_ids(decode)
        return DecodeState(
            cache=cache,
            tokens=put(np.zeros(s, np.int32)),
            index=put(np.zeros(s, np.int32)),
            step=put(np.zeros(s, np.int32)),
            active=put(np.zeros(s, bool)),
            done=put(np.zeros(s, bool)),
            keys=put(np.zeros((s, 2), np.uint32)),
            out_tokens=put(np.zeros((s, t), np.int32)),
            out_logp=put(np.zeros((s, t), np.float32)),
            temperature=put(np.float32(decode.temperature)),
            top_k=put(np.int32(decode.top_k)),
            top_p=put(np.float32(decode.top_p)),
            max_new_tokens=put(np.int32(decode.max_new_tokens)),
            eos_ids=put(_pad_eos(eos)),
            truncated_logprobs=put(np.bool_(decode.logprobs == "truncated")),
        )

    def abstract_decode_state(self, decode: DecodeParams | None = None) -> DecodeState:
        """``init_decode_state(decode)`` as shapes, dtypes and this engine's layouts, allocating
        nothing: lowering ``generate_chunk`` with it finds the program the engine compiled (the
        memory ledger measures it that way)."""
        state = jax.eval_shape(lambda: self.init_decode_state(decode))
        rep = self.replicated()
        attach = lambda sharding: lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding(x),
                                                                   weak_type=getattr(x, "weak_type", False))
        cache = jax.tree.map(attach(lambda x: self._cache_sharding(x.shape)), state.cache)
        rest = jax.tree.map(attach(lambda x: rep), state.replace(cache=None))
        return rest.replace(cache=cache)

    def lower_chunk(self, params, decode: DecodeParams | None = None):
        """``generate_chunk`` lowered as the :class:`Sampler` calls it (``layers`` from
        :meth:`decode_layers`), from abstract arguments in this engine's layouts: compiling it
        finds the program the sampler compiled (the memory ledger measures it that way). Its
        arguments: the decode state, the per-layer weight copies and the parameters but the
        stacked layers (unused, so ``jit`` drops them): as many bytes as ``params`` and the state."""
        return self._chunk_fn.lower(params, self.abstract_decode_state(decode), jnp.int32(16),
                                    jnp.int32(self._num_slots + 1), self.abstract_decode_layers(params))

    def abstract_decode_layers(self, params):
        """:meth:`decode_layers` ``(params)`` as shapes, dtypes and layouts, allocating nothing."""
        shapes = jax.eval_shape(self._layer_states_fn, params)
        shardings = self._layer_states_fn.lower(params).compile().output_shardings  # compiled once per layout
        return jax.tree.map(lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), shapes, shardings)

    def _cache_sharding(self, shape):
        return self.replicated() if self._mesh is None else logical_sharding(SLOT_CACHE_AXES, self._mesh, shape=shape)

    def init_cache(self, num_slots: int) -> SlotCache:
        """An all-zero :class:`SlotCache` for ``num_slots`` slots (slots on ``dp``, kv heads on ``tp``)."""
        c = self.config
        shape = (num_slots, c.num_kv_heads, self.max_len, c.head_dim)
        device = self._cache_sharding(shape)
        zeros = lambda: tuple(jnp.zeros(shape, c.jnp_dtype, device=device) for _ in range(c.num_layers))
        return SlotCache(k=zeros(), v=zeros())

    def eos_ids(self, decode: DecodeParams) -> tuple[int, ...]:
        if decode.eos_ids is not None:
            return decode.eos_ids
        return () if self.config.eos_token_id is None else (int(self.config.eos_token_id),)

    def check_decode(self, decode: DecodeParams) -> None:
        if not isinstance(decode, DecodeParams):
            raise ValueError(f"decode must be a rljax.rollout.DecodeParams, got {type(decode).__name__}")
        if decode.max_new_tokens > self.max_decode_length:
            raise ValueError(
                f"DecodeParams.max_new_tokens is {decode.max_new_tokens}; this engine accepts at most "
                f"max_decode_length={self.max_decode_length}"
            )
        for e in self.eos_ids(decode):
            if not 0 <= e < self.config.vocab_size:
                raise ValueError(f"DecodeParams.eos_ids has {e}, outside the vocabulary [0, {self.config.vocab_size})")

    def insert_many(self, prefix: Prefix, decode_state: DecodeState, *, rows, slots, keys) -> DecodeState:
        """Inserts prefix rows ``rows`` into decode ``slots`` (a row may go to several slots).

        Each slot samples its first token from the row's last logits with its own key
        ``keys [R, 2]`` (its trajectory key), then decodes independently.
        """
        rows = np.asarray(rows, np.int32).reshape(-1)
        slots = np.asarray(slots, np.int32).reshape(-1)
        keys = np.asarray(keys, np.uint32).reshape(-1, 2)
        r, s = rows.size, self._num_slots
        if not (slots.size == r == keys.shape[0]) or r > s:
            raise ValueError(
                f"insert_many: rows, slots and keys must have the same length <= {s}, "
                f"got {r}, {slots.size}, {keys.shape[0]}"
            )
        if r and (rows.min() < 0 or rows.max() >= prefix.batch_size or slots.min() < 0 or slots.max() >= s):
            raise ValueError(f"insert_many: rows must be in [0, {prefix.batch_size}) and slots in [0, {s})")
        if len(set(slots.tolist())) != r:
            raise ValueError("insert_many: a slot appears twice")
        pad = s - r  # fixed shapes: pad to num_slots with out-of-range slots (ignored)
        rows = np.concatenate([rows, np.zeros(pad, np.int32)])
        slots = np.concatenate([slots, np.full(pad, s, np.int32)])
        keys = np.concatenate([keys, np.zeros((pad, 2), np.uint32)])
        self.stats["insert_calls"] += 1
        self.stats["inserted_slots"] += r
        slots = jnp.asarray(slots)
        state, logits = self._insert_fn(decode_state, prefix, jnp.asarray(rows), slots, jnp.asarray(keys), jnp.int32(r))
        return self._first_token_fn(state, logits, slots)

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        """JetStream insert: row 0 of ``prefix`` into ``slot``, with the prefix's key.

        Samples the request's first token (``decode_state.out_tokens[slot, 0]``).
        """
        return self.insert_many(prefix, decode_state, rows=[0], slots=[slot], keys=np.asarray(prefix.keys)[:1])

    def extend_many(self, params, decode_state: DecodeState, *, slots, tokens, keys) -> tuple[DecodeState, jax.Array]:
        """Appends tokens to live slots' KV caches in place and resumes their decoding (multi-turn).

        A slot whose decode ended (e.g. on a tool-call stop token) keeps its cache; its last
        sampled token is *pending* (sampled, not yet written). For each ``slots[i]`` this
        writes the pending token and then ``tokens[i]`` (e.g. a tool's observation) into the
        slot's cache from its current length on -- rotary positions continue there -- with
        one chunked forward pass that attends to the cached context (nothing earlier is
        recomputed), sets the slot's key to ``keys[i]`` (the resumed turn's random stream)
        and samples the slot's next token from the logits at its last appended token, as
        :meth:`insert_many` does for a prompt: the slot then decodes on with ``step`` 1.

        Shapes are bucketed like :meth:`prefill_batch` (rows to powers of two from 8, and
        ``1 + len(tokens)`` to powers of two from 8), so few variants compile (callers keep rows per call at most
        ``prefill_batch_size``, as the episode loop does, to bound them); the slots' whole
        cache rows are gathered, extended and scattered back on the donated state, so a
        call moves ``2 x rows x max_len`` cache entries per layer besides its compute.

        Args:
          slots: distinct slots holding a trajectory (inserted before).
          tokens: one 1-D sequence of token ids per slot (may be empty: only the pending
            token is written).
          keys: ``uint32 [R, 2]`` trajectory keys of the resumed turns.

        Returns:
          ``(state, logits [Rb, V])``: rows ``0..R-1`` are the logits each slot's first resumed
          token was sampled from (``Rb >= R`` is the row bucket; slicing on the host side would
          compile a slice per ``R``).
        """
        slots = np.asarray(slots, np.int64).reshape(-1)
        keys = np.asarray(keys, np.uint32).reshape(-1, 2)
        r, s = slots.size, self._num_slots
        if isinstance(tokens, (str, bytes)) or len(tokens) != r or keys.shape[0] != r or not 1 <= r <= s:
            raise ValueError(f"extend_many: slots, tokens and keys must have the same length in [1, {s}], "
                             f"got {r}, {len(tokens) if not isinstance(tokens, (str, bytes)) else 'a string'}, "
                             f"{keys.shape[0]}")
        if slots.min() < 0 or slots.max() >= s or len(set(slots.tolist())) != r:
            raise ValueError(f"extend_many: slots must be distinct and in [0, {s}), got {slots.tolist()}")
        rows = []
        for i, t in enumerate(tokens):
            arr = np.asarray(t).reshape(-1) if np.size(t) else np.zeros(0, np.int32)
            if arr.size and not np.issubdtype(arr.dtype, np.integer):
                raise ValueError(f"extend_many: tokens {i} must be integer token ids, got dtype {arr.dtype}")
            if arr.size and (arr.min() < 0 or arr.max() >= self.config.vocab_size):
                raise ValueError(f"extend_many: tokens {i} has an id outside the vocabulary [0, {self.config.vocab_size})")
            rows.append(arr.astype(np.int32))
        index, active = jax.device_get((decode_state.index, decode_state.active))
        for slot, arr in zip(slots, rows):
            if not active[slot]:
                raise ValueError(f"extend_many: slot {int(slot)} holds no trajectory; insert a prompt first")
            if index[slot] + 1 + arr.size >= self.max_len:
                raise ValueError(f"extend_many: slot {int(slot)} holds {int(index[slot]) + 1} tokens; {arr.size} more "
                                 f"leave no room for the next token in its cache of {self.max_len}")
        t = _bucket(1 + max(a.size for a in rows), 8, self.max_len)
        rb = _bucket(r, min(8, s), s)  # at least 8 rows: observations arrive a few at a time, in every count
        ids = np.zeros((rb, t), np.int32)
        lengths = np.zeros(rb, np.int32)
        for i, arr in enumerate(rows):
            ids[i, 1 : 1 + arr.size] = arr
            lengths[i] = arr.size
        slot_ids = np.concatenate([slots, np.full(rb - r, s)]).astype(np.int32)
        keys = np.concatenate([keys, np.zeros((rb - r, 2), np.uint32)])
        self.stats["extend_calls"] += 1
        self.stats["extended_slots"] += r
        self.stats["extended_tokens"] += int(sum(1 + a.size for a in rows))
        state, logits = self._extend_fn(params, decode_state, jnp.asarray(ids), jnp.asarray(lengths),
                                        jnp.asarray(slot_ids), jnp.asarray(keys))
        return state, logits

    def reprefill_many(self, params, decode_state: DecodeState, *, slots, contexts) -> DecodeState:
        """Recomputes live slots' KV caches with ``params`` (a partial rollout's ``recompute`` at a
        weight install, AReaL's interruptible generation): ``contexts[i]`` (the slot's prompt and
        the tokens its cache holds, ``decode_state.index[slots[i]]`` ids) is prefilled in one call
        (rows and length bucketed as :meth:`prefill_batch`, up to the cache length) and copied over
        the slot's cache from index 0. Nothing is sampled: the slot's pending token (sampled, not
        yet in the cache), its length, key and outputs stay; its next decode step writes the
        pending token with ``params`` and samples on. At most ``prefill_batch_size`` slots a call.
        """
        slots = np.asarray(slots, np.int64).reshape(-1)
        r, s = slots.size, self._num_slots
        if isinstance(contexts, (str, bytes)) or len(contexts) != r or not 1 <= r <= self.prefill_batch_size:
            raise ValueError(f"reprefill_many: slots and contexts must have the same length in "
                             f"[1, prefill_batch_size={self.prefill_batch_size}], got {r} and "
                             f"{len(contexts) if not isinstance(contexts, (str, bytes)) else 'a string'}")
        if slots.min() < 0 or slots.max() >= s or len(set(slots.tolist())) != r:
            raise ValueError(f"reprefill_many: slots must be distinct and in [0, {s}), got {slots.tolist()}")
        rows = [np.asarray(c, np.int32).reshape(-1) for c in contexts]
        index, active, keys = jax.device_get((decode_state.index, decode_state.active, decode_state.keys))
        for slot, arr in zip(slots, rows):
            if not active[slot]:
                raise ValueError(f"reprefill_many: slot {int(slot)} holds no trajectory; insert a prompt first")
            if arr.size != index[slot]:
                raise ValueError(f"reprefill_many: slot {int(slot)} caches {int(index[slot])} tokens; its context has "
                                 f"{arr.size} (give the prompt and every generated token but the last)")
        t = _bucket(max(a.size for a in rows), 8, self.max_len)
        bp = _bucket(r, 1, max(self.prefill_batch_size, 1))
        ids = np.zeros((bp, t), np.int32)
        lengths = np.ones((bp,), np.int32)
        for i, arr in enumerate(rows):
            ids[i, : arr.size] = arr
            lengths[i] = arr.size
        kv, logits = self._prefill_fn(params, jnp.asarray(ids), jnp.asarray(lengths))
        self.stats["reprefill_calls"] += 1
        self.stats["reprefill_slots"] += r
        self.stats["reprefill_tokens"] += int(sum(a.size for a in rows))
        prefix = Prefix(kv=kv, logits=logits, lengths=jnp.asarray(lengths), keys=jnp.zeros((bp, 2), jnp.uint32))
        pad = s - r  # fixed shapes, as insert_many: out-of-range slots are dropped
        row_ids = np.concatenate([np.arange(r), np.zeros(pad, np.int64)]).astype(np.int32)
        slot_ids = np.concatenate([slots, np.full(pad, s)]).astype(np.int32)
        slot_keys = np.concatenate([keys[slots], np.zeros((pad, 2), np.uint32)]).astype(np.uint32)
        state, _ = self._insert_fn(decode_state, prefix, jnp.asarray(row_ids), jnp.asarray(slot_ids),
                                   jnp.asarray(slot_keys), jnp.int32(r))
        return state

    def compact(self, decode_state: DecodeState, slots, *, min_slots: int = 1, per_octave: int = 1) -> DecodeState:
        """A smaller decode state holding only ``slots`` (distinct), for decoding fewer rows.

        New slot ``i`` is old slot ``slots[i]`` (cache, tokens, length, flags, key, outputs);
        the state has the smallest size ``>= len(slots)`` on the ladder of :func:`compact_size`
        (``per_octave`` 1: a power of two; at least ``min_slots``, at most as many as now),
        the extra slots idle.
        A trajectory's tokens do not depend on its slot or on the number of slots (its key is
        its own), so decoding the compacted state continues every trajectory as before, at
        the cost of a step over fewer rows; each size compiles the decode chunk once. Insert
        into and extend only the slots ``< len(slots)`` of the result.
        """
        slots = np.asarray(slots, np.int64).reshape(-1)
        s = decode_state.tokens.shape[0]
        if not 1 <= slots.size <= s or slots.min() < 0 or slots.max() >= s or len(set(slots.tolist())) != slots.size:
            raise ValueError(f"compact: slots must be 1 to {s} distinct slots in [0, {s}), got {slots.tolist()}")
        size = min(s, max(int(min_slots), compact_size(slots.size, per_octave)))
        padded = np.concatenate([slots, np.zeros(size - slots.size, np.int64)]).astype(np.int32)
        self.stats["compactions"] += 1
        return self._compact_fn(decode_state, jnp.asarray(padded), jnp.int32(slots.size))

    def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, RljaxResultTokens]:
        """One decode step for every slot (JetStream ``generate``).

        Returns the new state and :class:`RljaxResultTokens`: per slot the new token,
        whether it is valid (the slot was active and unfinished) and the generated length,
        plus ``log_probs [S, 1]``.
        """
        self.stats["generate_calls"] += 1
        return self._generate_fn(params, decode_state)

    def decode_layers(self, params):
        """Each layer's weights as arrays of their own (copies sliced out of the stacked ``[L, ...]``
        parameters), for :meth:`generate_chunk`'s ``layers``: slice once per weight version, not
        once per chunk. Holds a second copy of the layer weights while kept."""
        return self._layer_states_fn(params)

    def generate_chunk(self, params, decode_state: DecodeState, *, num_steps: int, exit_after: int | None = None,
                       layers=None):
        """Up to ``num_steps`` decode steps on device; returns ``(state, steps_run)``.

        Stops early when no slot is active and unfinished, or once ``exit_after`` slots
        have finished during this chunk (default: never), so freed slots can be refilled.
        ``num_steps`` and ``exit_after`` are traced: changing them does not recompile.
        ``layers``: :meth:`decode_layers` of ``params`` (default: the chunk slices them itself,
        copying every layer's weights once per call).
        """
        self.stats["decode_chunks"] += 1
        exit_after = self._num_slots + 1 if exit_after is None else exit_after
        return self._chunk_fn(params, decode_state, jnp.int32(num_steps), jnp.int32(exit_after), layers)


def _shares_buffers(a, b) -> bool:
    """Whether array ``b`` reuses a device buffer of ``a`` (``device_put`` to an equal layout does)."""
    if a is b:
        return True
    if not isinstance(a, jax.Array) or not isinstance(b, jax.Array):
        return False
    try:
        mine = {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
        return any(s.data.unsafe_buffer_pointer() in mine for s in b.addressable_shards)
    except (RuntimeError, ValueError):  # a platform without raw pointers: copy to be safe
        return True


def check_params(config: ModelConfig, params: Any) -> None:
    """``ValueError`` unless ``params`` has the structure and shapes of ``config``'s model."""
    _, expected = F.abstract_params(config)
    want = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(expected)}
    got = {jax.tree_util.keystr(p): tuple(getattr(x, "shape", ())) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    if want.keys() != got.keys():
        missing = sorted(want.keys() - got.keys())[:3]
        extra = sorted(got.keys() - want.keys())[:3]
        raise ValueError(f"params do not match the model's parameter tree: missing {missing}, unexpected {extra}")
    for key, shape in want.items():
        if got[key] != shape:
            raise ValueError(f"params{key} has shape {got[key]}; the model expects {shape}")
