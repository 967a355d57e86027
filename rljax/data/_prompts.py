"""Prompt length policy: filter overlong prompts, or truncate them, or fail (``data.truncation``)."""

from __future__ import annotations

import array
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Optional

import numpy as np

from rljax.errors import ConfigError

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
    """One tokenized prompt: ``position`` in the split, dataset row ``index``, text, ids, answer,
    and verl's ``data_source`` / ``extra_info`` (given to the reward function)."""

    position: int
    index: int
    prompt: str
    ids: tuple
    answer: str
    truncated: bool
    data_source: str = ""
    extra_info: Any = dataclasses.field(default_factory=dict)

    def reward_extra(self) -> dict:
        """The keyword arguments a reward function gets for this prompt: ``data_source`` (when
        the dataset names one) and the ``extra_info`` fields (verl's ``compute_score`` receives
        them as ``extra_info``)."""
        extra = dict(self.extra_info or {})
        if self.data_source:
            extra["data_source"] = self.data_source
        return extra


@dataclasses.dataclass(frozen=True)
class PromptStats:
    """Counts of :func:`prepare_prompts`: ``total = kept + filtered + no_answer + no_prompt``;
    ``truncated <= kept``; ``first_no_answer`` / ``first_no_prompt`` are the dataset rows of the
    first rows skipped for an empty or null answer / prompt."""

    total: int
    kept: int
    filtered: int
    truncated: int
    max_length: int
    longest: int
    no_answer: int = 0
    first_no_answer: Optional[int] = None
    no_prompt: int = 0
    first_no_prompt: Optional[int] = None

    def metrics(self, prefix: str = "data/") -> dict[str, float]:
        keys = ("total", "kept", "filtered", "truncated", "no_answer", "no_prompt")
        return {f"{prefix}prompts_{k}": float(getattr(self, k)) for k in keys}


class PreparedPrompts(Sequence):
    """The kept prompts of a split (a sequence of :class:`Prompt`) and their :class:`PromptStats`.

    Only the kept positions (8 bytes each) and truncation flags are held; ``prompts[i]``
    reads the item from the source and tokenizes it again, so a split larger than memory
    iterates in constant memory."""

    def __init__(self, source: Sequence[Mapping], tokenize: Callable[[str], Sequence[int]], positions: np.ndarray,
                 truncated: np.ndarray, stats: PromptStats, truncation: str):
        self._source, self._tokenize = source, tokenize
        self._positions, self._truncated = positions, truncated
        self._truncation = truncation
        self.stats = stats

    def __len__(self) -> int:
        return len(self._positions)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        pos = int(self._positions[i])
        item = self._source[pos]
        ids = list(self._tokenize(item["prompt"]))
        cut = bool(self._truncated[i])
        if cut:
            ids = truncate_ids(ids, self.stats.max_length, self._truncation)
        return Prompt(pos, int(item.get("index", pos)), item["prompt"], tuple(ids), item["answer"], cut,
                      item.get("data_source", ""), item.get("extra_info") or {})


def _empty_prompt(raw) -> bool:
    """A prompt with nothing to generate from: null, blank text, or chat messages with no content."""
    if raw is None:
        return True
    if isinstance(raw, str):
        return not raw.strip()
    if isinstance(raw, (list, tuple)):
        return not any(str(m.get("content") or "").strip() for m in raw if isinstance(m, Mapping))
    return False


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
    * rows whose prompt is empty or null (before formatting: ``raw_prompt`` when the item has
      it; a chat prompt with no message content) are skipped and counted in
      ``stats.no_prompt``, or, where an overlong prompt is refused (``truncation="error"``
      without ``filter_overlong``), refused with a :class:`~rljax.config.ConfigError` naming
      the first and how many: there is nothing to generate from (it was trained as a
      one-token prompt).

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
    kept, cut, filtered, truncated, longest = array.array("q"), bytearray(), 0, 0, 0  # 9 bytes a row
    overlong_rows, overlong, no_answer, first_no_answer = [], 0, 0, None
    no_prompt, first_no_prompt = 0, None
    total = 0
    for pos, item in enumerate(source):  # a sequence, or any iterable when only the stats are wanted
        total += 1
        index = int(item.get("index", pos))
        if _empty_prompt(item.get("raw_prompt", item["prompt"])):
            no_prompt += 1
            first_no_prompt = index if first_no_prompt is None else first_no_prompt
            continue
        if item["answer"] is None or not str(item["answer"]).strip():
            no_answer += 1
            if first_no_answer is None:
                first_no_answer = index
            continue
        ids = list(tokenize(item["prompt"]))
        longest = max(longest, len(ids))
        was_cut = False
        if len(ids) > max_length:
            if filter_overlong:
                filtered += 1
                continue
            if truncation == "error":
                if not overlong_rows:
                    overlong_rows.append((index, len(ids)))
                overlong += 1
                continue
            ids = truncate_ids(ids, max_length, truncation)
            truncated += 1
            was_cut = True
        kept.append(pos)
        cut.append(was_cut)
    if no_prompt and truncation == "error" and not filter_overlong:
        raise ConfigError(f"{no_prompt} of {total} rows have an empty or null prompt (first: row {first_no_prompt}); "
                          "fix or drop them, or set data.truncation=left|right or data.filter_overlong_prompts=true "
                          "to skip them (counted)")
    if overlong_rows:
        row, length = overlong_rows[0]
        raise ConfigError(
            f"{overlong} of {total} prompts are longer than data.max_prompt_length={max_length} "
            f"(first: row {row}, {length} tokens); set data.filter_overlong_prompts=true, data.truncation=left|right, "
            "or a larger data.max_prompt_length"
        )
    stats = PromptStats(total, len(kept), filtered, truncated, max_length, longest, no_answer, first_no_answer,
                        no_prompt, first_no_prompt)
    return PreparedPrompts(source, tokenize, np.frombuffer(kept, np.int64) if kept else np.zeros(0, np.int64),
                           np.frombuffer(bytes(cut), bool) if cut else np.zeros(0, bool), stats, truncation)
