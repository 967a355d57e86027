"""Prepared datasets as random-access prompt sources (``tfds.data_source`` over array_record)."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

from rljax._tensorflow import hide_tf_gpus
from rljax.data._format import PromptFormatter

DEFAULT_TEMPLATES = {
    "embedded": "{prompt}",
    # verl's GSM8K instruction (examples/data_preprocess/gsm8k.py).
    "gsm8k": '{prompt} Let\'s think step by step and output the final answer after "####".',
    "local": "{prompt}",
}


@contextlib.contextmanager
def _quiet_tfds():
    """No progress bars, no "Downloading and preparing" banner (nothing is downloaded) and no
    absl warnings about custom builder configs while TFDS builds or opens a local dataset."""
    from absl import logging as absl_logging
    from tensorflow_datasets.core.utils import tqdm_utils

    was, verbosity = tqdm_utils._active, absl_logging.get_verbosity()
    tqdm_utils.display_progress_bar(False)
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        absl_logging.set_verbosity(verbosity)
        tqdm_utils.display_progress_bar(was)


def prepare(data_cfg, *, data_dir: str | os.PathLike | None = None):
    """Builds (once; later calls reuse the files) the TFDS dataset of ``data_cfg``; returns the builder.

    Args:
      data_cfg: a :class:`rljax.config.DataConfig`.
      data_dir: TFDS data_dir (default ``data_cfg.data_dir``, then the TFDS default).
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    with _quiet_tfds():
        builder = _prepare(data_cfg, data_dir)
    hide_tf_gpus()
    return builder


def _prepare(data_cfg, data_dir):
    import tensorflow_datasets as tfds

    from rljax.data import _builders, _local  # TensorFlow Datasets: only a TFDS split loads them

    data_dir = data_dir if data_dir is not None else data_cfg.data_dir
    data_dir = None if data_dir is None else str(Path(data_dir).expanduser())
    download_config = None
    if data_cfg.dataset == "embedded":
        builder = _builders.RljaxEmbedded(
            config=_builders.EmbeddedBuilderConfig.from_task(data_cfg.embedded), data_dir=data_dir, file_format="array_record"
        )
    elif data_cfg.dataset == "gsm8k":
        if not data_cfg.path:
            raise ValueError("data.path is required for data.dataset=gsm8k")
        _local.check_not_empty(_local.split_files(data_cfg.path), data_cfg.path)
        prompt_key, answer_key = _local.gsm8k_keys(data_cfg)
        name = "files-" + _local.fingerprint(data_cfg.path, prompt_key, answer_key)
        config = _builders.Gsm8kBuilderConfig(
            name=name, version=_builders.BUILDER_VERSION, prompt_key=prompt_key, answer_key=answer_key
        )
        builder = _builders.RljaxGsm8k(config=config, data_dir=data_dir, file_format="array_record")
        download_config = tfds.download.DownloadConfig(manual_dir=str(Path(data_cfg.path).expanduser()))
    elif data_cfg.dataset == "local":
        if not (data_cfg.path or data_cfg.train_files):
            raise ValueError("data.path (or data.train_files) is required for data.dataset=local")
        files = _local.local_splits(data_cfg)
        _local.check_not_empty(files, data_cfg.path or data_cfg.train_files)
        keys = (data_cfg.prompt_key, data_cfg.answer_key, data_cfg.messages_key)
        name = "local-" + _local.files_fingerprint(files, *map(str, keys))
        config = _builders.LocalBuilderConfig(
            name=name, version=_builders.BUILDER_VERSION, prompt_key=keys[0], answer_key=keys[1], messages_key=keys[2],
            files=tuple((split, tuple(map(str, paths))) for split, paths in sorted(files.items())))
        builder = _builders.RljaxLocal(config=config, data_dir=data_dir, file_format="array_record")
    else:
        raise ValueError(f"unknown data.dataset {data_cfg.dataset!r}; accepted: embedded, gsm8k, local")
    builder.download_and_prepare(download_config=download_config)
    return builder


class PromptSource(Sequence):
    """Random-access examples of one split: ``source[i]`` is a dict with

    * ``prompt``: the formatted prompt text (:class:`~rljax.data.PromptFormatter`:
      ``data.prompt_template``, the chat template),
    * ``raw_prompt``: the text (or message list) before formatting,
    * ``answer``: the reference answer given to the reward function,
    * ``data_source``, ``extra_info``: verl's fields (``""`` and ``{}`` when the dataset has none),
    * ``index``: the example's row in the dataset's generation order (the trace's
      "dataset row index"), ``position``: ``i``.

    ``format`` is a :class:`~rljax.data.PromptFormatter` or a template string.
    """

    def __init__(self, data_source, format, split: str):
        self._ds = data_source
        self._format = PromptFormatter(format) if isinstance(format, str) else format
        self.split = split

    def __len__(self) -> int:
        return len(self._ds)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for a split of {n} examples")
        i = int(i) % n
        rec = self._ds[i]
        raw = _text(rec["prompt"])
        if int(rec.get("chat", 0)):
            raw = json.loads(raw)
        return {
            "prompt": self._format(raw),
            "raw_prompt": raw,
            "answer": _text(rec["answer"]),
            "data_source": _text(rec["data_source"]) if "data_source" in rec else "",
            "extra_info": json.loads(_text(rec["extra_info"])) if "extra_info" in rec else {},
            "index": int(rec["index"]),
            "position": i,
        }


def _text(v) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def formatter(data_cfg, chat_template=None):
    """The :class:`~rljax.data.PromptFormatter` of ``data_cfg`` (``chat_template``: the tokenizer's
    ``apply_chat_template``, None when it has no template)."""
    template = data_cfg.prompt_template if data_cfg.prompt_template is not None else DEFAULT_TEMPLATES[data_cfg.dataset]
    return PromptFormatter(template, apply_chat_template=data_cfg.apply_chat_template,
                           system_prompt=data_cfg.system_prompt, chat_template=chat_template)


def load_split(data_cfg, split: str, *, data_dir: str | os.PathLike | None = None, chat_template=None) -> PromptSource:
    """The ``split`` (``"train"`` or ``"test"``) of ``data_cfg``'s dataset, building it if needed;
    ``chat_template`` renders message lists (the tokenizer's ``apply_chat_template``)."""
    builder = prepare(data_cfg, data_dir=data_dir)
    splits = sorted(builder.info.splits.keys())
    if split not in splits:
        raise ValueError(f"data.dataset={data_cfg.dataset} has no {split!r} split; available: {', '.join(splits)}")
    return PromptSource(builder.as_data_source(split=split), formatter(data_cfg, chat_template), split)
