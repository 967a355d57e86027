"""Fault hooks: data-flow bugs provoked on purpose, so tests can show the trace catches them.

A fault is switched on by name, in-process (:func:`enable`) or for a launched run through
the ``RLJAX_FAULTS`` environment variable (comma-separated names, read once at import).
The stage that owns the data calls :func:`active` at the one place the bug would be; with
no fault on, a hook is a dict lookup. Faults exist for the tests only: nothing in a run's
configuration switches them on, and every record of a run with a fault on says which
(``trace_summary.json`` ``faults``: each armed fault's chances and acts, :func:`counts`).

Faults (name: the bug it provokes, where):

* ``keep_batch_field``: a batch field (``advantages``) kept alive past its step
  (``step_metrics`` keeps a reference) -> the ``batch_leak`` alert (error).
* ``zero_loss_mask_token``: one ``loss_mask`` token zeroed in a row outside the traced
  groups (``trajectory_fields``, the learner's copy) -> ``batch_invariant`` (loss tokens).
* ``shift_loss_mask``: the same row's ``loss_mask`` shifted by one position, same token
  count -> ``batch_invariant`` (mask positions).
* ``future_version``: an untraced row claims ``max_version`` = the learner's + 1 (a sync run)
  -> ``batch_invariant`` (versions).
* ``swap_rewards``: the scores of two untraced rows of different prompt groups swapped after
  scoring (``reward``, and the multi-turn ``episode_reward``) -> ``batch_invariant`` (scores
  tied to the trajectory digest).
* ``observation_action_mask`` (multi-turn): an untraced row's tool-observation tokens given
  action mask 1 by the rollout (its ``response_mask`` / ``loss_mask``, and so the learner's
  copy) -> ``batch_invariant`` (observation tokens with mask 1; token counts and digests agree).
* ``observation_loss_mask`` (multi-turn): the same tokens put in the learner's ``loss_mask``
  only (``trajectory_fields``) -> ``batch_invariant`` (loss tokens, then observation tokens).

The two observation faults act on every step with an untraced row that holds a tool
observation (on the tool task a random policy calls the tool rarely: some steps have none).

An armed fault may find nothing to act on (no tool observation in the batch, a hook on a code
path the run does not take); the run then passes and a test expecting its check to fail could
not fail. So every hook counts its chances and the times it acted, and a process with a fault
armed ends with one line on stderr (:func:`report`), e.g.::

    rljax faults: zero_loss_mask_token acted 1 of 1; observation_loss_mask acted 0 of 3 (NEVER ACTED: nothing to act on)

Tests read it back with :func:`acted_in` and assert the fault acted before they assert the
check caught it (in-process: :func:`acts`). The run's ``trace_summary.json`` holds the same counts
(``faults``: ``{name: {"chances": n, "acted": m}}``, the main process's, as of its last summary),
and ``trace check`` / ``trace summary`` print them in the same words (:func:`describe`).
"""

from __future__ import annotations

import atexit
import os
import re
import sys
from typing import Any

from rljax.trace.groups import choose_groups
from rljax.trace.invariants import OBSERVATION_ROLE

#: Every known fault with the bug it provokes.
FAULTS = {
    "keep_batch_field": "a batch field (advantages) stays referenced after its step",
    "zero_loss_mask_token": "one loss_mask token zeroed in a row outside the traced groups",
    "shift_loss_mask": "one untraced row's loss_mask shifted by one position (same count)",
    "future_version": "an untraced row claims a weight version newer than the learner's",
    "swap_rewards": "the scores of two untraced rows of different prompt groups swapped after scoring",
    "observation_action_mask": "an untraced row's tool observation tokens given action mask 1 by the rollout",
    "observation_loss_mask": "an untraced row's tool observation tokens put in the learner's loss_mask",
    # round four (rljax.trace.rederive, rljax.trace.rescore, rljax._digest): producers that are wrong
    "wrong_group_id": "an untraced row's group_id points at another prompt group (advantages normalised over it)",
    "mask_after_eos": "an untraced row's rollout mask counts the padding position after its EOS",
    "restart_positions": "an untraced row's rotary positions restart at its response",
    "reward_other_answer": "an untraced row is scored against another prompt's answer",
    "drop_micro_row": "the update's first micro-batch of each mini-batch loses its first row",
    "loss_agg_mode": "the update is built with another loss_agg_mode than the configuration's",
    "stale_sampler_weights": "the sampler keeps its old weights while its version label advances",
    "reference_is_policy": "the reference log-probs are taken from the current policy",
    "stale_old_logp": "the old log-prob pass reads a copy of the policy taken at the first step",
}
_on: set[str] = set()
_kept: list = []
_chances: dict[str, int] = {}  # the times a hook of the fault ran with it armed
_acted: dict[str, int] = {}  # the times it changed something
_PID = os.getpid()  # the process that reports (a forked child inherits the exit hook, not the report)


