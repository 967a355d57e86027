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
from pathlib import Path

from rljax.errors import ConfigError

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
        self.chat_template = None

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
    """Thin wrapper of ``tokenizers.Tokenizer`` with the same ``encode``/``decode`` surface.

    ``chat_template`` is the Jinja template of the checkpoint's ``tokenizer_config.json``
    (None without one); :meth:`apply_chat_template` renders it as transformers does.
    """

    def __init__(self, tok, *, bos_id: int | None = None, eos_id: int | None = None, pad_id: int | None = None,
                 chat_template: str | None = None, special_tokens: dict | None = None):
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.bos_id, self.eos_id = bos_id, eos_id
        self.pad_id = pad_id if pad_id is not None else eos_id
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})

    def apply_chat_template(self, messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``[{"role", "content"}, ...]``) under :attr:`chat_template`."""
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat template (tokenizer_config.json chat_template)")
        return render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                    **self.special_tokens)

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None and not (ids and ids[0] == self.bos_id):
            # a chat template that writes the BOS token itself (Llama 3) gets no second one
            ids = [self.bos_id] + ids
        if add_eos and self.eos_id is not None:
            ids = ids + [self.eos_id]
        return ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def batch_encode(self, texts: Sequence[str], **kw) -> list[list[int]]:
        return [self.encode(t, **kw) for t in texts]


def render_chat_template(template: str, messages: Sequence[dict], *, add_generation_prompt: bool = True,
                         **special_tokens) -> str:
    """``template`` rendered for ``messages`` in the sandboxed Jinja environment transformers
    uses (``trim_blocks``, ``lstrip_blocks``, ``raise_exception``, ``tojson``), with
    ``bos_token`` / ``eos_token`` (and the other special tokens given) defined."""
    return _compiled(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                      **special_tokens)


_TEMPLATES: dict = {}


def _compiled(template: str):
    if template not in _TEMPLATES:
        import json

        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        _TEMPLATES[template] = env.from_string(template)
    return _TEMPLATES[template]


def _token_text(value) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


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
    template, special = None, {}
    tc_path = os.path.join(os.path.dirname(file), "tokenizer_config.json")
    if os.path.exists(tc_path):
        import json

        with open(tc_path) as f:
            tc = json.load(f)
        template = tc.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        special = {k: _token_text(tc.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    if template is None and os.path.exists(os.path.join(os.path.dirname(file), "chat_template.jinja")):
        with open(os.path.join(os.path.dirname(file), "chat_template.jinja")) as f:
            template = f.read()
    tok = Tokenizer.from_file(file)
    # tokenizer_config.json names the special tokens by text (transformers' way): their ids
    # where config.json gave none (a tokenizer shipped without the model's config.json)
    bos_id = _token_id(tok, special.get("bos_token")) if bos_id is None else bos_id
    eos_id = _token_id(tok, special.get("eos_token")) if eos_id is None else eos_id
    pad_id = _token_id(tok, special.get("pad_token")) if pad_id is None else pad_id
    return HFTokenizer(tok, bos_id=bos_id, eos_id=eos_id, pad_id=pad_id, chat_template=template,
                       special_tokens=special)


def _token_id(tok, text: str | None) -> int | None:
    return None if text is None else tok.token_to_id(text)


def tokenizer_for(model_cfg):
    """The tokenizer a :class:`~rljax.config.ModelConfig` names: ``model.tokenizer`` (``'char'``
    or a ``tokenizer.json`` path), else ``model.path``'s ``tokenizer.json``, else ``'char'``;
    ``model.eos_token_id`` (when set) is its EOS."""
    spec = model_cfg.tokenizer
    if spec == "char" or (spec is None and not model_cfg.path):
        return CharTokenizer()
    return load_tokenizer(spec or model_cfg.path, eos_id=getattr(model_cfg, "eos_token_id", None))


def checked_tokenizer(model_cfg):
    """``(tokenizer, where its vocabulary comes from)`` for ``model.tokenizer`` / ``model.path``,
    or a :class:`~rljax.errors.ConfigError` naming the key when the file is missing or unreadable
    (what :func:`tokenizer_for` loads, checked for the launcher's preflight)."""
    spec, path = model_cfg.tokenizer, model_cfg.path
    if spec == "char" or (spec is None and not path):
        return CharTokenizer(), "the char tokenizer's"
    key, value = ("model.tokenizer", spec) if spec else ("model.path", path)
    target = Path(value).expanduser()
    file = target / "tokenizer.json" if target.is_dir() else target
    if not file.is_file():
        hint = "" if spec else "; set model.tokenizer to a tokenizer.json path, or 'char'"
        raise ConfigError(f"{key}={value!r} has no tokenizer.json (looked for {str(file)!r}){hint}")
    eos = getattr(model_cfg, "eos_token_id", None)
    try:
        tokenizer = load_tokenizer(str(file), eos_id=eos)
    except ImportError as e:
        raise ConfigError(f"{key}={value!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a corrupt tokenizer.json is the user's file
        raise ConfigError(f"{key}={value!r}: {str(file)!r} is not a readable tokenizer.json "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    if tokenizer.eos_id is None:
        folder = file.parent
        raise ConfigError(f"{key}={value!r}: the tokenizer {str(file)!r} defines no EOS token, so no response could "
                          f"end; set one: \"eos_token\" in {str(folder / 'tokenizer_config.json')!r}, \"eos_token_id\" "
                          f"in {str(folder / 'config.json')!r}, or model.eos_token_id=ID")
    if not 0 <= tokenizer.eos_id < tokenizer.vocab_size:
        source = "model.eos_token_id" if eos is not None else f"the EOS of {str(file)!r}"
        raise ConfigError(f"{source}={tokenizer.eos_id} is not a token id of the tokenizer "
                          f"(accepted: 0 to {tokenizer.vocab_size - 1})")
    return tokenizer, f"{str(file)!r}'s"
