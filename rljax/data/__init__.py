"""Datasets: the embedded synthetic task and local GSM8K-format files as TFDS array_record
datasets, prompt length policy, and deterministic resumable iteration.

Typical use by the trainer::

    from rljax.data import load_split, prepare_prompts, PromptIterator

    train = load_split(cfg.data, "train", data_dir=...)          # builds once, offline
    prompts = prepare_prompts(train, lambda s: tok.encode(s, add_bos=True),
                              max_length=cfg.data.max_prompt_length,
                              filter_overlong=cfg.data.filter_overlong_prompts,
                              truncation=cfg.data.truncation)     # prompts.stats: counts
    it = PromptIterator(prompts, cfg.data.train_batch_size,
                        seed=cfg.data.seed if cfg.data.seed is not None else cfg.trainer.seed,
                        shuffle=cfg.data.shuffle, state=saved_state_or_None)
    batch = next(it)          # list[Prompt]; it.state() goes into the checkpoint

Importing this package does not import TensorFlow or TFDS; :func:`load_split` imports
TFDS (which does not import TensorFlow for array_record data). Nothing is downloaded.
"""

from rljax.data._embedded import embedded_example, embedded_examples
from rljax.data._iterator import PromptIterator
from rljax.data._local import read_records, split_files
from rljax.data._prompts import PreparedPrompts, Prompt, PromptStats, prepare_prompts, truncate_ids
from rljax.data._prng import permutation
from rljax.data._source import DEFAULT_TEMPLATES, PromptSource, hide_tf_gpus, load_split, prepare

__all__ = [
    "DEFAULT_TEMPLATES",
    "PreparedPrompts",
    "Prompt",
    "PromptIterator",
    "PromptSource",
    "PromptStats",
    "embedded_example",
    "embedded_examples",
    "hide_tf_gpus",
    "load_split",
    "permutation",
    "prepare",
    "prepare_prompts",
    "read_records",
    "split_files",
    "truncate_ids",
]
