"""Whole-batch invariants: every row of every step, reduced on device where the data lives.

The traced groups (``trace.groups``) give field-level detail for a few rows; these checks
cover all of them with a few reductions per step (one int per row and invariant comes to
the host, never the ``[B, T]`` arrays the learner holds):

* **policy tokens**: per row, the tokens of the ``loss_mask`` the update consumed == the
  policy tokens of the rollout (its ``loss_mask``: ``response_mask`` less padding rows);
* **mask positions**: a position-sensitive per-row digest of that mask
  (:func:`position_digest`) agrees between the rollout and the update, so a mask shifted by
  one position (same count) is caught;
* **tokens under the mask**: the same digest over the response token ids the update read
  (``input_ids``' response columns) agrees with the rollout's ``response_ids``;
* **versions**: no row with ``max_version`` > the learner's version at the update;
* **observations**: no observation token (``roles == TOOL_RESULT``, multi-turn runs) with
  mask 1 in the update's ``loss_mask``;
* **rewards tied to trajectories**: the reward stage records, per row, the digest of the
  response tokens it scored and the score; each row's score as the advantage stage read it
  must be the one recorded for the digest of that row's trajectory (a swap is named by uid).

A violation names the tensor, the step, the stage and the row's trajectory key
(``{uid}_{session}_{index}``). All the device-side facts of a step come from one jitted
reduction and one transfer (:func:`step_facts`). Several processes: each checks the rows it
generated and the tracer all-gathers the verdicts.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Optional

import numpy as np

from rljax import loss as rl
from rljax.sharding import to_host
from rljax.trace.groups import member  # noqa: F401 -- re-exported (its callers read it here)

#: A prime below 2**16: residues times position weights stay below 2**32 (uint32 on device).
P = 65521
#: ``rljax.loss.Role.TOOL_RESULT``.
OBSERVATION_ROLE = 2


@functools.lru_cache(maxsize=64)
def position_weights(width: int) -> np.ndarray:
    """Per-position weights in ``[1, P)``, distinct for neighbouring positions (uint32, read-only)."""
    t = np.arange(width, dtype=np.uint64)
    w = ((t * np.uint64(40503) + np.uint64(12345)) % np.uint64(P - 1) + np.uint64(1)).astype(np.uint32)
    w.flags.writeable = False
    return w


def position_digest(mask, ids=None):
    """Per row, ``sum_t mask[t] * w(t) * (ids[t] mod P + 1)  mod P`` (``ids`` None: 1).

    Works on NumPy and on jax arrays alike (``[B, T]`` -> ``[B]`` uint32); extra columns of
    zeros (a learner width rounded up to a multiple of ``sp``) do not change it.
    """
    xp = np if isinstance(mask, np.ndarray) else _jnp()
    width = mask.shape[1]
    w = xp.asarray(position_weights(width))
    m = (mask != 0).astype(xp.uint32)
    term = m * w
    if ids is not None:  # < P * P < 2**32
        term = (term * (ids.astype(xp.uint32) % xp.uint32(P) + xp.uint32(1))) % xp.uint32(P)
    return xp.sum(term, axis=1, dtype=xp.uint32) % xp.uint32(P)  # < T * P < 2**32 for T < 65537


def _jnp():
    import jax.numpy as jnp

    return jnp


def device_row_facts_traced(loss_mask, response_ids=None, observations=None) -> dict:
    """The update's per-row facts (jit this: a few reductions, ``[B]`` ints out)."""
    jnp = _jnp()
    out = {"tokens": jnp.sum(loss_mask != 0, axis=1, dtype=jnp.int32), "mask_digest": position_digest(loss_mask)}
    if response_ids is not None:
        out["token_digest"] = position_digest(loss_mask, response_ids)
    if observations is not None:
        out["observation_tokens"] = jnp.sum((loss_mask[:, :observations.shape[1]] != 0) & observations, axis=1,
                                            dtype=jnp.int32)
    return out


def _fact_names(with_ids: bool, with_obs: bool) -> list[str]:
    return ["tokens", "mask_digest"] + ["token_digest"] * with_ids + ["observation_tokens"] * with_obs


