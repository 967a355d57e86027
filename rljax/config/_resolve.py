"""Resolution: code defaults, then a YAML preset, then ``key=value`` overrides, with provenance.

Every leaf field of :class:`~rljax.config.Config` is addressed by its dotted key
(``actor.optim.lr``). :func:`resolve` returns the frozen config and a :class:`Provenance`:
``{dotted_key: source}`` of the last writer (``"default"``, the preset file path, or
``"cli"``) and, per key, the whole chain of writers with the value each one set.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from rljax.config import _own, _verl
from rljax.config._schema import Config
from rljax.config._validate import validate as validate_config
from rljax.errors import ConfigError

DEFAULT = "default"
CLI = "cli"
_SOURCE_TAG = "  # from: "
_CHAIN_TAG = "  # chain: "
_FLOAT_RE = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


# ---------------------------------------------------------------------------- schema walk


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    key: str  # dotted
    type: Any
    default: Any
    doc: str
    bounds: tuple  # (gt, ge, lt, le)


def _is_section(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _default_of(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def _walk(cls, prefix: str, default_obj) -> list[FieldSpec]:
    out = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        value = getattr(default_obj, f.name)
        if _is_section(tp):
            out.extend(_walk(tp, key + ".", value))
        else:
            m = f.metadata
            out.append(FieldSpec(key, tp, value, m.get("doc", ""), (m.get("gt"), m.get("ge"), m.get("lt"), m.get("le"))))
    return out


@lru_cache(maxsize=None)
def field_specs() -> dict[str, FieldSpec]:
    """Every leaf field of :class:`Config` by dotted key, in schema order."""
    return {s.key: s for s in _walk(Config, "", Config())}


@lru_cache(maxsize=None)
def _section_keys() -> frozenset:
    keys = set()
    for k in field_specs():
        parts = k.split(".")
        for i in range(1, len(parts)):
            keys.add(".".join(parts[:i]))
    return frozenset(keys)


# ---------------------------------------------------------------------------- type coercion


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, typing.get_args(tp)))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is tuple:
        args = typing.get_args(tp)
        return f"a list of {len(args)} numbers" if args and args[-1] is not Ellipsis else "a list"
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(tp, getattr(tp, "__name__", str(tp)))


def _show(value) -> str:
    return repr(value) if isinstance(value, str) else _scalar_text(value)


def _coerce(key: str, value: Any, tp) -> Any:
    """``value`` (as YAML loaded it) checked against and converted to the field type ``tp``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            if value is None:
                raise ConfigError(f"{key}=null is not accepted; expected {_type_name(inner[0])}")
            return _coerce(key, value, inner[0])
    if value is None:
        raise ConfigError(f"{key}=null is not accepted; expected {_type_name(tp)}")
    if origin is typing.Literal:
        accepted = typing.get_args(tp)
        if isinstance(value, bool) and str(value).lower() in accepted:  # YAML's true/false for an auto|true|false key
            return str(value).lower()
        if isinstance(value, bool) and {"on", "off"} <= set(accepted):  # YAML 1.1 reads on / off as booleans
            return "on" if value else "off"
        if isinstance(value, str) and value.lower() in ("true", "false") and value.lower() in accepted:
            return value.lower()  # Hydra's True / False (verl's command lines) for an auto|true|false key
        if value not in accepted or isinstance(value, bool):
            raise ConfigError(f"{key}={_show(value)} is not accepted; accepted: {', '.join(map(str, accepted))}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)) or (args[-1] is not Ellipsis and len(value) != len(args)):
            raise ConfigError(f"{key}={_show(value)} has the wrong type; expected {_type_name(tp)}, "
                              f"e.g. {_list_example(key, tp)}")
        elem = args[0] if args[-1] is Ellipsis else None
        return tuple(_coerce(key, v, elem or a) for v, a in zip(value, args if elem is None else [elem] * len(value)))
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads '1e-6' (no dot) as a string; accept it as the float it means.
        if isinstance(value, str) and _FLOAT_RE.match(value.strip()):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):  # `experiment_name: 2024`, a threshold 2.0
            return str(value)
    else:  # pragma: no cover - schema only uses the types above
        raise TypeError(f"unsupported field type {tp!r} for {key}")
    raise ConfigError(f"{key}={_show(value)} has the wrong type; expected {_type_name(tp)}")


