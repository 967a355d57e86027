"""Tokenizers (see :mod:`rljax.tokenizer`, where they live so that importing them needs no JAX)."""

from rljax.tokenizer import (  # noqa: F401
    DEFAULT_CHARACTERS,
    SPECIAL_TOKENS,
    CharTokenizer,
    HFTokenizer,
    load_tokenizer,
    tokenizer_for,
)
