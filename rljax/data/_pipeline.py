"""One-call wiring from a resolved :class:`~rljax.config.Config` to prompt iterators."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rljax.errors import ConfigError
from rljax.data._iterator import PromptIterator
from rljax.data._prompts import PreparedPrompts, prepare_prompts
from rljax.data._source import load_split

logger = logging.getLogger("rljax.data")


def data_seed(config) -> int:
    """``data.seed``, or ``trainer.seed`` when it is null."""
    return config.data.seed if config.data.seed is not None else config.trainer.seed


def build_prompts(
    config, split: str, tokenize: Callable[[str], Sequence[int]], *, data_dir: str | os.PathLike | None = None,
    chat_template: Callable | None = None,
) -> PreparedPrompts:
    """The ``split``'s prompts, formatted, tokenized, filtered/truncated per ``config.data``.

    Raises :class:`~rljax.config.ConfigError` (one line) for data the run cannot use: a
    missing file or split, an unreadable record, an empty split, or a split left with no
    prompt after filtering. Rows with an empty or null answer (or prompt, where
    :func:`prepare_prompts` skips it) are skipped with one warning naming the first."""
    d = config.data
    try:
        source = load_split(d, split, data_dir=data_dir, chat_template=chat_template)
    except ConfigError:
        raise
    except (OSError, ValueError) as e:  # a missing file or split, a bad record: the user's data, one line
        raise ConfigError(" ".join(str(e).split())) from e
    prompts = prepare_prompts(source, tokenize, max_length=d.max_prompt_length,
                              filter_overlong=d.filter_overlong_prompts, truncation=d.truncation)
    s = prompts.stats
    for n, what, first in ((s.no_prompt, "prompt", s.first_no_prompt), (s.no_answer, "answer", s.first_no_answer)):
        if n:
            logger.warning("data: %d of %d %s rows have an empty or null %s and were skipped (first: row %d)",
                           n, s.total, split, what, first)
    if not len(prompts):
        raise ConfigError(f"data: the {split} split has no usable prompt: {s.total} rows, {s.filtered} filtered as "
                          f"overlong, {s.no_answer} with an empty or null answer, {s.no_prompt} with an empty or "
                          "null prompt")
    return prompts


def train_iterator(
    config,
    tokenize: Callable[[str], Sequence[int]],
    *,
    data_dir: str | os.PathLike | None = None,
    state: Mapping[str, Any] | None = None,
    chat_template: Callable | None = None,
) -> PromptIterator:
    """Endless batches of ``data.train_batch_size`` prompts from the train split.

    ``iterator.source.stats`` holds the filter/truncation counts; ``iterator.state()`` is
    what the checkpoint saves and ``state=`` resumes from.
    """
    prompts = build_prompts(config, "train", tokenize, data_dir=data_dir, chat_template=chat_template)
    return PromptIterator(
        prompts, config.data.train_batch_size, seed=data_seed(config), shuffle=config.data.shuffle,
        drop_last=True, state=state,
    )


def val_iterator(
    config, tokenize: Callable[[str], Sequence[int]], *, data_dir: str | os.PathLike | None = None,
    chat_template: Callable | None = None, prompts: PreparedPrompts | None = None,
) -> PromptIterator:
    """One in-order pass over the test split in batches of ``data.val_batch_size`` (null: one
    batch); the last batch may be shorter (pad it and mark ``is_padding``). ``prompts``: the
    split as :func:`build_prompts` returned it before (a run validating every
    ``trainer.test_freq`` steps reads and tokenizes the split once)."""
    if prompts is None:
        prompts = build_prompts(config, "test", tokenize, data_dir=data_dir, chat_template=chat_template)
    size = config.data.val_batch_size or len(prompts)
    return PromptIterator(prompts, size, seed=0, shuffle=False, drop_last=False, num_epochs=1)