def _list_example(key: str, tp) -> str:
    """An override value of list key ``key``: its default when not empty, else its first accepted element."""
    spec = field_specs().get(key)
    items = list(spec.default) if spec is not None and spec.default else []
    if not items:
        elem = typing.get_args(tp)[0]
        items = [typing.get_args(elem)[0]] if typing.get_origin(elem) is typing.Literal else []
    return "[" + ",".join(_scalar_text(v) for v in items) + "]"


def _check_bounds(spec: FieldSpec, value) -> None:
    if value is None or isinstance(value, (str, bool, tuple)):
        return
    gt, ge, lt, le = spec.bounds
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{spec.key}={value} is out of range; it must be a finite number")
    for bound, ok, word in ((gt, lambda b: value > b, ">"), (ge, lambda b: value >= b, ">="),
                            (lt, lambda b: value < b, "<"), (le, lambda b: value <= b, "<=")):
        if bound is not None and not ok(bound):
            rng = " and ".join(f"{w} {b}" for b, w in zip(spec.bounds, (">", ">=", "<", "<=")) if b is not None)
            raise ConfigError(f"{spec.key}={value} is out of range; it must be {rng}")


# ---------------------------------------------------------------------------- keys


def _is_subsequence(parts: list[str], of: list[str]) -> bool:
    it = iter(of)
    return all(p in it for p in parts)


def _nested(key: str) -> list[str]:
    """Keys with the same leaf whose path contains ``key``'s sections in order: ``actor.lr`` ->
    ``actor.optim.lr``, ``kl_ctrl.type`` -> ``algorithm.kl_ctrl.type``, ``lr`` -> both optimizers' ``lr``."""
    parts = key.split(".")
    return [k for k in field_specs() if k.rsplit(".", 1)[-1] == parts[-1] and _is_subsequence(parts, k.split("."))]


def _suggest(key: str) -> str:
    nested = _nested(key)
    if nested:
        more = f" (or {', '.join(nested[1:])})" if len(nested) > 1 else ""
        return f"; did you mean {nested[0]}?{more}"
    candidates = list(field_specs()) + sorted(_section_keys())
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    if not close:  # a misspelt last component under the right section, or a right leaf under the wrong one
        leaf = key.rsplit(".", 1)[-1]
        by_leaf: dict[str, str] = {}
        for k in field_specs():  # the first section holding a leaf name wins (actor before critic)
            by_leaf.setdefault(k.rsplit(".", 1)[-1], k)
        hit = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
        close = [by_leaf[hit[0]]] if hit else []
    return (f"; did you mean {close[0]}?" if close else
            "; python -m rljax.launch --print-config lists the accepted keys")


#: Keys that were accepted once and did nothing; naming one says why it went.
REMOVED_KEYS = {
    "rollout.calculate_log_probs": "the sampler always records each token's log-prob (rollout_logp)",
    "rollout.max_staleness": "it is async_training.max_staleness (with trainer.mode=async)",
}


#: verl keys rljax spells or does differently, where the closest-name guess would mislead
#: (``reward_model.enable`` -> ``reward.model.label``); naming one says what rljax does instead.
VERL_KEYS = {
    "data.gen_batch_size": ("with algorithm.filter_groups rljax draws every batch, refills included, as "
                            "data.train_batch_size prompts (a separate generation batch size is not supported yet)"),
}


def _unknown(key: str, where: str) -> ConfigError:
    if key in REMOVED_KEYS:
        return ConfigError(f"config key {key!r}{where} was removed: {REMOVED_KEYS[key]}; delete it")
    if key in VERL_KEYS:
        return ConfigError(f"config key {key!r}{where} is verl's: {VERL_KEYS[key]}")
    return ConfigError(f"unknown config key {key!r}{where}{_suggest(key)}")


