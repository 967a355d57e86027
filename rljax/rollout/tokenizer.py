"""JetStream ``Tokenizer`` adapters over rljax's tokenizers (``RljaxEngine.build_tokenizer``).

``TokenizerParameters.path`` names the tokenizer: ``"rljax:char"`` is the built-in
:class:`rljax.models.tokenizer.CharTokenizer` (the embedded task, fits the ``tiny``
vocabulary); a ``tokenizer.json`` file or a checkpoint directory holding one goes through
:func:`rljax.models.tokenizer.load_tokenizer` (the ``hf`` extra's ``tokenizers`` package).
"""

from __future__ import annotations

import numpy as np

from rljax.models.tokenizer import CharTokenizer, load_tokenizer
from rljax.rollout._jetstream import jetstream_api

_tokenizer_api = jetstream_api().tokenizer_api

#: ``TokenizerParameters.path`` that names the built-in character tokenizer.
CHAR_TOKENIZER_PATH = "rljax:char"


class JetStreamTokenizer(_tokenizer_api.Tokenizer):
    """JetStream's ``Tokenizer`` interface over an rljax tokenizer (``encode`` / ``decode`` /
    ``pad_id`` / ``eos_id`` / ``bos_id``). Missing special ids read as ``-1``."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, s: str, *, add_bos: bool = False, **kwargs):
        del kwargs
        ids = np.asarray(self.tokenizer.encode(s, add_bos=add_bos), np.int32)
        return ids, int(ids.size)

    def decode(self, token_ids, **kwargs) -> str:
        return self.tokenizer.decode([int(t) for t in token_ids], **kwargs)

    @property
    def pad_id(self) -> int:
        return -1 if self.tokenizer.pad_id is None else int(self.tokenizer.pad_id)

    @property
    def eos_id(self) -> int:
        return -1 if self.tokenizer.eos_id is None else int(self.tokenizer.eos_id)

    @property
    def bos_id(self) -> int:
        return -1 if self.tokenizer.bos_id is None else int(self.tokenizer.bos_id)


def build_jetstream_tokenizer(path: str, *, vocab_size: int, eos_id=None, pad_id=None, bos_id=None):
    """The tokenizer ``path`` names (see the module docstring), checked against ``vocab_size``."""
    if path == CHAR_TOKENIZER_PATH:
        tok = CharTokenizer()
    else:
        tok = load_tokenizer(path, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)
    if tok.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {path!r} has {tok.vocab_size} ids, more than the model's vocabulary ({vocab_size})")
    return JetStreamTokenizer(tok)
