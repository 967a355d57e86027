"""Tokenizers: a small built-in character tokenizer, and ``tokenizer.json`` loading.

Pure Python (``tokenizers`` is imported only to read a ``tokenizer.json``), so the launcher
can tokenize a dataset to check it before JAX starts; :mod:`rljax.models.tokenizer`
re-exports these names.

The built-in :class:`CharTokenizer` serves the embedded synthetic task (arithmetic and
string manipulation): one id per character of digits, letters, space and a few symbols,
plus ``<pad>``, ``<bos>``, ``<eos>`` and ``<unk>``. Its vocabulary size is a multiple of 8
and fits the ``tiny`` model preset (128). Real models use :func:`load_tokenizer` on the
checkpoint's ``tokenizer.json`` (the ``tokenizers`` package, imported lazily).
"""

from __future__ import annotations

import os
import string
from collections.abc import Iterable, Sequence

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
DEFAULT_CHARACTERS = string.digits + string.ascii_letters + " +-*/=()<>.,:;?!'\"_#\n"


class CharTokenizer:
    """Character-level tokenizer with ``pad_id=0, bos_id=1, eos_id=2, unk_id=3``.

    ``encode(text)`` maps each character to its id (unknown characters to ``unk_id``);
    ``decode(ids)`` inverts it, dropping special tokens unless ``skip_special=False``.
    """

    def __init__(self, characters: str = DEFAULT_CHARACTERS, *, multiple_of: int = 8):
        if len(set(characters)) != len(characters):
            raise ValueError("CharTokenizer characters must be unique")
        tokens = list(SPECIAL_TOKENS) + list(characters)
        self.vocab_size = -(-len(tokens) // multiple_of) * multiple_of
        self._id = {c: i for i, c in enumerate(tokens)}
        self._tok = tokens
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [self._id.get(c, self.unk_id) for c in text]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if i >= len(self._tok):
                continue  # padding ids added to round the vocabulary up
            if i < len(SPECIAL_TOKENS):
                if not skip_special:
                    out.append(SPECIAL_TOKENS[i])
                continue
            out.append(self._tok[i])
        return "".join(out)

    def batch_encode(self, texts: Sequence[str], **kw) -> list[list[int]]:
        return [self.encode(t, **kw) for t in texts]


class HFTokenizer:
    """Thin wrapper of ``tokenizers.Tokenizer`` with the same ``encode``/``decode`` surface."""

    def __init__(self, tok, *, bos_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        if add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def batch_encode(self, texts: Sequence[str], **kw) -> list[list[int]]:
        return [self.encode(t, **kw) for t in texts]


def load_tokenizer(path: str, *, bos_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None) -> HFTokenizer:
    """Loads ``tokenizer.json`` (``path`` is the file or the checkpoint directory).

    Special ids default to those named in the directory's ``config.json`` when present.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError as e:
        raise ImportError("load_tokenizer needs the 'tokenizers' package: pip install 'rljax[hf]'") from e
    file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise ValueError(f"no tokenizer.json at {file}")
    cfg_path = os.path.join(os.path.dirname(file), "config.json")
    if os.path.exists(cfg_path):
        import json

        with open(cfg_path) as f:
            cfg = json.load(f)
        eos_cfg = cfg.get("eos_token_id")
        bos_id = cfg.get("bos_token_id") if bos_id is None else bos_id
        eos_id = (eos_cfg[0] if isinstance(eos_cfg, list) else eos_cfg) if eos_id is None else eos_id
        pad_id = cfg.get("pad_token_id") if pad_id is None else pad_id
    return HFTokenizer(Tokenizer.from_file(file), bos_id=bos_id, eos_id=eos_id, pad_id=pad_id)


def tokenizer_for(model_cfg):
    """The tokenizer a :class:`~rljax.config.ModelConfig` names: ``model.tokenizer`` (``'char'``
    or a ``tokenizer.json`` path), else ``model.path``'s ``tokenizer.json``, else ``'char'``."""
    spec = model_cfg.tokenizer
    if spec == "char" or (spec is None and not model_cfg.path):
        return CharTokenizer()
    return load_tokenizer(spec or model_cfg.path)
