"""Re-derivations: the values a stage produced, recomputed from the recorded inputs they are a
function of, on every row of every step (the whole-batch invariants compare a value between
two stages; these catch a producer that is itself wrong, which its consumer then agrees with).

* **advantages**: recomputed on device, inside the invariants' one jitted reduction
  (:func:`rljax.trace.invariants.step_facts`), with the configured estimator from the scores
  the advantage stage read (themselves tied to what the reward stage scored, and a sample of
  them re-scored: :mod:`rljax.trace.rescore`), the loss mask the update consumed and group
  ids re-derived from the rows' uids, never the batch's ``group_id`` field; compared with the
  advantages the update consumed (:func:`advantage_error_traced`);
* **group ids**: the partition of the rows by ``group_id`` equals their partition by uid
  (:func:`compare_group_ids`);
* **response mask**: recomputed from where each token came from (the prompt, sampled by the
  policy with a weight version, its EOS, padding, a tool observation: :func:`mask_from_roles`)
  and compared, position by position (digest), with the loss mask the update consumed;
* **positions**: the rotary positions the update read == the count of attended tokens before
  each one (:func:`position_errors_traced`);
* **the update's report** (:func:`compare_update_report`): the rows and tokens the loss
  consumed, per row and per micro-batch, its denominators and its aggregation mode (probed),
  against the batch and the configuration.

Each comparison returns violations in the invariants' format (``step``, ``tensor``, ``stage``,
``key``, ``uid``, ``session``, ``row``, ``detail``) plus ``check``, the re-derivation's name.
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import numpy as np

from rljax.trace.invariants import OBSERVATION_ROLE, position_digest

#: Absolute + relative tolerance of a re-derived advantage (float32, a different program's sums).
ADV_TOL = 1e-4
#: ``rljax.loss.Role``: the policy's own tokens.
ACTION_ROLES = (1, 3)
#: The re-derivations, in the order the trace reports them.
CHECKS = ("advantages", "group_ids", "response_mask", "positions", "update_report")


def violation(check: str, step: int, keys: Sequence[str], i: int, *, tensor: str, stage: str, detail: str,
              sessions=None) -> dict:
    """One named violation of row ``i``."""
    key = keys[i]
    v = {"check": check, "step": int(step), "tensor": tensor, "stage": stage, "key": key,
         "uid": key.rsplit("_", 2)[0], "row": int(i), "detail": detail}
    if sessions is not None:
        v["session"] = int(sessions[i])
    return v


# ------------------------------------------------------------------------- advantages


def estimator_key(name: str, algorithm: Mapping, *, use_kl_in_reward: bool, num_groups: int,
                  critic: bool) -> tuple[Optional[tuple], Optional[str]]:
    """``(static key of the re-derivation, None)`` or ``(None, why it cannot run)``."""
    if use_kl_in_reward:
        return None, "algorithm.use_kl_in_reward: the token rewards hold a KL penalty the trace does not recompute"
    if name == "gae" and not critic:
        return None, "gae without critic values"
    return (name, tuple(sorted(dict(algorithm).items())), int(num_groups)), None


def compare_advantages(step: int, keys, real: np.ndarray, error: np.ndarray, *, estimator: str) -> list[dict]:
    bad = np.nonzero(real & ~(np.asarray(error) <= ADV_TOL))[0]
    return [violation("advantages", step, keys, i, tensor="advantages", stage="advantages",
                      detail=f"the advantages the update consumed differ from {estimator} re-derived from the scores "
                             f"and the uids' groups by {float(error[i]):.3g} (relative; tolerance {ADV_TOL})")
            for i in bad]


# ------------------------------------------------------------------------- group ids


def uid_groups(uids: Sequence[str]) -> np.ndarray:
    """Dense group ids from uids: equal uids, equal ids; numbered by first appearance (``[B]`` int32)."""
    first: dict[str, int] = {}
    return np.array([first.setdefault(u, len(first)) for u in uids], np.int32)


def compare_group_ids(step: int, keys, real: np.ndarray, group_id: np.ndarray, uids: Sequence[str], *,
                      groups: Optional[np.ndarray] = None) -> list[dict]:
    """Rows whose ``group_id`` is not their uid's (the id most of the uid's rows carry), and the
    rows of a uid whose id an earlier uid already holds (two prompts normalised as one group).
    ``groups``: ``uid_groups(uids)`` when the caller has it."""
    group_id = np.asarray(group_id)
    real = np.asarray(real, bool)
    by_uid = (uid_groups(uids) if groups is None else np.asarray(groups))[real].astype(np.int64)
    ids = group_id[real].astype(np.int64)
    if len(ids):  # a one-to-one map between the uids' groups and the group ids: nothing to name (fast path)
        ids = ids - ids.min()
        pairs = np.unique(by_uid * (int(ids.max()) + 1) + ids)
        if len(pairs) == len(np.unique(by_uid)) == len(np.unique(ids)):
            return []
    else:
        return []
    rows_of: dict[str, list[int]] = {}
    for i in np.nonzero(np.asarray(real, bool))[0]:
        rows_of.setdefault(uids[i], []).append(int(i))
    majority = {}
    for uid, rows in rows_of.items():
        ids, counts = np.unique(group_id[rows], return_counts=True)
        majority[uid] = int(ids[np.argmax(counts)])
    holders: dict[int, str] = {}
    for uid, mine in majority.items():
        holders.setdefault(mine, uid)
    owner: dict[int, str] = {}
    out = []
    for uid, rows in rows_of.items():
        mine = majority[uid]
        for i in rows:
            if int(group_id[i]) != mine:
                out.append(violation("group_ids", step, keys, i, tensor="group_id", stage="trajectory_fields",
                                     detail=f"group_id {int(group_id[i])}, the other rows of uid {uid} have {mine}: "
                                            f"the row is grouped with {holders.get(int(group_id[i]), 'no other uid')}"))
        if mine in owner:
            out += [violation("group_ids", step, keys, i, tensor="group_id", stage="trajectory_fields",
                              detail=f"group_id {mine} is also uid {owner[mine]}'s: two prompts' rows in one group")
                    for i in rows]
        owner.setdefault(mine, uid)
    return out


# ------------------------------------------------------------------------- masks from token roles


def mask_from_roles(traj) -> np.ndarray:
    """The response mask re-derived from where each token came from (``[B, T]`` bool).

    A token is the policy's when it lies within the row's response length, was sampled with a
    weight version (``token_version >= 0``: the prompt, padding and tool observations have
    none; EOS is sampled) and, on a multi-turn run, its role is an action (``AGENT_CALL`` /
    ``AGENT_ANSWER``, not ``TOOL_RESULT`` or ``PADDING``); padding rows have none.
    """
    width = traj.response_ids.shape[1]
    within = np.arange(width)[None, :] < np.asarray(traj.response_length)[:, None]
    sampled = np.asarray(traj.token_version) >= 0
    mask = within & sampled & ~np.asarray(traj.is_padding, bool)[:, None]
    roles = getattr(traj, "roles", None)
    if roles is not None:
        mask &= np.isin(np.asarray(roles), ACTION_ROLES)
    return mask


def compare_masks(step: int, keys, real: np.ndarray, traj, update: Mapping, *, stage: str) -> list[dict]:
    """The loss mask the update consumed (its per-row count and position digest, computed on
    device) against :func:`mask_from_roles`."""
    want = mask_from_roles(traj)
    tokens, digest = want.sum(axis=1), position_digest(want)
    got_t, got_d = np.asarray(update["tokens"]).astype(np.int64), np.asarray(update["mask_digest"])
    bad = np.nonzero(np.asarray(real, bool) & ((got_t != tokens) | (got_d != digest)))[0]
    roles = getattr(traj, "roles", None)
    out = []
    for i in bad:
        extra = int(got_t[i]) - int(tokens[i])
        where = ("more" if extra > 0 else "fewer") if extra else "the same count at other"
        length = int(traj.response_length[i])
        detail = (f"the loss mask holds {int(got_t[i])} token(s), the token roles give {int(tokens[i])} "
                  f"({where} positions; response length {length}"
                  + (f", {int((np.asarray(roles[i]) == OBSERVATION_ROLE).sum())} observation token(s)"
                     if roles is not None else "") + ")")
        out.append(violation("response_mask", step, keys, i, tensor="loss_mask", stage=stage, detail=detail,
                             sessions=traj.session))
    return out


# ------------------------------------------------------------------------- positions


def compare_positions(step: int, keys, real: np.ndarray, errors: np.ndarray, *, stage: str) -> list[dict]:
    bad = np.nonzero(np.asarray(real, bool) & (np.asarray(errors) > 0))[0]
    return [violation("positions", step, keys, i, tensor="positions", stage=stage,
                      detail=f"{int(errors[i])} attended position(s) whose rotary position is not the count of "
                             "attended tokens before it (positions restarted or shifted)") for i in bad]


# ------------------------------------------------------------------------- the update's report


def agg_probe_expected(mode: str, *, rows, tokens, inverse_lengths, num_tokens, num_seqs, width: int):
    """What the loss's aggregation of 1 on each row's first loss token sums to over a mini-batch
    in ``mode`` (per pass; NumPy), from the micro-batches' rows, tokens and sums of 1 / length."""
    rows, num_tokens, num_seqs = (np.asarray(x, np.float64) for x in (rows, num_tokens, num_seqs))
    div = lambda a, b: np.where(b > 0, a / np.where(b > 0, b, 1.0), 0.0)  # noqa: E731
    return {"token-mean": lambda: div(rows, num_tokens), "token-sum": lambda: rows,
            "seq-mean-token-sum": lambda: div(rows, num_seqs),
            "seq-mean-token-mean": lambda: div(np.asarray(inverse_lengths, np.float64), num_seqs),
            "seq-mean-token-sum-norm": lambda: div(rows, num_seqs) / width}[mode]()


