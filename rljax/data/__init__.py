"""Datasets: the embedded synthetic task, local GSM8K-format files and any local dataset
(``data.dataset=local``: JSONL / JSON / Parquet files or a ``datasets.save_to_disk``
directory, verl's parquet layout as is) as TFDS array_record datasets streamed from the
files; prompt formatting (``data.prompt_template``, the tokenizer's chat template), the
prompt length policy, deterministic resumable iteration, and the data pre-flight
(:func:`check`).

Typical use by the trainer::

    from rljax.data import check, train_iterator, val_iterator

    check(cfg, tok)                     # before anything is written: one-line ConfigErrors
    tokenize = lambda s: tok.encode(s, add_bos=True)
    it = train_iterator(cfg, tokenize, data_dir=..., state=saved_state_or_None,  # builds once, offline
                        chat_template=tok.apply_chat_template)
    it.source.stats                     # prompts total / kept / filtered / truncated
    batch = next(it)                    # list[Prompt] (ids, answer, data_source, extra_info, row index)
    ckpt["data"] = it.state()           # {"epoch", "position", "seed", "num_examples"}
    for val_batch in val_iterator(cfg, tokenize, data_dir=...): ...

The pieces (:func:`load_split`, :func:`prepare_prompts`, :class:`PromptIterator`) are
public too.

Importing this package does not import TensorFlow or TFDS; :func:`load_split` imports
TFDS (which does not import TensorFlow for array_record data). Nothing is downloaded.
"""

from rljax.config import set_train_row_counter
from rljax.data._check import check, train_prompt_count
from rljax.data._embedded import embedded_example, embedded_examples
from rljax.data._format import PromptFormatter
from rljax.data._iterator import PromptIterator
from rljax.data._local import read_records, split_files
from rljax.data._pipeline import build_prompts, data_seed, train_iterator, val_iterator
from rljax.data._prompts import PreparedPrompts, Prompt, PromptStats, prepare_prompts, truncate_ids
from rljax.data._prng import permutation
from rljax.data._source import DEFAULT_TEMPLATES, PromptSource, hide_tf_gpus, load_split, prepare

set_train_row_counter(train_prompt_count)  # trainer.total_epochs alone: the step count reads the train split

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
    "train_prompt_count",
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