#: dtype of each per-row fact (they travel to the host as one ``uint32`` array, bit for bit).
_FACT_DTYPES = {"tokens": np.int32, "mask_digest": np.uint32, "token_digest": np.uint32,
                "observation_tokens": np.int32, "row_sum": np.float32, "scores": np.float32,
                "advantage_error": np.float32, "position_errors": np.int32}


@functools.lru_cache(maxsize=None)
def _step_facts_fn(estimator: Optional[tuple] = None):
    import jax
    import jax.numpy as jnp

    def facts(pairs, observations, row_sum_mask, scores, advantages, positions, passthrough, counts):
        rows = []
        for lm, ids in pairs:
            resp = None if ids is None else ids[:, ids.shape[1] - lm.shape[1]:]  # the response columns
            f = device_row_facts_traced(lm, resp, observations)
            rows += [f[k] for k in _fact_names(ids is not None, observations is not None)]
        if row_sum_mask is not None:
            rows.append(jnp.sum(row_sum_mask, axis=1).astype(jnp.float32))
        if scores is not None:
            rows.append(scores.astype(jnp.float32))
        if advantages is not None:
            rows.append(advantage_error_traced(scores=scores, estimator=estimator, **advantages))
        if positions is not None:
            rows.append(position_errors_traced(*positions))
        rows += [passthrough[k].astype(jnp.int32) for k in sorted(passthrough)]
        rows += [jnp.sum(counts[k], axis=1).astype(jnp.int32) for k in sorted(counts)]
        return jnp.stack([jax.lax.bitcast_convert_type(r, jnp.uint32) for r in rows])

    return jax.jit(facts)


def host_memory() -> bool:
    """One process whose devices are CPUs: the batch's shards are host memory, so the facts are
    computed from one host copy of the inputs (one single-device program) rather than by a program
    over every simulated device (on CPU its dispatch costs more than the copy)."""
    import jax

    return jax.process_count() == 1 and jax.default_backend() == "cpu"


def step_facts(pairs, observations=None, row_sum_mask=None, scores=None, *, advantages: Optional[dict] = None,
               estimator: Optional[tuple] = None, positions: Optional[tuple] = None,
               passthrough: Optional[dict] = None, counts: Optional[dict] = None,
               on_host: Optional[bool] = None) -> tuple[list[dict], dict]:
    """Every device-side fact of a step in one jitted reduction and one host transfer.

    ``pairs``: the distinct ``(loss_mask [B, T'], input_ids [B, S + T'] or None)`` the learner
    stages read; ``observations``: ``[B, T]`` bool (multi-turn) or None; ``row_sum_mask``: a
    ``[B, T']`` mask whose per-row sums the trace records also (None: skipped); ``scores``: the
    ``[B]`` scores the advantage stage read (None: skipped). Re-derivations
    (:mod:`rljax.trace.rederive`): ``advantages`` (needs ``scores``): ``{"advantages", "loss_mask",
    "group_ids", "row_mask"[, "values"]}``, the advantages the update consumed and the inputs to
    recompute them from with ``estimator`` (:func:`rljax.trace.rederive.estimator_key`), giving
    ``advantage_error`` per row; ``positions``: ``(attention_mask, positions)`` the update read,
    giving ``position_errors`` per row; ``passthrough``: ``{name: [B] int array}`` brought to the
    host as they are (e.g. ``group_id``); ``counts``: ``{name: [B, X] int array}`` summed per row,
    as ``count/<name>`` (e.g. the attended tokens of ``attention_mask``). Returns ``(facts per pair, {"row_sum", "scores",
    "advantage_error", "position_errors"})`` as NumPy arrays. The per-row facts are computed on
    device and only ``[k, B]`` 32-bit values (stacked, bit-cast to ``uint32``) come to the host:
    the reduction and the transfer are one dispatch each however many facts there are. Several
    processes: every process calls it (the arrays are global) and receives every row (one all-gather).
    """
    pairs = tuple((lm, ids) for lm, ids in pairs)
    if advantages is not None and scores is None:
        raise ValueError("step_facts: re-deriving the advantages needs the scores they were computed from")
    fn = _step_facts_fn(estimator if advantages is not None else None)
    passthrough, counts = dict(passthrough or {}), dict(counts or {})
    args = (pairs, observations, row_sum_mask, scores, advantages, positions, passthrough, counts)
    if on_host is None:
        on_host = host_memory()
    if on_host:  # one batched copy of every input; each array keeps its host copy for the tracer's later reads
        import jax

        args = jax.device_get(args)
    stacked = np.asarray(to_host(fn(*args)))
    names = [n for lm, ids in pairs for n in _fact_names(ids is not None, observations is not None)]
    names += ["row_sum"] * (row_sum_mask is not None) + ["scores"] * (scores is not None)
    names += ["advantage_error"] * (advantages is not None) + ["position_errors"] * (positions is not None)
    names += sorted(passthrough) + [f"count/{k}" for k in sorted(counts)]
    values = [stacked[i].view(_FACT_DTYPES.get(n, np.int32)) for i, n in enumerate(names)]
    per_pair, i = [], 0
    for lm, ids in pairs:
        keys = _fact_names(ids is not None, observations is not None)
        per_pair.append(dict(zip(keys, values[i:i + len(keys)])))
        i += len(keys)
    return per_pair, dict(zip(names[i:], values[i:]))


