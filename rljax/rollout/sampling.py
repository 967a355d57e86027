"""Decode parameters, per-trajectory random streams and the sampling function.

Random streams. Trajectory ``(uid, session)`` under decode seed ``seed`` owns the key
:func:`trajectory_key` ``(seed, uid, session)``; its ``t``-th generated token is drawn
with ``fold_in(key, t)``. Nothing depends on the slot, the batch or the other requests in
flight, so the same trajectory gets the same tokens with 2 slots or 16.

Log-probabilities (``rollout_logp``). With ``temperature > 0`` the default
(``logprobs="tempered"``) records ``log_softmax(logits / temperature)[token]``: the
distribution after temperature and *before* top-k / top-p truncation, which is what the
learner recomputes (``log_softmax(logits / T)``) and what verl/vLLM report.
``logprobs="truncated"`` records the log-prob under the renormalised top-k / top-p
distribution the token was actually drawn from. Greedy decoding (``temperature == 0``)
is a point mass; it records ``log_softmax(logits)[token]`` (temperature 1) instead, so
the values stay usable for importance ratios against a temperature-1 learner.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

LOGPROB_MODES = ("tempered", "truncated")


@dataclasses.dataclass(frozen=True)
class DecodeParams:
    """How one ``Sampler.generate`` call samples; recorded verbatim in the trajectories.

    Attributes:
      max_new_tokens: tokens generated at most per trajectory (EOS included), ``>= 1``.
      temperature: ``0`` for greedy, else ``> 0``.
      top_k: keep the ``top_k`` most likely tokens; ``0`` keeps all.
      top_p: nucleus sampling: the smallest set of most likely tokens whose probability
        (after top-k) reaches ``top_p``; ``1.0`` keeps all. In ``(0, 1]``.
      seed: root of every trajectory's random stream (see the module docstring).
      eos_ids: token ids that end a trajectory (the EOS is kept in the response, with
        ``response_mask = 1``). ``None``: the model config's ``eos_token_id`` (none if unset).
      logprobs: ``"tempered"`` (default) or ``"truncated"``; see the module docstring.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos_ids: tuple[int, ...] | None = None
    logprobs: str = "tempered"

    def __post_init__(self):
        if isinstance(self.eos_ids, (int, np.integer)):
            object.__setattr__(self, "eos_ids", (int(self.eos_ids),))
        elif self.eos_ids is not None:
            object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
        _positive_int(self.max_new_tokens, "max_new_tokens")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"DecodeParams.top_k is {self.top_k!r}; accepted: an integer >= 0 (0 keeps every token)")
        number = isinstance(self.temperature, (int, float, np.floating, np.integer))
        if not number or not np.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"DecodeParams.temperature is {self.temperature!r}; accepted: 0 (greedy) or a finite number > 0")
        if not isinstance(self.top_p, (int, float, np.floating, np.integer)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"DecodeParams.top_p is {self.top_p!r}; accepted: a number in (0, 1]")
        if isinstance(self.seed, bool) or not isinstance(self.seed, (int, np.integer)) or not 0 <= self.seed < 2**32:
            raise ValueError(f"DecodeParams.seed is {self.seed!r}; accepted: an integer in [0, 2**32)")
        if self.logprobs not in LOGPROB_MODES:
            raise ValueError(f"DecodeParams.logprobs is {self.logprobs!r}; accepted: {', '.join(LOGPROB_MODES)}")
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> "DecodeParams":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"DecodeParams.{name} is {value!r}; accepted: an integer >= 1")


# --------------------------------------------------------------------------- random streams


