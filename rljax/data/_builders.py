"""TFDS builders (array_record, generated locally, no download). Imports tensorflow_datasets.

* :class:`RljaxEmbedded`: the embedded synthetic task (:mod:`rljax.data._embedded`).
* :class:`RljaxGsm8k`: GSM8K-format files the user already has (``manual_dir``).

Each builder takes a dynamic ``BuilderConfig`` whose name encodes everything that
determines the content (task parameters; a fingerprint of the local files), so a changed
task or file is rebuilt in a new directory rather than read stale from the cache.
Features: ``prompt`` (text before formatting), ``answer`` (reference answer), ``solution``
(full reference text; empty for the embedded task) and ``index`` (row in generation order).
"""

from __future__ import annotations

import dataclasses
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow_datasets as tfds  # noqa: E402

from rljax.data import _embedded, _local  # noqa: E402

BUILDER_VERSION = tfds.core.Version("1.0.0")


def _features():
    return tfds.features.FeaturesDict(
        {
            "prompt": tfds.features.Text(),
            "answer": tfds.features.Text(),
            "solution": tfds.features.Text(),
            "index": tfds.features.Scalar(np.int64),
        }
    )


@dataclasses.dataclass(eq=False)
class EmbeddedBuilderConfig(tfds.core.BuilderConfig):
    task: str = "add"
    max_operand: int = 9
    length: int = 3
    num_train: int = 2048
    num_test: int = 128
    seed: int = 0

    @classmethod
    def from_task(cls, task) -> "EmbeddedBuilderConfig":
        return cls(
            name=_embedded.embedded_config_name(task), version=BUILDER_VERSION,
            task=task.task, max_operand=task.max_operand, length=task.length,
            num_train=task.num_train, num_test=task.num_test, seed=task.seed,
        )


class RljaxEmbedded(tfds.core.GeneratorBasedBuilder):
    """The embedded synthetic task, generated from a seed (train/test)."""

    VERSION = BUILDER_VERSION
    BUILDER_CONFIGS = [EmbeddedBuilderConfig(name="default", version=BUILDER_VERSION)]

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, description="rljax embedded synthetic task", features=_features())

    def _split_generators(self, dl_manager):
        return {split: self._generate_examples(split) for split in _embedded.SPLITS}

    def _generate_examples(self, split):
        for ex in _embedded.embedded_examples(self.builder_config, split):
            yield ex["index"], {**ex, "solution": ""}


@dataclasses.dataclass(eq=False)
class Gsm8kBuilderConfig(tfds.core.BuilderConfig):
    prompt_key: str = "question"
    answer_key: str = "answer"


class RljaxGsm8k(tfds.core.GeneratorBasedBuilder):
    """GSM8K-format ``question``/``answer`` records from local JSONL/JSON/Parquet files."""

    VERSION = BUILDER_VERSION
    BUILDER_CONFIGS = [Gsm8kBuilderConfig(name="default", version=BUILDER_VERSION)]
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Put train*.jsonl / train*.parquet (and optionally test*) files with 'question' and "
        "'answer' fields in a directory and pass it as data.path."
    )

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, description="GSM8K-format local files", features=_features())

    def _split_generators(self, dl_manager):
        files = _local.split_files(dl_manager.manual_dir)
        return {split: self._generate_examples(paths) for split, paths in files.items()}

    def _generate_examples(self, paths):
        cfg = self.builder_config
        yield from _local.local_examples(paths, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key)


def _local_features():
    return tfds.features.FeaturesDict(
        {
            "prompt": tfds.features.Text(),  # text, or a chat message list as JSON (chat=1)
            "chat": tfds.features.Scalar(np.int64),
            "answer": tfds.features.Text(),
            "solution": tfds.features.Text(),
            "data_source": tfds.features.Text(),
            "extra_info": tfds.features.Text(),  # JSON object
            "index": tfds.features.Scalar(np.int64),
        }
    )


@dataclasses.dataclass(eq=False)
class LocalBuilderConfig(tfds.core.BuilderConfig):
    prompt_key: str | None = None
    answer_key: str | None = None
    messages_key: str | None = None
    files: tuple = ()  # ((split, (path, ...)), ...)


class RljaxLocal(tfds.core.GeneratorBasedBuilder):
    """Any local layout (:func:`rljax.data._local.local_rows`): JSONL / JSON / Parquet files or a
    ``datasets`` directory, verl's parquet layout included. Records are streamed from the
    files into array_record shards, so a split larger than memory is never held whole."""

    VERSION = BUILDER_VERSION
    BUILDER_CONFIGS = [LocalBuilderConfig(name="default", version=BUILDER_VERSION)]

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, description="local files", features=_local_features(),
                                     disable_shuffling=True)

    def _split_generators(self, dl_manager):
        from pathlib import Path

        return {split: self._generate_examples([Path(p) for p in paths]) for split, paths in self.builder_config.files}

    def _generate_examples(self, paths):
        cfg = self.builder_config
        for row in _local.local_rows(paths, prompt_key=cfg.prompt_key, answer_key=cfg.answer_key,
                                     messages_key=cfg.messages_key):
            chat = not isinstance(row["prompt"], str)
            yield row["index"], {
                "prompt": json.dumps(row["prompt"], ensure_ascii=False) if chat else row["prompt"],
                "chat": int(chat),
                "answer": row["answer"],
                "solution": "",
                "data_source": row["data_source"],
                "extra_info": json.dumps(row["extra_info"], ensure_ascii=False, default=str),
                "index": row["index"],
            }