def _flatten(tree: Mapping, where: str, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        if not isinstance(k, str):
            raise ConfigError(f"config key {k!r}{where} is not a string")
        key = f"{prefix}{k}".lstrip("+")
        if key in field_specs() or _verl.is_verl_key(key):
            out[key] = v
        elif key in _section_keys() or key in _verl.verl_key_prefixes():
            if not isinstance(v, Mapping):
                raise ConfigError(f"{key}{where} is a section; it needs a mapping of keys, got {_show(v)}")
            out.update(_flatten(v, where, key + "."))
        else:
            raise _unknown(key, where)
    return out


# ---------------------------------------------------------------------------- presets and overrides


def _repo_configs_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "configs"


def preset_dirs() -> list[Path]:
    """Where bare preset names are looked up: ``$RLJAX_CONFIGS``, ``./configs``, the repository's ``configs/``."""
    dirs = []
    if os.environ.get("RLJAX_CONFIGS"):
        dirs.append(Path(os.environ["RLJAX_CONFIGS"]))
    dirs += [Path.cwd() / "configs", _repo_configs_dir()]
    seen, out = set(), []
    for d in dirs:
        r = d.resolve()
        if r not in seen:
            seen.add(r)
            out.append(d)
    return out


def find_preset(name_or_path: str | os.PathLike) -> Path:
    """A preset path: an existing file as given, else ``<name>.yaml`` in :func:`preset_dirs`."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    name = p.name if p.suffix in (".yaml", ".yml") else p.name + ".yaml"
    if len(p.parts) == 1:
        for d in preset_dirs():
            if (d / name).is_file():
                return d / name
    available = sorted({q.stem for d in preset_dirs() if d.is_dir() for q in d.glob("*.yaml")})
    raise ConfigError(
        f"preset {str(name_or_path)!r} not found (a file path, or a name in {', '.join(map(str, preset_dirs()))}); "
        f"available: {', '.join(available) or 'none'}"
    )


def load_preset(path: str | os.PathLike) -> dict[str, Any]:
    """A preset file as ``{dotted_key: raw value}``; unknown keys raise :class:`ConfigError`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read preset {str(path)!r}: {e.strerror or e}") from None
    try:
        tree = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"preset {str(path)!r}{at} is not valid YAML: {getattr(e, 'problem', e)}") from None
    if tree is None:
        return {}
    if not isinstance(tree, Mapping):
        raise ConfigError(f"preset {str(path)!r} must be a mapping of config keys, got {type(tree).__name__}")
    return _flatten(tree, f" in preset {str(path)!r}")


def parse_override(text: str) -> tuple[str, Any]:
    """``"actor.optim.lr=1e-6"`` -> ``("actor.optim.lr", 1e-06)``; values follow YAML scalar rules.

    ``key=`` gives the empty string; ``key=null`` gives None; ``key=[0.9,0.999]`` a list. A verl
    key of the same meaning gives the rljax key (``actor_rollout_ref.rollout.n=5`` ->
    ``("rollout.n", 5)``); a verl key rljax has no key for stays as it is (:mod:`rljax.config._verl`).
    """
    return _parse_override(text)[:2]


def _parse_override(text: str) -> tuple[str, Any, str | None]:
    """:func:`parse_override` and the verl key an alias was written as (None: an rljax key)."""
    if not isinstance(text, str) or "=" not in text:
        raise ConfigError(f"malformed override {text!r}; expected key=value, e.g. rollout.n=8")
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.startswith("--"):
        key = key[2:]
    key = key.lstrip("+")  # Hydra's +key=value / ++key=value (verl's command lines add keys so)
    if not key or any(c.isspace() for c in key):
        raise ConfigError(f"malformed override {text!r}; expected key=value with a dotted key, e.g. rollout.n=8")
    verl = None
    if key in _verl.ALIASES:
        verl, key = key, _verl.ALIASES[key]
    elif _verl.is_verl_key(key):
        return key, _parse_value(raw, Any), key
    if key not in field_specs():
        if key in _section_keys():
            raise ConfigError(f"override {text!r} names the section {key!r}; set one of its keys, e.g. {_first_leaf(key)}=...")
        raise _unknown(key, " (command line)")
    return key, _parse_value(raw, field_specs()[key].type), verl