def uid_hash(uid) -> tuple[int, int]:
    """Two stable 32-bit words from ``str(uid)`` (blake2b; not Python's salted ``hash``)."""
    digest = hashlib.blake2b(str(uid).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


@jax.jit
def _keys(seed, words, sessions):
    def one(w, s):
        key = jax.random.PRNGKey(seed)
        key = jax.random.fold_in(jax.random.fold_in(key, w[0]), w[1])
        return jax.random.fold_in(key, s)

    return jax.vmap(one)(words, sessions)


def trajectory_keys(seed: int, uids: Sequence, sessions: Sequence[int]) -> np.ndarray:
    """Raw threefry keys ``uint32 [N, 2]``, one per ``(uid, session)``, from decode ``seed``."""
    words = np.asarray([uid_hash(u) for u in uids], np.uint32).reshape(-1, 2)
    sessions = np.asarray(sessions, np.uint32).reshape(-1)
    n = len(sessions)
    # rows padded to a power of two: one compile per size bucket, not per row count (multi-turn
    # rounds, async batches and validation ask for many different counts); each key is per row
    size = 1 << max(3, (n - 1).bit_length())
    words = np.pad(words, ((0, size - n), (0, 0)))
    sessions = np.pad(sessions, (0, size - n))
    return np.asarray(_keys(np.uint32(seed), words, sessions))[:n]


def trajectory_key(seed: int, uid, session: int) -> np.ndarray:
    """The key ``uint32 [2]`` of one trajectory; token ``t`` uses ``fold_in(key, t)``."""
    return trajectory_keys(seed, [uid], [session])[0]


# --------------------------------------------------------------------------- sampling


def _ordered_key(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (``-inf`` lowest): flip negatives, set the sign bit of the rest."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_threshold(keys: jax.Array, reaches) -> jax.Array:
    """Per row, the largest ``t`` (uint32) with ``reaches(keys >= t)`` true, by bisection.

    ``reaches`` must be monotone (true for a set, then true for every superset) and true
    for the full row. 32 halvings of the uint32 range make the result exact: it is one of
    the row's keys. Costs 32 passes over ``[S, V]`` instead of a sort.
    """
    lo = jnp.zeros(keys.shape[:-1], jnp.uint32)
    hi = jnp.max(keys, axis=-1)  # reaches(keys >= lo) holds; probe up to hi inclusive

    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo + 1) // 2  # in (lo, hi] while lo < hi
        ok = reaches(keys >= mid[..., None]) & (lo < hi)
        return jnp.where(ok, mid, lo), jnp.where(ok | (lo >= hi), hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 33, body, (lo, hi))
    return lo


def truncate_logits(scaled: jax.Array, top_k, top_p) -> jax.Array:
    """Sets logits outside the top-k, then top-p (nucleus), set to ``-inf``.

    Args:
      scaled: ``[..., V]`` float32 logits (already divided by the temperature).
      top_k: int (may be traced); ``0`` keeps all.
      top_p: float (may be traced) in ``(0, 1]``; ``1`` keeps all.

    Top-p is applied to the distribution renormalised after top-k (as in HF
    ``generate``): it keeps the most likely tokens up to and including the first one at
    which the cumulative probability reaches ``top_p``. Tokens tied with the last kept
    one are kept too. Both cut-offs are found by bisection on the values (exact, no sort).
    """
    scaled = scaled.astype(jnp.float32)
    v = scaled.shape[-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
    key = _ordered_key(scaled)
    no_cut = jnp.zeros(key.shape[:-1], jnp.uint32)  # every key is >= 0
    kth = jax.lax.cond(k < v, lambda: _largest_threshold(key, lambda m: jnp.sum(m, axis=-1) >= k), lambda: no_cut)
    in_k = key >= kth[..., None]
    probs = jax.nn.softmax(jnp.where(in_k, scaled, -jnp.inf), axis=-1)
    # Largest probability p* whose set {p >= p*} holds at least top_p of the mass. The
    # float32 rounding of the masses decides exact ties with top_p, as a cumsum would.
    pkey = jax.lax.bitcast_convert_type(probs, jnp.uint32)  # probs >= 0: bit order is value order
    target = jnp.minimum(top_p, jnp.sum(probs, axis=-1))  # once, not in every bisection step
    mass = lambda m: jnp.sum(jnp.where(m, probs, 0.0), axis=-1) >= target
    pth = jax.lax.cond(top_p < 1.0, lambda: _largest_threshold(pkey, mass), lambda: no_cut)
    keep = in_k & (pkey >= pth[..., None])
    return jnp.where(keep, scaled, -jnp.inf)


def first_argmax(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` (the first maximum; the first NaN when a row holds one) as plain
    reductions: XLA:CPU runs argmax's (value, index) reduce element by element; a max and a min
    over a masked iota vectorise (1.2 ms -> 0.1 ms a decode step over ``[16, 8192]`` logits). The
    iota is float32 (exact below ``2**24`` columns): float min reductions vectorise on XLA:CPU."""
    nan = jnp.isnan(x)  # XLA:CPU's max may skip NaNs: find them apart
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == jnp.max(x, axis=-1, keepdims=True))
    iota = jax.lax.broadcasted_iota(jnp.float32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, iota, jnp.float32(x.shape[-1])), axis=-1).astype(jnp.int32)


#: Columns per block of :func:`categorical`'s two-level inverse-CDF draw.
BLOCK = 128


def _last_positive(mass: jax.Array) -> jax.Array:
    """Per row, the last index of ``mass [..., N]`` (non-negative) that is positive (0 if none)."""
    iota = jax.lax.broadcasted_iota(jnp.float32, mass.shape, mass.ndim - 1)
    return jnp.max(jnp.where(mass > 0, iota, 0.0), axis=-1).astype(jnp.int32)


def _pick(mass: jax.Array, u: jax.Array) -> jax.Array:
    """Per row, index ``i`` of ``mass [S, N]`` with probability ``mass[i] / sum(mass)``, by the
    uniform ``u [S]`` in ``[0, 1)``: the first ``i`` whose inclusive cumulative mass exceeds
    ``u * total``; rounding past the end picks the last index with positive mass."""
    cum = jnp.cumsum(mass, axis=-1)
    r = u * cum[:, -1]
    i = jnp.sum((cum <= r[:, None]).astype(jnp.int32), axis=-1)
    return jnp.minimum(i, _last_positive(mass))


def categorical(dist: jax.Array, keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One draw per row from ``softmax(dist)`` (``dist [S, V]`` float32, ``-inf`` excluded);
    returns ``(tokens [S] int32, logsumexp(dist) [S])``.

    Two-level inverse CDF with two uniforms of the row's key: the first picks a block of
    :data:`BLOCK` columns with probability its mass, the second a column inside it with
    probability its share of the block. The product is exactly ``softmax(dist)`` (up to
    float32 rounding of the masses: each level's cumulative sums hold a few hundred to a
    thousand terms, so no token's probability moves by more than ~1e-4 of itself); it costs
    one ``exp`` pass over ``[S, V]`` (shared with the log-normaliser) instead of the
    ``S x V`` random numbers, two logs and an argmax of Gumbel-max.
    """
    s, v = dist.shape
    nb = -(-v // BLOCK)
    top = jnp.max(dist, axis=-1)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.exp(dist - top[:, None])
    blocks = jnp.pad(p, ((0, 0), (0, nb * BLOCK - v))).reshape(s, nb, BLOCK)
    mass = jnp.sum(blocks, axis=-1)  # [S, nb]
    u = jax.vmap(lambda k: jax.random.uniform(k, (2,), jnp.float32))(keys)
    b = _pick(mass, u[:, 0])
    row = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]  # [S, BLOCK]
    tokens = b * BLOCK + _pick(row, u[:, 1])
    return tokens, top + jnp.log(jnp.sum(mass, axis=-1))


def _logsumexp(x: jax.Array) -> jax.Array:
    top = jnp.max(x, axis=-1)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    return top + jnp.log(jnp.sum(jnp.exp(x - top[:, None]), axis=-1))


def sample_tokens(logits: jax.Array, keys: jax.Array, *, temperature, top_k, top_p, logprobs="tempered"):
    """Draws one token per row and returns ``(tokens [S] int32, logp [S] float32)``.

    Args:
      logits: ``[S, V]`` float32.
      keys: ``uint32 [S, 2]``: one key per row (``fold_in(trajectory_key, t)``).
      temperature, top_k, top_p: scalars (may be traced); ``temperature == 0`` is greedy.
      logprobs: ``"tempered"`` or ``"truncated"`` (see the module docstring), or a
        (possibly traced) bool scalar, True for ``"truncated"``.

    Sampling draws from ``softmax(truncated_logits)`` with :func:`categorical` (two uniforms
    of the row's key), so a row's token depends only on its logits and its key. The
    log-probs come from one log-normaliser per row, not a ``log_softmax`` over ``[S, V]``.
    """
    if isinstance(logprobs, str):
        if logprobs not in LOGPROB_MODES:
            raise ValueError(f"logprobs is {logprobs!r}; accepted: {', '.join(LOGPROB_MODES)}")
        logprobs = logprobs == "truncated"
    logprobs = jnp.asarray(logprobs, jnp.bool_)
    logits = logits.astype(jnp.float32)

    def greedy(_):
        tokens = first_argmax(logits)
        return tokens, _pick_value(logits, tokens) - _logsumexp(logits)

    def sample(_):
        scaled = logits / temperature
        truncating = (top_k > 0) | (top_p < 1.0)
        truncated = jax.lax.cond(truncating, lambda x: truncate_logits(x, top_k, top_p), lambda x: x, scaled)
        tokens, norm = categorical(truncated, keys)
        # the tempered normaliser differs from the drawn one only when a truncation ran
        norm = jax.lax.cond(truncating & ~logprobs, _logsumexp, lambda _: norm, scaled)
        return tokens, _pick_value(scaled, tokens) - norm

    # A real branch (the predicate is a scalar): greedy steps draw no random numbers.
    tokens, logp = jax.lax.cond(temperature == 0, greedy, sample, None)
    return tokens.astype(jnp.int32), logp


def _pick_value(x: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0]