# ------------------------------------------------------------------------- re-derivations on device
# (rljax.trace.rederive compares their results on the host)


def outcome_token_rewards_traced(scores, mask):
    """Each row's score on its last loss token, 0 elsewhere (``[B, T]``; jax)."""
    jnp = _jnp()
    on = mask > 0
    t = jnp.arange(mask.shape[1])
    last = jnp.max(jnp.where(on, t[None, :], -1), axis=1)
    return jnp.where(t[None, :] == last[:, None], scores[:, None].astype(jnp.float32), 0.0)


def advantage_error_traced(*, scores, estimator: tuple, advantages, loss_mask, group_ids, row_mask, values=None):
    """Per row, ``max_t |consumed - re-derived| / (1 + |re-derived|)`` over every column (``[B]`` float32)."""
    jnp = _jnp()
    name, algorithm, num_groups = estimator
    mask = jnp.asarray(loss_mask, jnp.float32)[:, :advantages.shape[1]]
    fn = rl.get_adv_estimator(name)
    want, _ = fn(outcome_token_rewards_traced(scores, mask), mask, group_id=jnp.asarray(group_ids, jnp.int32),
                 num_groups=num_groups, row_mask=jnp.asarray(row_mask, bool), values=values, config=dict(algorithm))
    want = jnp.asarray(want, jnp.float32)
    err = jnp.abs(advantages.astype(jnp.float32) - want) / (1.0 + jnp.abs(want))
    return jnp.max(jnp.where(jnp.isfinite(err), err, jnp.inf), axis=1)


def position_errors_traced(attention_mask, positions):
    """Per row, attended columns whose rotary position is not the count of attended columns
    before it (``[B]`` int32; jax)."""
    jnp = _jnp()
    attn = attention_mask.astype(jnp.int32)
    want = jnp.cumsum(attn, axis=1) - 1
    return jnp.sum((attn > 0) & (positions != want), axis=1, dtype=jnp.int32)


def host_row_facts(mask: np.ndarray, ids: np.ndarray) -> dict:
    """The rollout's per-row facts (the sampler's host arrays)."""
    return {"tokens": (mask != 0).sum(axis=1).astype(np.int32), "mask_digest": position_digest(mask),
            "token_digest": position_digest(mask, ids)}


class RowKeys(Sequence):
    """The trajectory keys ``{uid}_{session}_{index}`` of a batch's rows, made only for the rows a
    violation names (a step's checks build none when every row holds)."""

    def __init__(self, traj):
        self._traj = traj

    def __len__(self) -> int:
        return len(self._traj.uid)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        t = self._traj
        return f"{t.uid[i]}_{t.session[i]}_{t.index[i]}"


