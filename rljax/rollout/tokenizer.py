"""Tokenizers behind ``RljaxEngine.build_tokenizer`` (JetStream's ``Tokenizer`` API).

``ByteTokenizer`` needs no files: ids ``0, 1, 2`` are pad, BOS and EOS, and every other id
below 128 is the ASCII character with that code, so it fits the ``tiny`` model's
128-token vocabulary. ``HFTokenizer`` wraps a Hugging Face ``tokenizer.json`` (the
``tokenizers`` package of the ``hf`` extra) for real checkpoints.
"""

from __future__ import annotations

import os

import numpy as np

from rljax.rollout._jetstream import jetstream_api

_tokenizer_api = jetstream_api().tokenizer_api

#: ``TokenizerParameters.path`` that names :class:`ByteTokenizer`.
BYTE_TOKENIZER_PATH = "rljax:bytes"


class ByteTokenizer(_tokenizer_api.Tokenizer):
    """ASCII characters as their own ids; ``0`` pad, ``1`` BOS, ``2`` EOS."""

    PAD, BOS, EOS = 0, 1, 2

    def __init__(self, vocab_size: int = 128):
        if vocab_size < 128:
            raise ValueError(f"ByteTokenizer needs a vocabulary of at least 128 ids, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, s: str, *, add_bos: bool = False, **kwargs):
        del kwargs
        codes = [ord(c) for c in s]
        bad = [c for c in codes if c >= 128 or c < 3]
        if bad:
            raise ValueError(f"ByteTokenizer encodes ASCII text only (codes 3..127); got code {bad[0]}")
        ids = ([self.BOS] if add_bos else []) + codes
        return np.asarray(ids, np.int32), len(ids)

    def decode(self, token_ids, **kwargs) -> str:
        del kwargs
        return "".join(chr(int(t)) for t in token_ids if 3 <= int(t) < 128)

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def bos_id(self) -> int:
        return self.BOS


class HFTokenizer(_tokenizer_api.Tokenizer):
    """A Hugging Face ``tokenizer.json`` (file or directory) through the ``tokenizers`` package."""

    def __init__(self, path: str, *, eos_id: int | None = None, pad_id: int | None = None, bos_id: int | None = None):
        try:
            from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
        except ImportError as e:
            raise ValueError("HFTokenizer needs the 'tokenizers' package: pip install 'rljax[hf]'") from e
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        self._tok = Tokenizer.from_file(file)
        self._eos, self._pad, self._bos = eos_id, pad_id, bos_id

    def encode(self, s: str, **kwargs):
        del kwargs
        ids = np.asarray(self._tok.encode(s, add_special_tokens=False).ids, np.int32)
        return ids, len(ids)

    def decode(self, token_ids, **kwargs) -> str:
        del kwargs
        return self._tok.decode([int(t) for t in token_ids])

    @property
    def pad_id(self) -> int:
        return -1 if self._pad is None else self._pad

    @property
    def eos_id(self) -> int:
        return -1 if self._eos is None else self._eos

    @property
    def bos_id(self) -> int:
        return -1 if self._bos is None else self._bos
