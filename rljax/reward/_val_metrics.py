"""Validation metrics per ``data_source``, with verl's names (``val-core/{data_source}/{var}/mean@N``).

For each data source, each variable (``reward``: the score; every number a reward returning
a dict gave, e.g. verl's ``acc``) and each prompt's ``N`` samples (``rollout.val_kwargs.n``):
``mean@N`` and, with ``N > 1``, ``std@N``, and for ``n = 2, 4, ... , N`` the bootstrap
estimates of the best and worst of ``n`` samples (``best@n/mean``, ``best@n/std``,
``worst@n/...``) and, when the reward returns verl's ``pred``, of the majority vote's value
(``maj@n/mean``, ``maj@n/std``); each averaged over the prompts. As verl's
``process_validation_metrics`` and its trainer's naming: the core variable is ``acc`` when
the reward gives one, else ``reward``; its ``mean`` / ``best`` / ``maj`` at ``N`` go under
``val-core/``, everything else under ``val-aux/``. Pure NumPy; the bootstrap draws from a
fixed seed, so the same samples give the same numbers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

import numpy as np

#: Bootstrap draws per estimate (verl's).
N_BOOTSTRAP = 1000


def _sizes(n: int) -> list[int]:
    """``2, 4, 8, ... < n`` and ``n`` (verl's subset sizes)."""
    out, k = [], 2
    while k < n:
        out.append(k)
        k *= 2
    return out + [n] if n > 1 else []


def _bootstrap(values: np.ndarray, k: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``(draws [B,k] indices, values[draws])`` of ``N_BOOTSTRAP`` samples of size ``k`` with replacement."""
    draws = rng.choice(len(values), size=(N_BOOTSTRAP, k), replace=True)
    return draws, values[draws]


def _majority(values: np.ndarray, preds: Sequence, draws: np.ndarray) -> np.ndarray:
    """The value of each draw's majority ``pred`` (ties: the pred seen first in the draw; its first value)."""
    codes = {p: i for i, p in enumerate(dict.fromkeys(preds))}
    code = np.asarray([codes[p] for p in preds])[draws]  # [B, k]
    onehot = code[..., None] == np.arange(len(codes))  # [B, k, m]
    count = onehot.sum(1)
    first = np.where(onehot.any(1), onehot.argmax(1), draws.shape[1])  # first position of each pred
    best = count.max(1, keepdims=True)
    winner = np.where(count == best, first, draws.shape[1] + 1).argmin(1)  # most votes, seen first
    pos = first[np.arange(len(winner)), winner]
    return values[draws[np.arange(len(winner)), pos]]


def _prompt_metrics(values: np.ndarray, preds, rng: np.random.Generator) -> dict[str, float]:
    n = len(values)
    out = {f"mean@{n}": float(values.mean())}
    if n == 1:
        return out
    out[f"std@{n}"] = float(values.std())
    for k in _sizes(n):
        draws, sampled = _bootstrap(values, k, rng)
        for name, reduced in (("best", sampled.max(1)), ("worst", sampled.min(1))):
            out[f"{name}@{k}/mean"], out[f"{name}@{k}/std"] = float(reduced.mean()), float(reduced.std())
        if preds is not None:
            maj = _majority(values, preds, draws)
            out[f"maj@{k}/mean"], out[f"maj@{k}/std"] = float(maj.mean()), float(maj.std())
    return out


def validation_metrics(data_sources: Sequence[str], uids: Sequence, scores, row_extras: Sequence[Mapping | None],
                       *, seed: int = 42) -> dict[str, float]:
    """``{"val-core/<data_source>/<var>/mean@N": ..., "val-aux/...": ...}`` of one validation pass.

    Args:
      data_sources: each row's ``data_source`` (the dataset's name when rows have none).
      uids: each row's prompt id: a prompt's ``N`` samples share it.
      scores: ``[R]`` each row's reward.
      row_extras: each row's extra dict (:attr:`rljax.reward.RewardReport.row_extras`) or None.
      seed: the bootstrap's seed.
    """
    scores = np.asarray(scores, np.float64).reshape(-1)
    groups: dict = defaultdict(lambda: defaultdict(list))  # data source -> uid -> rows
    for i, (source, uid) in enumerate(zip(data_sources, uids)):
        groups[source][uid].append(i)
    out: dict[str, float] = {}
    for source, by_uid in groups.items():
        per_var: dict = defaultdict(lambda: defaultdict(list))  # var -> metric -> per-prompt values
        for rows in by_uid.values():
            extras = [row_extras[i] or {} for i in rows] if len(row_extras) else [{} for _ in rows]
            variables = {"reward": scores[rows]}
            for key in sorted(set().union(*extras)):
                vals = [e.get(key) for e in extras]
                if all(isinstance(v, float) for v in vals) and not key.startswith("error/"):
                    variables[key] = np.asarray(vals)
            preds = [e.get("pred") for e in extras]
            preds = preds if all(isinstance(p, str) for p in preds) else None
            rng = np.random.default_rng(seed)
            for var, values in variables.items():
                for metric, value in _prompt_metrics(values, preds, rng).items():
                    per_var[var][metric].append(value)
        core = "acc" if "acc" in per_var else "reward"
        for var, metrics in per_var.items():
            n_max = max(int(m.split("@")[1].split("/")[0]) for m in metrics)
            for metric, values in metrics.items():
                is_core = var == core and metric.startswith(("mean", "maj", "best")) and f"@{n_max}" in metric
                out[f"{'val-core' if is_core else 'val-aux'}/{source}/{var}/{metric}"] = float(np.mean(values))
    return out


class ValidationBySource:
    """The rows of one validation pass, collected batch by batch (:meth:`add`), and their
    :func:`validation_metrics` (:meth:`metrics`). A row's data source is its prompt's
    ``data_source``, else ``default_source`` (the dataset's verl name); its prompt id the uid its
    ``n`` samples share."""

    def __init__(self, default_source: str):
        self.default_source = default_source
        self.sources: list = []
        self.uids: list = []
        self.scores: list = []
        self.extras: list = []

    def add(self, traj, prompts, scores, report) -> None:
        scores = np.asarray(scores, np.float64).reshape(-1)
        extras = report.row_extras or (None,) * len(scores)
        for i in range(len(scores)):
            if traj.is_padding[i]:
                continue
            prompt = prompts[int(traj.group_id[i])]
            self.sources.append(getattr(prompt, "data_source", "") or self.default_source)
            self.uids.append(str(traj.uid[i]))
            self.scores.append(scores[i])
            self.extras.append(extras[i])

    def records(self) -> list[tuple]:
        """This collector's rows as ``(source, uid, score, extras)`` records (JSON-able: a process
        sends them to the others, :meth:`replace` takes every process's)."""
        return [(src, uid, float(score), extras) for src, uid, score, extras
                in zip(self.sources, self.uids, self.scores, self.extras)]

    def replace(self, records) -> None:
        """The rows become ``records`` (:meth:`records` of every process, in process order)."""
        self.sources, self.uids, self.scores, self.extras = (
            [list(r) for r in zip(*records)] if records else ([], [], [], []))

    def metrics(self) -> dict[str, float]:
        return validation_metrics(self.sources, self.uids, self.scores, self.extras) if self.scores else {}