def compare(step: int, keys, real: np.ndarray, rollout: dict, update: dict, *, stage: str = "actor_minibatch",
            max_version: Optional[np.ndarray] = None, learner_version: Optional[int] = None,
            limit: int = 5) -> tuple[dict, list[dict]]:
    """``(counts, violations)``: every real row of the step against the invariants above."""
    violations: list[dict] = []
    rows = np.nonzero(real)[0]

    def add(tensor, i, detail):
        if len(violations) < limit:
            violations.append({"step": int(step), "tensor": tensor, "stage": stage, "key": keys[i],
                               "uid": keys[i].rsplit("_", 2)[0], "row": int(i), "detail": detail})

    tok_u, tok_r = np.asarray(update["tokens"]).astype(np.int64), np.asarray(rollout["tokens"]).astype(np.int64)
    bad_tokens = tok_u != tok_r
    bad_mask = ~bad_tokens & (np.asarray(update["mask_digest"]) != np.asarray(rollout["mask_digest"]))
    bad_ids = (~bad_tokens & ~bad_mask & (np.asarray(update["token_digest"]) != np.asarray(rollout["token_digest"]))
               if "token_digest" in update else np.zeros(len(real), bool))
    obs = np.asarray(update.get("observation_tokens", np.zeros(len(real), np.int64)))
    future = (np.asarray(max_version) > learner_version if max_version is not None and learner_version is not None
              else np.zeros(len(real), bool))
    bad = real & (bad_tokens | bad_mask | bad_ids | (obs > 0) | future)
    counts = {"rows": int(len(rows)), "violations": int(bad.sum())}
    for i in np.nonzero(bad)[0][:limit]:  # vectorised above; only the rows to name are visited
        if bad_tokens[i]:
            add("loss_mask", i, f"{tok_u[i]} loss tokens in the update, {tok_r[i]} policy tokens in the rollout")
        elif bad_mask[i]:
            add("loss_mask", i, "same token count, different positions: the update's loss_mask is not the "
                                "rollout's (shifted or moved)")
        elif bad_ids[i]:
            add("input_ids", i, "the response tokens under the mask differ between the rollout and the update")
        if obs[i]:
            add("loss_mask", i, f"{int(obs[i])} observation token(s) with mask 1")
        if future[i]:
            add("max_version", i, f"max_version {int(max_version[i])} > the learner's version {learner_version}")
    return counts, violations


def compare_scores(step: int, keys, real: np.ndarray, digest: np.ndarray, scored: dict, read: np.ndarray, *,
                   limit: int = 5) -> tuple[dict, list[dict]]:
    """Each real row's score as the advantage stage read it == the score the reward stage gave the
    trajectory with that row's digest (``scored``: ``{"digest", "scores"}`` per row, as scored)."""
    scored_digest = np.asarray(scored["digest"], np.uint32)
    scored_scores = np.asarray(scored["scores"], np.float32)
    read = np.asarray(read, np.float32)
    # A row whose (digest, score) is exactly a scored pair passes (vectorised); the others are
    # looked at one by one, with a tolerance, and named.
    exact = member(_pair_keys(np.asarray(digest, np.uint32), read), _pair_keys(scored_digest, scored_scores))
    rest = np.nonzero(real & ~(exact & np.isfinite(read)))[0]
    by_digest: dict[int, list[float]] = {}
    if len(rest):
        for d, s in zip(scored_digest.tolist(), scored_scores.tolist()):
            by_digest.setdefault(int(d), []).append(float(s))
    violations, bad = [], 0
    for i in rest:
        want = by_digest.get(int(digest[i]))
        if want is None:
            detail, tensor = "no score was computed for this trajectory's response tokens", "response_ids"
        elif not any(abs(float(read[i]) - w) <= 1e-6 * max(1.0, abs(w)) for w in want):
            detail, tensor = (f"score {float(read[i]):g} read by the advantages, the reward stage scored this "
                              f"trajectory {want[0]:g}"), "scores"
        else:
            continue
        bad += 1
        if len(violations) < limit:
            violations.append({"step": int(step), "tensor": tensor, "stage": "advantages", "key": keys[i],
                               "uid": keys[i].rsplit("_", 2)[0], "row": int(i), "detail": detail})
    return {"violations": bad}, violations


def _pair_keys(digest: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """``digest << 32 | the score's float32 bits``, one uint64 per row."""
    return (digest.astype(np.uint64) << np.uint64(32)) | scores.astype(np.float32).view(np.uint32).astype(np.uint64)