def _is_textual(tp) -> bool:
    """str, a Literal of strings, or Optional of those: such values are taken verbatim."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return all(_is_textual(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is typing.Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    return tp is str


def _parse_value(raw: str, tp) -> Any:
    text = raw.strip()
    if text in ("null", "Null", "NULL", "~"):
        return None
    if _is_textual(tp) and not (len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""):
        return raw  # verbatim: paths, templates with ':' or '#', names like qwen2.5-0.5b
    if text == "":
        return ""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return raw  # not YAML (e.g. an unbalanced bracket): type checking reports it
    if isinstance(value, (dict, set)) or (isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value)):
        return raw
    return value


def _first_leaf(section: str) -> str:
    return next(k for k in field_specs() if k.startswith(section + "."))


# ---------------------------------------------------------------------------- build


class Provenance(dict):
    """Where each field's value came from.

    A ``dict`` ``{dotted_key: source}`` of the last writer (``"default"``, a preset path, or
    ``"cli"``), plus :meth:`chain`: every writer in order with the value it set, e.g.
    ``(("default", 8), ("configs/default.yaml", 16), ("cli", 4))`` for ``rollout.n``.
    """

    def __init__(self, sources: Mapping[str, str] = (), chains: Mapping[str, Sequence] | None = None,
                 verl: Mapping[str, tuple] | None = None):
        super().__init__(sources)
        self.chains: dict[str, tuple] = {k: tuple(map(tuple, v)) for k, v in (chains or {}).items()}
        #: verl settings with no rljax key, accepted as what rljax does: ``{verl key: (value, what rljax does)}``.
        self.verl: dict[str, tuple] = dict(verl or {})

    def chain(self, key: str) -> tuple[tuple[str, Any], ...]:
        """``((source, value), ...)`` from the code default to the final value of ``key``."""
        if key in self.chains:
            return self.chains[key]
        spec = field_specs().get(key)
        return ((DEFAULT, spec.default if spec else None),) if self.get(key, DEFAULT) == DEFAULT else ()


def format_chain(chain: Sequence) -> str:
    """``default 8 -> configs/default.yaml 16 -> cli 4``."""
    return " -> ".join(f"{src} {_scalar_text(v)}" for src, v in chain)


#: ``(schema dataclass, key prefix) -> class`` that :func:`resolve` and :func:`load_resolved`
#: build each config section with; None: the schema's own classes. Set by
#: :func:`set_section_class` (the test that every key is read installs a recording subclass).
_section_class = None


def set_section_class(fn):
    """Installs ``fn(cls, prefix) -> subclass of cls`` for building config sections (None: the
    schema's classes); returns the previous one. For tests that observe how configs are read."""
    global _section_class
    previous, _section_class = _section_class, fn
    return previous


def _build(cls, values: Mapping[str, Any], prefix: str = ""):
    kwargs = {}
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if _is_section(hints[f.name]):
            kwargs[f.name] = _build(hints[f.name], values, key + ".")
        else:
            kwargs[f.name] = values[key]
    return (cls if _section_class is None else _section_class(cls, prefix))(**kwargs)


def _apply(values: dict, provenance: dict, raw: Mapping[str, Any], source: str, chains: dict | None = None) -> None:
    specs = field_specs()
    for key, v in raw.items():
        spec = specs[key]
        value = _coerce(key, v, spec.type)
        _check_bounds(spec, value)
        values[key] = value
        provenance[key] = source
        if chains is not None:
            chains[key].append((source, value))


def resolve_run(config_name: str | None, overrides: Sequence[str] = (), *, validate: bool = True):
    """:func:`resolve` as the launcher (and :func:`rljax.train`) resolves a run: ``--config`` or, with
    none, ``configs/own.yaml`` for your own model / data else ``configs/default.yaml``, with the
    derived defaults of :mod:`rljax.config._own` (lengths within the model's context, a run
    directory named after the model and the data)."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of key=value strings, got the single string {overrides!r}")
    given = _own.given_keys(_parse_override(o) for o in overrides)
    return resolve(_own.launch_preset(config_name, given), overrides, validate=validate, _derive=True)


def resolve(preset_path: str | os.PathLike | None = None, overrides: Sequence[str] = (), *, validate: bool = True,
            _derive: bool = False):
    """Resolves the configuration: code defaults, then the preset, then the overrides.

    Args:
      preset_path: a YAML preset (a path, or a bare name such as ``"default"`` looked up by
        :func:`find_preset`); None uses the code defaults only.
      overrides: ``key=value`` strings applied in order (later wins).
      validate: run the cross-field checks of :func:`rljax.config.validate`.

    Returns:
      ``(config, provenance)``: the frozen :class:`Config` and a :class:`Provenance`,
      ``{dotted_key: source}`` with source ``"default"``, the preset path as a string, or
      ``"cli"``, whose ``chain(key)`` lists every writer with its value.

    Raises:
      ConfigError: one line naming the key and what is accepted.
    """
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of key=value strings, got the single string {overrides!r}")
    specs = field_specs()
    values = {k: s.default for k, s in specs.items()}
    provenance = {k: DEFAULT for k in specs}
    chains = {k: [(DEFAULT, s.default)] for k, s in specs.items()}
    verl = _VerlSettings()
    if preset_path is not None:
        path = find_preset(preset_path)
        for key, value in load_preset(path).items():
            _apply(values, provenance, *verl.take(key, value, str(path)), chains)
    parsed = [_parse_override(o) for o in overrides]
    for key, value, written in parsed:
        _apply(values, provenance, *verl.take(written or key, value, CLI), chains)
    _apply(values, provenance, *verl.reward_function(), chains)
    verl.check(values)
    if _derive:  # the launcher's own-model / own-data defaults (rljax.config._own)
        given = _own.given_keys(parsed) | ({"reward.function"} if verl.reward else set())
        derived = _own.Derivations(values, provenance, given, Path(str(preset_path)).stem if preset_path else "")
        for key, value, source in derived.apply():
            _apply(values, provenance, {key: value}, source, chains)
    config = _build(Config, values)
    if validate:
        validate_config(config)
        if verl.epochs_alone is not None:  # (a --plan resolves unvalidated: it reads no data)
            steps, source = _verl.steps_from_epochs(config, verl.epochs_alone)
            _apply(values, provenance, {"trainer.total_steps": steps}, source, chains)
            config = _build(Config, values)
    return config, Provenance(provenance, chains, verl.accepted)


class _VerlSettings:
    """The verl keys of one resolution: aliases become their rljax keys (the source names the verl
    key), ``custom_reward_function.path`` + ``.name`` become ``reward.function``, and settings with
    no rljax key are checked and kept (:attr:`accepted`) or refused in one line."""

    def __init__(self):
        self.accepted: dict[str, tuple] = {}
        self.reward: dict[str, tuple] = {}
        self.sources: dict[str, set] = {}  # trainer.total_steps / total_epochs: who wrote them
        self.epochs_alone: int | None = None  # trainer.total_epochs with no step count beside it

    def take(self, key: str, value, source: str) -> tuple[dict, str]:
        """``(raw {rljax key: value}, source)`` for :func:`_apply` (empty for a setting with no key)."""
        if _verl.ALIASES.get(key, key) in ("trainer.total_steps", _verl.EPOCHS_KEY):
            self.sources.setdefault(_verl.ALIASES.get(key, key), set()).add(source)
        if key in _verl.ALIASES:
            return {_verl.ALIASES[key]: value}, f"{source} (verl {key})"
        if key in _verl.REWARD_FUNCTION_KEYS:
            self.reward[key] = (value, source)
            return {}, source
        if key in _verl.NO_COUNTERPART:
            accepts, what = _verl.NO_COUNTERPART[key]
            if not accepts(value):
                raise ConfigError(f"{key}={_show(value)} (verl's) is not supported: {what}; "
                                  f"accepted: {accepts.accepted}")
            self.accepted[key] = (value, what)
            return {}, source
        return {key: value}, source

    def reward_function(self) -> tuple[dict, str]:
        """verl's custom_reward_function.path / .name as ``reward.function='path:name'``."""
        path_key, name_key = _verl.REWARD_FUNCTION_KEYS
        path, source = self.reward.get(path_key, (None, None))
        name = self.reward.get(name_key, ("compute_score",))[0]
        if path is None:
            if name_key in self.reward and self.reward[name_key][0] is not None:
                raise ConfigError(f"{name_key}={_show(name)} needs {path_key} (the file that defines it)")
            return {}, ""
        if not isinstance(path, str) or not isinstance(name, str) or not name:
            raise ConfigError(f"{path_key}={_show(path)} / {name_key}={_show(name)}: expected a file path and a "
                              "function name")
        return {"reward.function": f"{path}:{name}"}, f"{source} (verl {path_key} + {name_key})"

    def check(self, values: dict) -> None:
        """verl's reward_model.enable agrees with reward.model.path (rljax's switch); verl's
        trainer.total_epochs without a step count from the command line or its own file sets
        :attr:`epochs_alone` (the step count then comes from the data, :func:`_verl.steps_from_epochs`)."""
        if _verl.EPOCHS_KEY in self.accepted and not (self.sources.get("trainer.total_steps", set())
                                                     & (self.sources[_verl.EPOCHS_KEY] | {CLI})):
            self.epochs_alone = self.accepted[_verl.EPOCHS_KEY][0]
        for key in ("reward_model.enable", "reward.reward_model.enable"):
            if key not in self.accepted:
                continue
            enable, has_path = self.accepted[key][0], values["reward.model.path"] is not None
            if bool(enable) != has_path:
                raise ConfigError(f"{key}={_show(enable)} (verl's) but reward.model.path is "
                                  f"{'set' if has_path else 'null'}: in rljax the path alone turns the reward model "
                                  "on; set reward_model.model.path (reward.model.path) or drop reward_model.enable")


# ---------------------------------------------------------------------------- views


def to_flat_dict(config) -> dict[str, Any]:
    """``{dotted_key: value}`` of every leaf field, in schema order (tuples stay tuples)."""
    out = {}
    for key in field_specs():
        obj = config
        for part in key.split("."):
            obj = getattr(obj, part)
        out[key] = obj
    return out


def to_dict(config) -> dict[str, Any]:
    """The config as nested plain dicts and lists (YAML/JSON friendly)."""
    def conv(v):
        if dataclasses.is_dataclass(v):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, tuple):
            return [conv(x) for x in v]
        return v

    return conv(config)


