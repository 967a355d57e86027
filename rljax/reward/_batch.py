"""Scoring a batch with error isolation: one bad sample scores 0; too many fail the step.

The reward runs in the trainer's process (a plain function) or in a
:class:`~rljax.reward.RewardPool` of worker processes, which adds timeouts and survives
crashes (``reward.num_workers``)."""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from rljax.errors import RunError
from rljax.reward._pool import Outcome, RewardPool

logger = logging.getLogger("rljax.reward")
_MAX_MSG = 200
_MAX_WARNINGS = 3  # per batch: the first failures by uid, then one count
#: Without ``reward.clip``, a score beyond this magnitude stops the run (a bug, not a reward).
MAX_ABS_SCORE = 1e6


class RewardError(RunError):
    """More of the batch failed in the reward function than ``reward.max_error_fraction`` allows."""


@dataclasses.dataclass(frozen=True)
class RewardReport:
    """What happened while scoring one batch.

    Attributes:
      num_scored: rows the reward function was called on (padding excluded).
      num_padding: padding rows (score 0, never scored).
      errors: rows whose reward failed: raised (``sys.exit`` included), returned a
        non-finite value or a non-number, timed out, or crashed its worker.
      error_uids: their uids, in batch order.
      first_error: ``"<uid>: <ExceptionType>: <message>"`` of the first failure, or None.
      timeouts: of ``errors``, the rows that ran past ``reward.timeout_s`` (pool only).
      worker_restarts: workers replaced while scoring this batch (pool only).
      extra_means: ``{key: mean}`` of the numbers a function returning a dict gave beside its
        score (verl's ``acc``; :class:`~rljax.reward.WeightedRewards`' ``fn/<name>``), over the
        rows that gave them.
      function_errors: ``{name: (count, first error)}`` of the functions of ``reward.functions``
        that raised on some rows (their part scored 0; the row is not an error of the batch).
      row_extras: each row's extra dict (None for padding or a plain number); a report merged over
        processes keeps this process's rows.
      extra_totals: ``{key: (sum, rows)}`` behind ``extra_means`` (what :func:`merge_extras` adds up
        over processes or draws).
    """

    num_scored: int
    num_padding: int
    errors: int
    error_uids: tuple
    first_error: str | None
    timeouts: int = 0
    worker_restarts: int = 0
    extra_means: Mapping = dataclasses.field(default_factory=dict)
    function_errors: Mapping = dataclasses.field(default_factory=dict)
    row_extras: tuple = ()
    extra_totals: Mapping = dataclasses.field(default_factory=dict)

    def extras_record(self) -> dict:
        """The JSON-able part :func:`merge_extras` merges: ``{"totals": {key: [sum, rows]},
        "function_errors": {name: [count, first error]}}``."""
        return {"totals": {k: [float(t), int(n)] for k, (t, n) in self.extra_totals.items()},
                "function_errors": {k: [int(c), first] for k, (c, first) in self.function_errors.items()}}

    @property
    def error_fraction(self) -> float:
        return self.errors / self.num_scored if self.num_scored else 0.0

    def extra_values(self, key: str, n: int) -> np.ndarray | None:
        """``[n]`` float64 values of a numeric extra ``key`` per row (NaN where a row has none),
        or None when no row has it (e.g. verl's ``acc`` for the filter)."""
        if not any(isinstance(e, Mapping) and key in e for e in self.row_extras):
            return None
        out = np.full(n, np.nan)
        for i, e in enumerate(self.row_extras):
            v = e.get(key) if isinstance(e, Mapping) else None
            if isinstance(v, float):
                out[i] = v
        return out

    def check(self, max_error_fraction: float, *, where: str = "") -> None:
        """Raises :class:`RewardError` (one line: the count, the bound, the first error) when
        more than ``max_error_fraction`` of the scored rows failed; ``where`` says over what
        (e.g. ``" over 2 processes"``) when the report merges several."""
        if self.error_fraction > max_error_fraction:
            every = ("every sample of the batch" if self.errors == self.num_scored
                     else f"{self.error_fraction:.1%} of the batch")
            raise RewardError(f"reward failed on {every} ({self.errors}/{self.num_scored}){where}, more than "
                              f"reward.max_error_fraction={max_error_fraction}; first error: {self.first_error}")
        for name, (count, first) in self.function_errors.items():  # the bound holds for each of reward.functions
            if self.num_scored and count / self.num_scored > max_error_fraction:
                raise RewardError(f"reward function {name} failed on {count / self.num_scored:.1%} of the batch "
                                  f"({count}/{self.num_scored}){where}, more than reward.max_error_fraction="
                                  f"{max_error_fraction}; first error: {first}")

    def metrics(self) -> dict[str, float]:
        """``reward/errors``, ``reward/error_fraction``, ``reward/timeouts``, ``reward/worker_restarts``;
        a dict's extra numbers as ``reward/extra/<key>`` (verl's names), each of ``reward.functions``
        as ``reward/fn/<name>/mean`` and ``reward/fn/<name>/errors``."""
        out = {"reward/errors": float(self.errors), "reward/error_fraction": self.error_fraction,
               "reward/timeouts": float(self.timeouts), "reward/worker_restarts": float(self.worker_restarts)}
        for key, mean in self.extra_means.items():
            out[f"reward/{key}/mean" if key.startswith("fn/") else f"reward/extra/{key}"] = mean
        for key in self.extra_means:
            if key.startswith("fn/"):
                out[f"reward/{key}/errors"] = float(self.function_errors.get(key[3:], (0, None))[0])
        return out


