"""Re-scoring: a sample of each step's rows scored again by the reward function, from the
recorded response and the recorded ground truth of the row's own prompt (found by the row's
uid, never by its ``group_id``), and compared with the score the reward stage recorded for it
(``scored_rows``, which the whole-batch invariants tie to the score the advantages read).

A reward scored against another row's answer, given to another session, or rows' rewards
swapped before the reward stage recorded them: the producer and every later consumer agree,
only calling the function again shows it. The traced rows are always re-scored, plus
``trace.rescore_rows`` others drawn per step (so the cost is bounded, and reported as
``trace/rescore_s``).

Rewards that are not a function of the text declare it: a reward function with the attribute
``deterministic = False`` (a sandbox, a sampled verdict) is compared within its
``rescore_tolerance`` when it has one, else not compared (N/A, never PASS); a generative
judge or a reward model combined into the score (``reward.judge`` / ``reward.model``), and
an environment's own final reward (multi-turn), are not re-scored.

When: the re-scoring starts at the reward stage's event, in the tracer's background thread
(:mod:`rljax.trace.early`), and the step's end takes its verdict. A reward function that must
not be called from a second thread while the trainer's thread may call it (validation scores
held-out rows with it) declares ``thread_safe = False``: it is re-scored at the step's end,
on the trainer's thread.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from rljax.reward import overlong_penalty, score_batch
from rljax.trace.rederive import violation

#: Re-scored score == recorded score within this (absolute + relative), for deterministic rewards.
TOLERANCE = 1e-5


class Rescorer:
    """Re-scores rows of a step.

    Args:
      fn: the reward function (``reward.function``'s, or its pool).
      decode: token ids -> text (the run's tokenizer, as the reward stage decodes).
      rows: rows re-scored per step besides the traced ones.
      penalty: ``traj -> [B]`` overlong penalty added to the scores (None: off).
      skip: why re-scoring cannot run in this configuration (None: it runs).
    """

    def __init__(self, fn, decode: Callable, *, rows: int, penalty: Optional[Callable] = None,
                 skip: Optional[str] = None):
        self.fn, self.decode, self.rows, self.penalty = fn, decode, int(rows), penalty
        self.skip = skip
        inner = getattr(fn, "fn", fn)  # a pool's function
        self.deterministic = bool(getattr(inner, "deterministic", True))
        self.tolerance = getattr(inner, "rescore_tolerance", None)
        # False: called only from the step's end (the trainer's thread), not mid-step from the tracer's
        # background thread (rljax.trace.early) while the trainer's thread may call it too (validation)
        self.thread_safe = bool(getattr(inner, "thread_safe", True))
        if not self.deterministic and self.tolerance is None and skip is None:
            self.skip = (f"the reward function {getattr(inner, '__name__', inner)} declares itself nondeterministic "
                         "(deterministic = False) and gives no rescore_tolerance")

    def sample(self, traj, traced_rows: Sequence[int], step: int, seed: int) -> np.ndarray:
        """The rows to re-score: the traced ones and ``rows`` other real rows drawn for ``(seed, step)``."""
        real = ~np.asarray(traj.is_padding, bool)
        traced = np.zeros(len(real), bool)
        traced[np.asarray(list(traced_rows), np.int64)] = True
        traced &= real
        rest = np.nonzero(real & ~traced)[0]
        rng = np.random.default_rng([int(seed), int(step), 35])
        drawn = rng.choice(rest, size=min(self.rows, len(rest)), replace=False) if len(rest) else rest
        return np.sort(np.concatenate([np.nonzero(traced)[0], drawn]).astype(np.int64))

    def check(self, step: int, traj, fields: Mapping, rows: np.ndarray, keys: Sequence[str]) -> tuple[dict, list]:
        """``({"rows", "skipped", "s"}, violations)``: ``rows`` of ``traj`` re-scored against ``fields["scored_rows"]``."""
        t0 = time.perf_counter()
        prompts = dict(zip(fields["uids"], fields["prompts"]))
        recorded = np.asarray(fields["scored_rows"]["scores"], np.float32)
        multi = getattr(traj, "final_text", None) is not None
        todo, skipped = [], 0
        for i in rows:
            if multi and np.isfinite(float(np.asarray(traj.env_reward)[i])):
                skipped += 1  # the environment's own reward, not a function of the text
                continue
            todo.append(int(i))
        if not todo:
            return {"rows": 0, "skipped": skipped, "s": time.perf_counter() - t0}, []
        if multi:
            texts = [traj.final_text[i] for i in todo]
        else:
            texts = [self.decode(traj.response_ids[i, : traj.response_length[i]]) for i in todo]
        own = [prompts.get(traj.uid[i]) for i in todo]
        missing = [i for i, p in zip(todo, own) if p is None]
        if missing:
            raise KeyError(f"uid {traj.uid[missing[0]]!r} of row {missing[0]} is not among the step's prompts")
        extras = [p.reward_extra() for p in own]
        scores, _ = score_batch(self.fn, texts, [p.answer for p in own], [keys[i] for i in todo],
                                max_error_fraction=1.0, extras=extras if any(extras) else None)
        scores = np.asarray(scores, np.float32)
        if self.penalty is not None:
            p = self.penalty(traj)
            if p is not None:
                scores = scores + np.asarray(p, np.float32)[todo]
        tol = TOLERANCE if self.deterministic else float(self.tolerance)
        out = []
        for j, i in enumerate(todo):
            if not abs(float(scores[j]) - float(recorded[i])) <= tol * (1.0 + abs(float(recorded[i]))):
                out.append(violation("rewards", step, keys, i, tensor="scores", stage="reward", sessions=traj.session,
                                     detail=f"re-scored {float(scores[j]):g} from the recorded response and the answer "
                                            f"of uid {traj.uid[i]}'s prompt, the reward stage recorded "
                                            f"{float(recorded[i]):g} for session {int(traj.session[i])}"))
        return {"rows": len(todo), "skipped": skipped, "s": time.perf_counter() - t0}, out


def rescorer_for(cfg, reward_fn, decode: Callable) -> Rescorer:
    """The run's :class:`Rescorer` (``trace.rescore_rows``; the overlong penalty as the reward stage adds it)."""
    r = cfg.reward
    skip = None
    if r.model.path is not None or r.judge.path is not None:
        skip = ("reward.model / reward.judge combine a model's score into the reward (a sampled verdict, a network): "
                "not re-scored")
    ob = r.reward_kwargs.overlong_buffer_cfg
    penalty = None
    if ob.enable:
        limit = r.reward_kwargs.max_resp_len or cfg.data.max_response_length

        def penalty(traj):
            p = overlong_penalty(traj.response_length, max_resp_len=limit, buffer_len=ob.len,
                                 penalty_factor=ob.penalty_factor)
            return np.where(np.asarray(traj.is_padding), np.float32(0), p)

    return Rescorer(reward_fn, decode, rows=cfg.trace.rescore_rows, penalty=penalty, skip=skip)