def get(config, key: str) -> Any:
    """The value at a dotted key, e.g. ``get(cfg, "actor.optim.lr")``."""
    if key not in field_specs():
        raise _unknown(key, "")
    return to_flat_dict(config)[key]


@dataclasses.dataclass(frozen=True)
class Change:
    """A field whose resolved value differs from its code default."""

    key: str
    value: Any
    default: Any
    source: str
    chain: tuple = ()

    def __str__(self) -> str:
        text = f"{self.key}={_scalar_text(self.value)} (default {_scalar_text(self.default)}; from {self.source}"
        earlier = [c for c in self.chain[1:-1]]
        if earlier:
            text += ", over " + ", ".join(f"{src} {_scalar_text(v)}" for src, v in earlier)
        return text + ")"


def non_default_fields(config, provenance: Mapping[str, str]) -> list[Change]:
    """Fields whose value differs from the code default or was derived (``derived: ...``), with their
    source (and, from a :class:`Provenance`, the chain of writers), in schema order."""
    specs = field_specs()
    chain = provenance.chain if isinstance(provenance, Provenance) else (lambda k: ())
    return [
        Change(k, v, specs[k].default, provenance.get(k, DEFAULT), chain(k))
        for k, v in to_flat_dict(config).items()
        if v != specs[k].default or type(v) is not type(specs[k].default)
        or str(provenance.get(k, DEFAULT)).startswith("derived:")
    ]