def _parse(text: str) -> set[str]:
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(FAULTS))
    if unknown:
        raise ValueError(f"RLJAX_FAULTS names unknown fault(s) {', '.join(unknown)}; accepted: {', '.join(FAULTS)}")
    return names


def enable(*names: str) -> None:
    _on.update(_parse(",".join(names)))


def disable(*names: str) -> None:
    """Switches the named faults off (all of them when none is named)."""
    if names:
        _on.difference_update(names)
    else:
        _on.clear()
    _kept.clear()
    _stale.clear()
    _stale_old.clear()
    _chances.clear()
    _acted.clear()


def _chance(name: str, acted: bool = True) -> None:
    """A hook of ``name`` ran with it armed; ``acted``: and changed something."""
    _chances[name] = _chances.get(name, 0) + 1
    if acted:
        _acted[name] = _acted.get(name, 0) + 1


def active(name: str) -> bool:
    """Whether ``name`` is armed; a caller told yes acts on it (counted as acting)."""
    if name in _on:
        _chance(name)
        return True
    return False


def acts(name: str) -> int:
    """How many times ``name``'s hooks acted in this process (a compiled program counts once)."""
    return _acted.get(name, 0)


def counts() -> dict[str, dict[str, int]]:
    """Each armed fault's hook chances and acts in this process so far (``trace_summary.json``'s
    ``faults``); empty with no fault armed."""
    return {name: {"chances": _chances.get(name, 0), "acted": _acted.get(name, 0)} for name in sorted(_on)}


def describe(armed) -> str:
    """:func:`counts` in words: each fault, how many times it acted of its hooks' chances; those that
    never acted say so. ``armed`` may be a summary's older list of names (no counts then)."""
    if not isinstance(armed, dict):
        return ", ".join(armed) + " (no counts recorded)"
    parts = []
    for name, c in armed.items():
        n, of = int(c.get("acted", 0)), int(c.get("chances", 0))
        why = "" if n else (" (NEVER ACTED: nothing to act on)" if of else " (NEVER ACTED: no hook of it ran)")
        parts.append(f"{name} acted {n} of {of}{why}")
    return "; ".join(parts)


def report() -> str:
    """One line: each armed fault, how many times it acted of its hooks' chances; those that never
    acted say so. Empty with no fault armed."""
    return "rljax faults: " + describe(counts()) if _on else ""


def acted_in(text: str) -> dict[str, int]:
    """The times each fault acted, from the :func:`report` lines in ``text`` (a launch's stderr;
    several processes' lines are summed)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("rljax faults: "):
            for name, n in re.findall(r"(\w+) acted (\d+) of", line):
                out[name] = out.get(name, 0) + int(n)
    return out


def _report_at_exit() -> None:
    if _on and os.getpid() == _PID:
        print(report(), file=sys.stderr, flush=True)


def enabled() -> list[str]:
    return sorted(_on)


def keep(value: Any) -> None:
    """``keep_batch_field``: holds a reference past the step (the leak the runner must report)."""
    _kept.append(value)


def untraced_row(traj, *, seed: int, step: int, groups: int, partial: bool = False) -> int:
    """The last real row of ``traj`` whose prompt group the tracer does not follow this step (with
    ``partial``: one whose mask leaves a position free, so it can shift)."""
    import numpy as np

    traced = set(choose_groups(seed, step, int(traj.num_groups), groups))
    n = lambda i: int(np.asarray(traj.loss_mask[i]).sum())  # noqa: E731
    rows = [i for i in range(traj.batch_size) if not traj.is_padding[i] and int(traj.group_id[i]) not in traced
            and n(i) > 0 and (not partial or n(i) < np.asarray(traj.loss_mask).shape[1])]
    if not rows:
        raise RuntimeError("fault hooks: every row of the batch is traced; use more prompt groups")
    return rows[-1]


def observation_row(traj, *, seed: int, step: int, groups: int):
    """The last real row outside the traced groups with a tool observation (None: no such row)."""
    import numpy as np

    roles = getattr(traj, "roles", None)
    if roles is None:
        raise RuntimeError("fault hooks: the observation faults need a multi-turn run (env.function)")
    traced = set(choose_groups(seed, step, int(traj.num_groups), groups))
    rows = [i for i in range(traj.batch_size) if not traj.is_padding[i] and int(traj.group_id[i]) not in traced
            and (np.asarray(roles[i]) == OBSERVATION_ROLE).any()]
    return rows[-1] if rows else None


def learner_fields(host: dict, traj, *, seed: int, step: int, groups: int, version: int) -> None:
    """Applies the switched-on faults of ``trajectory_fields`` to the learner's host arrays (in place)."""
    import numpy as np

    if _on & {"observation_action_mask", "observation_loss_mask"}:
        r = observation_row(traj, seed=seed, step=step, groups=groups)
        for name in _on & {"observation_action_mask", "observation_loss_mask"}:
            _chance(name, acted=r is not None)
        if r is not None:
            cols = np.flatnonzero(np.asarray(traj.roles[r]) == OBSERVATION_ROLE)
            if "observation_action_mask" in _on:  # the rollout's own record: the trace's side sees it too
                traj.response_mask[r, cols] = True
                traj.loss_mask[r, cols] = True
            host["loss_mask"][r, cols] = 1  # the learner's copy (built from the rollout's before this hook)
    if not _on & {"zero_loss_mask_token", "shift_loss_mask", "future_version", "wrong_group_id", "mask_after_eos",
                  "restart_positions"}:
        return
    r = untraced_row(traj, seed=seed, step=step, groups=groups,
                     partial=bool(_on & {"shift_loss_mask", "mask_after_eos"}))
    for name in _on & {"zero_loss_mask_token", "shift_loss_mask", "future_version", "wrong_group_id",
                       "mask_after_eos", "restart_positions"}:
        _chance(name)  # each acts on the row found (none found raises)
    if "wrong_group_id" in _on:  # the learner's group ids (the advantages are normalised over them)
        host["group_id"][r] = (int(host["group_id"][r]) + 1) % max(int(host["group_id"].max()) + 1, 2)
    if "mask_after_eos" in _on:  # the rollout's own record, and so the learner's copy
        t = int(traj.response_length[r])
        traj.response_mask[r, t] = traj.loss_mask[r, t] = True
        host["loss_mask"][r, t] = 1
    if "restart_positions" in _on:  # the response's positions start again from 0
        s = host["input_ids"].shape[1] - host["loss_mask"].shape[1]
        host["positions"][r, s:] = np.arange(host["positions"].shape[1] - s)
    lm = host["loss_mask"]
    if "zero_loss_mask_token" in _on:
        lm[r, int(np.flatnonzero(lm[r])[0])] = 0
    if "shift_loss_mask" in _on:  # one position right (left when the mask ends at the last column)
        on = np.flatnonzero(lm[r])
        moved = on + 1 if on[-1] + 1 < np.asarray(traj.loss_mask).shape[1] else on - 1
        value = lm[r, on[0]]
        lm[r] = 0
        lm[r, moved] = value
    if "future_version" in _on:
        traj.max_version[r] = version + 1


