"""Prompt length policy: filter overlong prompts, or truncate them, or fail (``data.truncation``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Optional

from rljax.config import ConfigError

TRUNCATIONS = ("error", "left", "right")


def truncate_ids(ids: Sequence[int], max_length: int, mode: str) -> list[int]:
    """``ids`` cut to ``max_length``: ``left`` keeps the last tokens (drops from the start,
    BOS included, as verl does), ``right`` keeps the first; ``error`` raises on overlong."""
    if mode not in TRUNCATIONS:
        raise ConfigError(f"data.truncation={mode!r} is not accepted; accepted: {', '.join(TRUNCATIONS)}")
    ids = list(ids)
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[len(ids) - max_length:]
    if mode == "right":
        return ids[:max_length]
    raise ConfigError(
        f"a prompt has {len(ids)} tokens > data.max_prompt_length={max_length}; "
        "set data.filter_overlong_prompts=true or data.truncation=left|right"
    )


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One tokenized prompt: ``position`` in the split, dataset row ``index``, text, ids, answer."""

    position: int
    index: int
    prompt: str
    ids: tuple
    answer: str
    truncated: bool


@dataclasses.dataclass(frozen=True)
class PromptStats:
    """Counts of :func:`prepare_prompts`: ``total = kept + filtered + no_answer``;
    ``truncated <= kept``; ``first_no_answer`` is the dataset row of the first row skipped
    for an empty or null answer."""

    total: int
    kept: int
    filtered: int
    truncated: int
    max_length: int
    longest: int
    no_answer: int = 0
    first_no_answer: Optional[int] = None

    def metrics(self, prefix: str = "data/") -> dict[str, float]:
        keys = ("total", "kept", "filtered", "truncated", "no_answer")
        return {f"{prefix}prompts_{k}": float(getattr(self, k)) for k in keys}


class PreparedPrompts(Sequence):
    """The kept prompts of a split (a sequence of :class:`Prompt`) and their :class:`PromptStats`."""

    def __init__(self, prompts: list[Prompt], stats: PromptStats):
        self._prompts = prompts
        self.stats = stats

    def __len__(self) -> int:
        return len(self._prompts)

    def __getitem__(self, i):
        return self._prompts[i]


def prepare_prompts(
    source: Sequence[Mapping],
    tokenize: Callable[[str], Sequence[int]],
    *,
    max_length: int,
    filter_overlong: bool = False,
    truncation: str = "error",
) -> PreparedPrompts:
    """Tokenizes every prompt of ``source`` once and applies the length policy.

    * ``filter_overlong=True``: prompts longer than ``max_length`` tokens are dropped
      (counted in ``stats.filtered``); the rest are unchanged.
    * otherwise ``truncation``: ``left`` / ``right`` cut overlong prompts (counted in
      ``stats.truncated``); ``error`` raises :class:`~rljax.config.ConfigError` naming the
      first overlong row and how many there are, before any training starts.
    * rows whose answer is empty or null are skipped (a reward cannot score them) and
      counted in ``stats.no_answer`` (``stats.first_no_answer`` names the first).

    Args:
      source: items with ``prompt`` (formatted text) and ``answer``; ``index`` optional
        (defaults to the position), e.g. a :class:`~rljax.data.PromptSource`.
      tokenize: ``text -> ids`` (e.g. ``lambda s: tok.encode(s, add_bos=True)``).
      max_length: ``data.max_prompt_length``.

    Returns:
      :class:`PreparedPrompts`; iterate it with :class:`~rljax.data.PromptIterator`.
    """
    if max_length < 1:
        raise ConfigError(f"data.max_prompt_length={max_length} is out of range; it must be >= 1")
    if truncation not in TRUNCATIONS:
        raise ConfigError(f"data.truncation={truncation!r} is not accepted; accepted: {', '.join(TRUNCATIONS)}")
    kept, filtered, truncated, longest = [], 0, 0, 0
    overlong_rows, no_answer_rows = [], []
    for pos in range(len(source)):
        item = source[pos]
        index = int(item.get("index", pos))
        if item["answer"] is None or not str(item["answer"]).strip():
            no_answer_rows.append(index)
            continue
        ids = list(tokenize(item["prompt"]))
        longest = max(longest, len(ids))
        was_cut = False
        if len(ids) > max_length:
            if filter_overlong:
                filtered += 1
                continue
            if truncation == "error":
                overlong_rows.append((index, len(ids)))
                continue
            ids = truncate_ids(ids, max_length, truncation)
            truncated += 1
            was_cut = True
        kept.append(Prompt(pos, index, item["prompt"], tuple(ids), item["answer"], was_cut))
    if overlong_rows:
        row, length = overlong_rows[0]
        raise ConfigError(
            f"{len(overlong_rows)} of {len(source)} prompts are longer than data.max_prompt_length={max_length} "
            f"(first: row {row}, {length} tokens); set data.filter_overlong_prompts=true, data.truncation=left|right, "
            "or a larger data.max_prompt_length"
        )
    stats = PromptStats(len(source), len(kept), filtered, truncated, max_length, longest, len(no_answer_rows),
                        no_answer_rows[0] if no_answer_rows else None)
    return PreparedPrompts(kept, stats)