def describe() -> str:
    """Every accepted key with its type, default and meaning (for ``--help``)."""
    lines = []
    for s in field_specs().values():
        lines.append(f"{s.key} ({_type_name(s.type)}; default {_scalar_text(s.default)}): {s.doc}")
    return "\n".join(lines)


def format_config(config, provenance: Mapping[str, str]) -> str:
    """Every key with its value, source (the chain of writers when more than the default) and
    one-line doc, aligned in columns (``python -m rljax.launch --print-config``)."""
    specs = field_specs()
    chain = provenance.chain if isinstance(provenance, Provenance) else (lambda k: ())
    cwd = os.getcwd() + os.sep

    def short(src: str) -> str:  # preset paths under the working directory, relative
        return src[len(cwd):] if src.startswith(cwd) else src

    rows = [("key", "value", "source", "doc")]
    for key, value in to_flat_dict(config).items():
        c = chain(key)
        source = short(provenance.get(key, DEFAULT))
        if len(c) > 1:
            source += " (" + " -> ".join(f"{short(src)} {_scalar_text(v)}" for src, v in c[:-1]) + ")"
        rows.append((key, _scalar_text(value), source, specs[key].doc))
    # Columns fit most cells; a longer cell (a prompt template) pushes only its own row.
    widths = [max(len(r[i]) for r in rows if len(r[i]) <= cap) for i, cap in enumerate((60, 24, 48))]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]}".rstrip() for r in rows]
    for key, (value, what) in getattr(provenance, "verl", {}).items():
        lines.append(f"verl {key}={_scalar_text(value)}: no rljax key, accepted as what rljax does: {what}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- config.resolved.yaml


def _scalar_text(v: Any) -> str:
    """One-line YAML for a scalar or a flat list, loadable back to the same value."""
    if isinstance(v, tuple):
        v = list(v)
    if isinstance(v, str) and any(c in v for c in "\n\r\t") or (isinstance(v, str) and not v.isprintable()):
        return json.dumps(v, ensure_ascii=False)  # a JSON string is a YAML double-quoted scalar
    text = yaml.safe_dump([v], default_flow_style=True, width=sys.maxsize, allow_unicode=True).strip()
    return text[1:-1]


def write_resolved(config, provenance: Mapping[str, str], path: str | os.PathLike) -> Path:
    """Writes ``config.resolved.yaml``: nested YAML with ``# from: <source>`` beside each field.

    The file loads back with plain ``yaml.safe_load`` (the comments are ignored), can be
    used as a preset to rerun with the same values, and :func:`load_resolved` recovers the
    provenance too. ``path`` may be a directory (the file is then
    ``<path>/config.resolved.yaml``). The file is written atomically.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.resolved.yaml"
    flat = to_flat_dict(config)
    chain = provenance.chain if isinstance(provenance, Provenance) else (lambda k: ())
    lines = [
        "# rljax resolved configuration. Each field's source: default (code), a preset file, or cli;",
        "# '# chain:' lists every writer of a field with the value it set, in order.",
        "# Rerun with the same values and run directory: python -m rljax.launch --config <this file>",
        "# (add --resume to continue from its checkpoints, or --run-dir DIR for a new run)",
    ]
    open_sections: list[str] = []
    for key, value in flat.items():
        *sections, leaf = key.split(".")
        common = 0
        while common < min(len(sections), len(open_sections)) and sections[common] == open_sections[common]:
            common += 1
        for depth in range(common, len(sections)):
            lines.append("  " * depth + f"{sections[depth]}:")
        open_sections = sections
        source = provenance.get(key, DEFAULT).replace("\n", " ")
        line = "  " * len(sections) + f"{leaf}: {_scalar_text(value)}{_SOURCE_TAG}{source}"
        c = chain(key)
        if len(c) > 1:  # JSON with no '#' (escaped), so the comment tags stay unambiguous
            text = json.dumps([[src, list(v) if isinstance(v, tuple) else v] for src, v in c], ensure_ascii=True)
            line += _CHAIN_TAG + text.replace("#", "\\u0023")
        lines.append(line)
    for key, (value, what) in getattr(provenance, "verl", {}).items():
        lines.append(f"# verl {key}={_scalar_text(value)}: no rljax key, accepted as what rljax does: {what}")
    tmp = path.with_name(path.name + ".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def load_resolved(path: str | os.PathLike):
    """Reads a ``config.resolved.yaml`` back: ``(config, provenance)`` as written."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.resolved.yaml"
    raw = load_preset(path)
    specs = field_specs()
    values = {k: s.default for k, s in specs.items()}
    _apply(values, {}, raw, "")
    provenance = {k: DEFAULT for k in specs}
    chains = {k: ((DEFAULT, s.default),) for k, s in specs.items()}
    stack: list[tuple[int, str]] = []
    for line in path.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip(" "))
        name = line.strip().split(":", 1)[0]
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key = ".".join([s for _, s in stack] + [name])
        if key in specs and _SOURCE_TAG in line:
            chain_text = None
            if _CHAIN_TAG in line:
                line, chain_text = line.rsplit(_CHAIN_TAG, 1)
            provenance[key] = source = line.rsplit(_SOURCE_TAG, 1)[1].strip()
            if chain_text is not None:
                try:
                    chains[key] = tuple((src, _coerce(key, v, specs[key].type)) for src, v in json.loads(chain_text))
                except (ValueError, TypeError):
                    raise ConfigError(f"{str(path)!r}: the chain of {key} is not readable: {chain_text[:80]!r}") from None
            elif source != DEFAULT:  # written before chains were recorded
                chains[key] = ((DEFAULT, specs[key].default), (source, values[key]))
        elif key in _section_keys():
            stack.append((indent, name))
    return _build(Config, values), Provenance(provenance, chains)