def _short(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= _MAX_MSG else text[: _MAX_MSG - 3] + "..."


def _as_score(value) -> float:
    if isinstance(value, (bool, np.bool_)):
        return float(value)
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__}, not a number")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"returned non-finite {v}")
    return v


def as_result(value) -> tuple[float, dict | None]:
    """``(score, extra)`` of what a reward returned: a number, or a dict with ``"score"`` (verl's
    ``{"score", "acc", "pred", ...}``) whose other finite numbers and short strings are ``extra``."""
    if not isinstance(value, Mapping):
        return _as_score(value), None
    if "score" not in value:
        raise ValueError(f"returned a dict without 'score' (keys {sorted(map(str, value))})")
    extra = {}
    for key, v in value.items():
        if key == "score":
            continue
        if isinstance(v, (bool, np.bool_, numbers.Real)) and math.isfinite(float(v)):
            extra[str(key)] = float(v)
        elif isinstance(v, str):
            extra[str(key)] = v[:_MAX_MSG]  # verl's "pred" (majority voting), a function's error
    return _as_score(value["score"]), extra or None


def _call(fn, response, answer, extra) -> Outcome:
    try:
        score, more = as_result(fn(response, answer, **extra))
        return Outcome(score, extra=more)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - a user reward may raise anything; isolate it
        return Outcome(0.0, f"{type(e).__name__}: {_short(e)}")


def merge_extras(records: Sequence[Mapping]) -> dict:
    """``{"extra_means", "extra_totals", "function_errors"}`` of several reports' :meth:`RewardReport.extras_record`
    (every process's part of one batch, or several draws), in batch order: each key's sum and row count
    added up (a mean over every row that gave the key, as one process scoring them all), each function's
    errors counted with the first one's message. For ``dataclasses.replace(report, **merge_extras(...))``."""
    totals: dict[str, list] = {}
    errors: dict[str, list] = {}
    for rec in records:
        for key, (total, rows) in rec["totals"].items():
            acc = totals.setdefault(key, [0.0, 0])
            acc[0] += total
            acc[1] += rows
        for name, (count, first) in rec["function_errors"].items():
            errors.setdefault(name, [0, first])[0] += count
    return {"extra_means": {k: t / n for k, (t, n) in totals.items()},
            "extra_totals": {k: (t, n) for k, (t, n) in totals.items()},
            "function_errors": {k: (c, first) for k, (c, first) in errors.items()}}


def _extras(rows, outcomes, n: int) -> tuple[dict, tuple]:
    """``(extras, per-row extras)`` of a batch's outcomes (:class:`RewardReport`), ``extras`` as
    :func:`merge_extras` returns them."""
    per_row: list = [None] * n
    sums: dict[str, list] = {}
    errors: dict[str, list] = {}
    for i, out in zip(rows, outcomes):
        if not out.extra or out.error is not None:
            continue
        per_row[i] = out.extra
        for key, v in out.extra.items():
            if key.startswith("error/"):
                hit = errors.setdefault(key[6:], [0, v])
                hit[0] += 1
            elif isinstance(v, float):
                acc = sums.setdefault(key, [0.0, 0])
                acc[0] += v
                acc[1] += 1
    return merge_extras([{"totals": sums, "function_errors": errors}]), tuple(per_row)