def reward_scores(scores, traj, *, seed: int, step: int, groups: int) -> None:
    """``swap_rewards``: swaps two untraced rows' scores (of different groups, different scores) in place."""
    if "swap_rewards" not in _on:
        return

    traced = set(choose_groups(seed, step, int(traj.num_groups), groups))
    rows = [i for i in range(traj.batch_size) if not traj.is_padding[i] and int(traj.group_id[i]) not in traced]
    for a in rows:
        for b in rows:
            if traj.group_id[a] != traj.group_id[b] and scores[a] != scores[b]:
                scores[a], scores[b] = scores[b], scores[a]
                _chance("swap_rewards")
                return
    a, b = next((a, b) for a in rows for b in rows if traj.group_id[a] != traj.group_id[b])
    scores[a] += 1.0  # every untraced score equal: a swap would change nothing; make it a wrong score
    scores[b] -= 1.0
    _chance("swap_rewards")


def reward_answers(answers: list, traj) -> list:
    """``reward_other_answer``: the last real row is scored against another prompt's answer."""
    if "reward_other_answer" not in _on:
        return answers
    r = max(i for i in range(traj.batch_size) if not traj.is_padding[i])
    other = next((i for i in range(traj.batch_size) if not traj.is_padding[i] and answers[i] != answers[r]), None)
    _chance("reward_other_answer", acted=other is not None)
    if other is not None:
        answers = list(answers)
        answers[r] = answers[other]
    return answers


_stale: list = []


def sampler_weights(params):
    """``stale_sampler_weights``: the weights of the first push, whatever the learner pushes later
    (the version label still advances); a copy, the learner donates its buffers."""
    if "stale_sampler_weights" not in _on:
        return params
    _chance("stale_sampler_weights", acted=bool(_stale))  # the first push is the one kept
    if not _stale:
        import jax
        import jax.numpy as jnp

        _stale.append(jax.tree.map(jnp.copy, params))
    return _stale[0]


def old_params(params):
    """``stale_old_logp``: the parameters of the first old log-prob pass, at every later one (a copy)."""
    if "stale_old_logp" not in _on:
        return params
    _chance("stale_old_logp", acted=bool(_stale_old))  # the first pass is the one kept
    if not _stale_old:
        import jax
        import jax.numpy as jnp

        _stale_old.append(jax.tree.map(jnp.copy, params))
    return _stale_old[0]


_stale_old: list = []


def reference_params(reference, policy):
    """``reference_is_policy``: the reference pass reads the current policy's parameters."""
    return policy if active("reference_is_policy") else reference


_on.update(_parse(os.environ.get("RLJAX_FAULTS", "")))
atexit.register(_report_at_exit)