def compare_update_report(step: int, keys, real: np.ndarray, report: Mapping, row_tokens: np.ndarray, *,
                          epochs: int, mode: Optional[str], modes: Sequence[str], width: int,
                          stage: str = "actor_minibatch") -> list[dict]:
    """The update's report (:func:`rljax.trainer.update_report.update_report`, host arrays) against the batch
    it was given (``row_tokens``: each row's tokens in the loss mask it read) and the configuration
    (``epochs``, ``mode`` = ``actor.loss_agg_mode``)."""
    rows = []
    want = np.asarray(row_tokens, np.float64) * epochs
    got = np.asarray(report["row_tokens"], np.float64)
    for i in np.nonzero(np.asarray(real, bool) & (np.abs(got - want) > 0.5))[0]:
        rows.append(violation("update_report", step, keys, i, tensor="loss_mask", stage=stage,
                              detail=f"the loss consumed {got[i]:g} token(s) of this row over {epochs} epoch(s), the "
                                     f"batch holds {row_tokens[i]:g} per epoch (a micro-batch lost or added the row)"))
    out: list[dict] = []  # the batch's facts first (the mode, the denominators), then the rows
    micro_tokens = np.asarray(report["micro_tokens"], np.float64)
    den = np.asarray(report["denominators"], np.float64).reshape(-1, 2)
    total = float(np.asarray(row_tokens, np.float64).sum()) * epochs
    batch = {"check": "update_report", "step": int(step), "stage": stage, "key": "(batch)", "uid": "(batch)", "row": -1}
    if abs(micro_tokens.sum() - total) > 0.5 and not rows:
        out.append(dict(batch, tensor="loss_mask", detail=f"the micro-batches consumed {micro_tokens.sum():g} loss "
                                                          f"tokens, the batch holds {total:g} over {epochs} epoch(s)"))
    if abs(den[:, 0].sum() - total) > 0.5:
        out.append(dict(batch, tensor="loss", detail=f"the loss's token denominators sum to {den[:, 0].sum():g} over "
                                                     f"the mini-batches, the batch holds {total:g} tokens"))
    code = int(np.asarray(report["agg_mode"]))
    used = modes[code] if 0 <= code < len(modes) else None
    if mode is not None and used is not None and used != mode:
        out.append(dict(batch, tensor="loss", detail=f"the update was built with loss_agg_mode={used}, the "
                                                     f"configuration says {mode}"))
    probe = np.asarray(report["agg_probe"], np.float64)
    if mode is not None and probe.size and np.abs(probe).sum() > 0:
        stats = dict(rows=np.asarray(report["micro_rows"]).sum(-1), tokens=micro_tokens.sum(-1),
                     inverse_lengths=np.asarray(report["micro_inverse_lengths"]).sum(-1),
                     num_tokens=den[:, 0], num_seqs=den[:, 1], width=width)
        want_probe = agg_probe_expected(mode, **stats)
        if not np.allclose(probe, want_probe, rtol=1e-4, atol=1e-6):
            ran = [m for m in modes if np.allclose(probe, agg_probe_expected(m, **stats), rtol=1e-4, atol=1e-6)]
            out.append(dict(batch, tensor="loss", detail=f"the loss aggregated as {' or '.join(ran) or 'no known mode'}"
                                                         f" (probe {probe.tolist()}), the configuration says {mode} "
                                                         f"(expects {want_probe.tolist()})"))
    return out + rows


# ------------------------------------------------------------------------- versions before the update


def future_rows_error(traj, version: int, step: int) -> Optional[str]:
    """A synchronous step's rows were generated with the learner's ``version`` at most: the first row
    claiming a later one, as the line that stops the step before the update (None: none)."""
    future = np.nonzero((np.asarray(traj.max_version) > version) & ~np.asarray(traj.is_padding, bool))[0]
    if not len(future):
        return None
    i = int(future[0])
    key = f"{traj.uid[i]}_{traj.session[i]}_{traj.index[i]}"
    return (f"step {step} tensor max_version at trajectory_fields, {key} (uid {traj.uid[i]}, session "
            f"{int(traj.session[i])}): max_version {int(traj.max_version[i])} > the learner's version {version} "
            f"({len(future)} row(s)); a synchronous step trains only its own version's rows: stopped before the update")