def score_batch(
    fn: Callable[..., float] | RewardPool,
    responses: Sequence[str],
    answers: Sequence[str],
    uids: Sequence,
    *,
    max_error_fraction: float,
    is_padding: Sequence[bool] | np.ndarray | None = None,
    extras: Sequence[Mapping] | None = None,
    clip: float | None = None,
) -> tuple[np.ndarray, RewardReport]:
    """Scores each row with ``fn(response, answer, **extra)``, isolating failures.

    A row whose call raises, or returns a non-number or a non-finite value, scores 0 and is
    counted in ``report.errors``; the first few are logged by uid, the rest as one count
    (warning, ``rljax.reward`` logger; the message, never the response text). A batch over
    the error bound (every sample failing, say) stops with one line: the count and the
    first error, no per-sample warnings. Padding rows are not scored (score 0, not
    counted). The error fraction is ``errors / non-padding rows``.

    Scores are clipped to ``[-clip, clip]`` (``reward.clip``); without a clip, a score beyond
    ``MAX_ABS_SCORE`` in magnitude stops the run with one line (a reward of 1e30 is a bug
    that would swamp the advantages, never a reward).

    With a :class:`RewardPool` the rows are scored in parallel in its worker processes; a row
    that runs past the pool's timeout or crashes its worker also scores 0 and counts as an
    error (timeouts also in ``report.timeouts``).

    Args:
      fn: the reward function (see :func:`rljax.reward.get_reward_fn`), or a :class:`RewardPool`.
      responses, answers, uids: one per row (uids are trace keys, e.g. ``{uid}_{session}_{index}``).
      max_error_fraction: the largest accepted error fraction, in ``[0, 1]``.
      is_padding: ``[B]`` bool, rows added only to make shapes divide the mesh.
      extras: per-row keyword arguments for ``fn`` (e.g. ``{"uid": ..., "row": ...}``).
      clip: ``reward.clip``; None: ``fn.clip`` when ``fn`` has one (:func:`rljax.reward.make_reward`).

    Returns:
      ``(scores, report)``: ``scores`` is ``[B]`` float32.

    Raises:
      RewardError: when ``errors / non-padding rows > max_error_fraction``, or a score's
        magnitude is over ``MAX_ABS_SCORE`` without a clip.
      ValueError: mismatched lengths or a bad ``max_error_fraction``.
    """
    n = len(responses)
    if len(answers) != n or len(uids) != n:
        raise ValueError(f"score_batch: {n} responses, {len(answers)} answers and {len(uids)} uids must match")
    if extras is not None and len(extras) != n:
        raise ValueError(f"score_batch: {len(extras)} extras for {n} responses")
    if not 0.0 <= max_error_fraction <= 1.0:
        raise ValueError(f"max_error_fraction={max_error_fraction} must be in [0, 1]")
    pad = np.zeros(n, bool) if is_padding is None else np.asarray(is_padding, bool).reshape(-1)
    if pad.shape != (n,):
        raise ValueError(f"score_batch: is_padding has {pad.shape[0]} rows for {n} responses")
    scores = np.zeros(n, np.float32)
    rows = [i for i in range(n) if not pad[i]]
    items = [(responses[i], answers[i], dict(extras[i]) if extras is not None else {}) for i in rows]
    restarts = 0
    if isinstance(fn, RewardPool):
        before = fn.restarts
        outcomes = fn.map(items)
        restarts = fn.restarts - before
    else:
        outcomes = [_call(fn, *item) for item in items]
    if clip is None:
        clip = getattr(fn, "clip", None)
    error_uids, first, timeouts, failed = [], None, 0, []
    for i, out in zip(rows, outcomes):
        scores[i] = out.score
        if out.error is not None:
            error_uids.append(uids[i])
            timeouts += out.timeout
            first = first or f"{uids[i]}: {out.error}"
            failed.append((uids[i], out.error))
    num_scored = len(rows)
    extras, row_extras = _extras(rows, outcomes, n)
    report = RewardReport(num_scored, int(pad.sum()), len(error_uids), tuple(error_uids), first, timeouts, restarts,
                          row_extras=row_extras, **extras)
    report.check(max_error_fraction)
    for uid, error in failed[:_MAX_WARNINGS]:
        logger.warning("reward failed for uid %s (scored 0): %s", uid, error)
    if len(failed) > _MAX_WARNINGS:
        logger.warning("reward failed for %d more sample(s) of this batch (scored 0)", len(failed) - _MAX_WARNINGS)
    if clip is not None:
        np.clip(scores, -clip, clip, out=scores)
    else:
        big = np.flatnonzero(np.abs(scores) > MAX_ABS_SCORE)
        if big.size:
            i = int(big[0])
            raise RewardError(f"reward.function returned {float(scores[i]):.3g} for uid {uids[i]} ({big.size} sample(s) "
                              f"over {MAX_ABS_SCORE:g} in magnitude): a score that large swamps the advantages; fix "
                              "the reward or set reward.clip=C to clip scores to [-C, C]")
    return scores, report
