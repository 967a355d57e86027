"""Datasets: the embedded synthetic task and local GSM8K-format files as TFDS array_record
datasets, prompt length policy, and deterministic resumable iteration.

Typical use by the trainer::

    from rljax.data import train_iterator, val_iterator

    tokenize = lambda s: tok.encode(s, add_bos=True)
    it = train_iterator(cfg, tokenize, data_dir=..., state=saved_state_or_None)  # builds once, offline
    it.source.stats                     # prompts total / kept / filtered / truncated
    batch = next(it)                    # list[Prompt] (ids, answer, dataset row index)
    ckpt["data"] = it.state()           # {"epoch", "position", "seed", "num_examples"}
    for val_batch in val_iterator(cfg, tokenize, data_dir=...): ...

The pieces (:func:`load_split`, :func:`prepare_prompts`, :class:`PromptIterator`) are
public too.

Importing this package does not import TensorFlow or TFDS; :func:`load_split` imports
TFDS (which does not import TensorFlow for array_record data). Nothing is downloaded.
"""

from rljax.data._check import check
from rljax.data._embedded import embedded_example, embedded_examples
from rljax.data._format import PromptFormatter
from rljax.data._iterator import PromptIterator
from rljax.data._local import read_records, split_files
from rljax.data._pipeline import build_prompts, data_seed, train_iterator, val_iterator
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
    "PromptFormatter",
    "build_prompts",
    "check",
    "data_seed",
    "embedded_example",
    "embedded_examples",
    "hide_tf_gpus",
    "load_split",
    "permutation",
    "prepare",
    "prepare_prompts",
    "read_records",
    "split_files",
    "train_iterator",
    "truncate_ids",
    "val_iterator",
]
