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
(``{uid}_{session}_{index}``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

#: A prime below 2**16: residues times position weights stay below 2**32 (uint32 on device).
P = 65521
#: ``rljax.loss.Role.TOOL_RESULT``.
OBSERVATION_ROLE = 2


def position_weights(width: int) -> np.ndarray:
    """Per-position weights in ``[1, P)``, distinct for neighbouring positions (uint32)."""
    t = np.arange(width, dtype=np.uint64)
    return ((t * np.uint64(40503) + np.uint64(12345)) % np.uint64(P - 1) + np.uint64(1)).astype(np.uint32)


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


def host_row_facts(mask: np.ndarray, ids: np.ndarray) -> dict:
    """The rollout's per-row facts (the sampler's host arrays)."""
    return {"tokens": (mask != 0).sum(axis=1).astype(np.int32), "mask_digest": position_digest(mask),
            "token_digest": position_digest(mask, ids)}


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
    by_digest: dict[int, list[float]] = {}
    for d, s in zip(np.asarray(scored["digest"]).tolist(), np.asarray(scored["scores"]).tolist()):
        by_digest.setdefault(int(d), []).append(float(s))
    violations, bad = [], 0
    for i in np.nonzero(real)[0]:
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
