"""The data pre-flight: :func:`check` reads a config's dataset as the trainer will, before
anything is written, and raises one-line :class:`~rljax.config.ConfigError` s.

Pure Python (no TFDS, no JAX): the files are streamed by :mod:`rljax.data._local`'s
readers, every prompt is formatted and tokenized exactly as the trainer does (so a config
that passes here does not fail the same way after compilation), and only counts are kept.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from rljax.config import PRESET_POSITIONS
from rljax.data import _local
from rljax.data._embedded import embedded_examples
from rljax.data._prompts import PromptStats, prepare_prompts
from rljax.data._source import formatter
from rljax.errors import ConfigError
from rljax.reward import DATA_SOURCE_REWARDS, extract_gsm8k_answer, normalize_number
from rljax.tokenizer import tokenizer_for

#: Answers of the train split looked at to tell the answer form from what the reward expects.
ANSWER_SAMPLE = 64


def check(config, tokenizer=None) -> None:
    """Checks ``config.data`` against its files; raises :class:`ConfigError` (one line).

    In order, per split (train, then test): the files exist and hold records with the
    prompt and answer fields (``data.prompt_key`` / ``data.answer_key`` / ``data.messages_key``);
    the tokenizer has a chat template when prompts need one (message lists, or
    ``data.apply_chat_template=true``) and it renders them; the answers have the form the
    reward expects (the first :data:`ANSWER_SAMPLE` train answers: GSM8K's ``#### 42`` or a
    number for the GSM8K reward; a ``data_source`` with a built-in reward for
    ``reward.function=auto`` on ``data.dataset=local``); every prompt under
    ``data.max_prompt_length`` / ``data.filter_overlong_prompts`` / ``data.truncation``; at
    least ``data.train_batch_size`` train prompts kept and one test prompt.

    Args:
      config: a resolved :class:`~rljax.config.Config`.
      tokenizer: the run's tokenizer (None: :func:`rljax.tokenizer.tokenizer_for` of ``config.model``).
    """
    if tokenizer is None:
        tokenizer = tokenizer_for(config.model)
    d = config.data
    check_positions(config)
    chat = tokenizer.apply_chat_template if getattr(tokenizer, "chat_template", None) else None
    fmt = formatter(d, chat)

    def tokenize(text):  # as the trainer does
        return tokenizer.encode(text, add_bos=True)

    for split in ("train", "test"):
        where, rows = _rows(d, split)
        if split == "train":
            _check_answers(config, where, rows)
        _check_counts(d, where, split, _stats(d, where, split, rows, fmt, tokenize))


def train_prompt_count(config, tokenizer=None) -> tuple[str, PromptStats]:
    """``(where, stats)`` of the train split as the trainer prepares it: every prompt formatted and
    tokenized, ``stats.kept`` the rows left after ``data.filter_overlong_prompts`` and the
    empty-answer / empty-prompt skips (what one epoch iterates over). :class:`ConfigError` (one
    line) on an unreadable split, as :func:`check`."""
    if tokenizer is None:
        tokenizer = tokenizer_for(config.model)
    d = config.data
    chat = tokenizer.apply_chat_template if getattr(tokenizer, "chat_template", None) else None
    where, rows = _rows(d, "train")
    return where, _stats(d, where, "train", rows, formatter(d, chat), lambda t: tokenizer.encode(t, add_bos=True))


def _stats(d, where: str, split: str, rows: Callable[[], Iterator[dict]], fmt: Callable, tokenize: Callable):
    try:
        return prepare_prompts(_formatted(rows(), fmt, where, split), tokenize, max_length=d.max_prompt_length,
                               filter_overlong=d.filter_overlong_prompts, truncation=d.truncation).stats
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(msg if msg.startswith(where) else f"{where}, {split} split: {msg}") from None
    except (ValueError, OSError) as e:
        raise ConfigError(f"{where}: {' '.join(str(e).split())}") from None


def model_positions(model_cfg) -> tuple[int, str]:
    """``(max_position_embeddings, where it comes from)`` of the run's model: ``model.path``'s
    config.json (transformers' default 4096 when absent, as :func:`rljax.models.hf.config_from_hf`),
    ``model.max_position_embeddings``, or the preset's."""
    import json

    if model_cfg.path:
        file = Path(model_cfg.path).expanduser() / "config.json"
        value = json.loads(file.read_text()).get("max_position_embeddings", 4096)
        return int(value), f"model.path's config.json max_position_embeddings={value}"
    if model_cfg.max_position_embeddings is not None:
        return model_cfg.max_position_embeddings, f"model.max_position_embeddings={model_cfg.max_position_embeddings}"

    value = PRESET_POSITIONS[model_cfg.name]
    return value, f"model.name={model_cfg.name}'s max_position_embeddings={value}"


def check_positions(config) -> None:
    """A prompt and its response fit the model's positions: ``data.max_prompt_length +
    data.max_response_length`` (multi-turn: plus another ``max_response_length`` of context,
    as the sampler reserves) at most ``max_position_embeddings``."""
    d = config.data
    need = d.max_prompt_length + d.max_response_length * (2 if config.env.function is not None else 1)
    have, where = model_positions(config.model)
    if need > have:
        parts = f"data.max_prompt_length={d.max_prompt_length} + data.max_response_length={d.max_response_length}"
        if config.env.function is not None:
            parts += " x 2 (multi-turn context)"
        raise ConfigError(f"{parts} = {need} tokens exceed {where}; shorten the lengths or use a model with more "
                          "positions")


def _formatted(rows: Iterator[dict], fmt: Callable, where: str, split: str) -> Iterator[dict]:
    for r in rows:
        try:
            text = fmt(r["prompt"])
        except ConfigError as e:
            raise ConfigError(f"{where}, {split} split: {e}") from None
        except Exception as e:  # noqa: BLE001 - a chat template is the user's (tokenizer's) code
            raise ConfigError(f"{where}, {split} split, row {r['index']}: the chat template failed to render the "
                              f"prompt ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
        for what, value in (("prompt", text), ("answer", r["answer"])):
            _check_utf8(value, what, f"{where}, {split} split, row {r['index']}")
        yield {"prompt": text, "raw_prompt": r["prompt"], "answer": r["answer"], "index": r["index"]}


def _check_utf8(value, what: str, where: str) -> None:
    """A text that cannot be written as UTF-8 (an unpaired surrogate such as a JSON ``\\udcff``)
    fails here in one line, not later in dataset preparation with a traceback."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"{where}: the {what} holds an unpaired surrogate ({value[e.start]!r} at character "
                              f"{e.start}), which is not UTF-8 text; fix the row or drop it") from None


def _rows(d, split: str) -> tuple[str, Callable[[], Iterator[dict]]]:
    """``(where, rows)``: ``rows()`` streams the split's rows as ``{"prompt", "answer", "index"}``
    (``solution`` for gsm8k, ``data_source`` / ``extra_info`` for local), prompts before formatting."""
    if d.dataset == "embedded":
        return "data.dataset=embedded", lambda: iter(embedded_examples(d.embedded, split))

    if d.dataset == "local" and d.train_files:
        return _listed_rows(d, split)
    where = f"data.path={d.path!r}"
    root = Path(d.path).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{where} is not a directory (cwd {os.getcwd()}); expected a directory holding "
                          "train*.jsonl|.json|.parquet and test* files" +
                          (", or a datasets.save_to_disk directory" if d.dataset == "local" else ""))
    test_names = _local.TEST_NAMES if d.dataset == "local" else ("test",)
    try:
        files = _local.split_files(root, test_names=test_names)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    except (ValueError, OSError) as e:
        raise ConfigError(f"{where}: {' '.join(str(e).split())}") from None
    if split not in files:
        names = "test* (or validation*)" if d.dataset == "local" else "test*"
        raise ConfigError(f"{where} has no {split} file: expected {names}.jsonl, .json or .parquet files, or a "
                          f"datasets directory with a {split} split (the run validates on the test split)")
    if d.dataset == "local":
        def rows():
            return _local.local_rows(files[split], prompt_key=d.prompt_key, answer_key=d.answer_key,
                                     messages_key=d.messages_key)
    else:
        prompt_key, answer_key = _local.gsm8k_keys(d)

        def rows():
            return (ex for _, ex in _local.local_examples(files[split], prompt_key=prompt_key, answer_key=answer_key))
    return where, _guarded(rows, where)


def _listed_rows(d, split: str):
    """``_rows`` for ``data.train_files`` / ``data.val_files`` (verl's keys)."""
    key, spec = ("data.train_files", d.train_files) if split == "train" else ("data.val_files", d.val_files)
    where = f"{key}={spec!r}"
    if not spec:
        raise ConfigError("data.train_files is set but data.val_files is not: name the validation file(s) too "
                          "(the run validates on them)")
    try:
        files = _local.listed_files(spec, key)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ConfigError(" ".join(str(e).split())) from None

    def rows():
        return _local.local_rows(files, prompt_key=d.prompt_key, answer_key=d.answer_key, messages_key=d.messages_key)
    return where, _guarded(rows, where)


def _guarded(rows: Callable[[], Iterator[dict]], where: str) -> Callable[[], Iterator[dict]]:
    def guarded():
        try:
            yield from rows()
        except ImportError as e:
            raise ConfigError(f"{where}: {e}") from None
        except (ValueError, OSError, KeyError) as e:
            raise ConfigError(f"{where}: {' '.join(str(e).split())}") from None
    return guarded


def _check_answers(config, where: str, rows: Callable[[], Iterator[dict]]) -> None:
    """The first :data:`ANSWER_SAMPLE` train answers have the form the run's reward expects."""
    d, spec = config.data, config.reward.function if not config.reward.functions else "reward.functions"
    sample = [r for r in itertools.islice(rows(), ANSWER_SAMPLE) if str(r["answer"]).strip()]
    if not sample:
        return
    n = len(sample)
    key = f"data.answer_key={d.answer_key!r}" if d.answer_key else "the answer field"
    if d.dataset == "local" and spec == "auto":
        for r in sample:
            if r["data_source"] not in DATA_SOURCE_REWARDS:
                raise ConfigError(
                    f"{where}: reward.function=auto has no built-in reward for data_source={r['data_source']!r} "
                    f"(row {r['index']}; built-in: {', '.join(DATA_SOURCE_REWARDS)}); set "
                    "reward.function=path/to/file.py:compute_score (verl's signature works)")
    if d.dataset == "gsm8k" and spec in ("auto", "gsm8k"):
        # the reference is what follows '####' (a bare number also works)
        if not any("####" in r["solution"] or normalize_number(r["solution"]) is not None for r in sample):
            raise ConfigError(
                f"{where}: no '####' in 100% of the first {n} answers ({key}; reward.function={spec} compares the "
                "number after '####'): set data.answer_key or reward.function")
    gsm8k_rows = [r for r in sample if spec == "gsm8k" or (
        d.dataset == "local" and spec == "auto" and DATA_SOURCE_REWARDS.get(r["data_source"]) == "gsm8k")]
    if d.dataset == "local" and gsm8k_rows and not any(_numeric(r["answer"]) for r in gsm8k_rows):
        raise ConfigError(
            f"{where}: no number in 100% of the first {len(gsm8k_rows)} answers ({key}; the GSM8K reward compares "
            "numbers): set data.answer_key or reward.function")


def _numeric(answer: str) -> bool:
    return normalize_number(answer) is not None or extract_gsm8k_answer(answer, fallback_last_number=False) is not None


def _check_counts(d, where: str, split: str, stats) -> None:
    need = d.train_batch_size if split == "train" else 1
    if stats.kept >= need:
        return
    if stats.total and stats.filtered == stats.total:
        raise ConfigError(
            f"{where}, {split} split: all {stats.total} prompts are longer than data.max_prompt_length="
            f"{d.max_prompt_length} tokens (the longest has {stats.longest}) and data.filter_overlong_prompts=true "
            "drops them; raise data.max_prompt_length or set data.truncation=left|right with filtering off"
        )
    if stats.total == 0:
        raise ConfigError(f"{where}: the {split} split is empty")
    kept = f"{stats.kept} usable prompt{'s' if stats.kept != 1 else ''}"
    dropped = (f"{stats.total} rows: {stats.filtered} filtered as overlong, "
               f"{stats.no_answer} with an empty or null answer, {stats.no_prompt} with an empty or null prompt")
    if split == "train":
        raise ConfigError(f"{where}, train split: {kept} ({dropped}) are fewer than data.train_batch_size="
                          f"{d.train_batch_size}; use a smaller batch or a larger dataset")
    raise ConfigError(f"{where}, test split: no usable prompt to validate on ({dropped})")
