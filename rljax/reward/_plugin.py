"""Reward functions by name: the built-ins, or ``path/to/file.py:function_name`` plugins."""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

from rljax.errors import ConfigError
from rljax.reward._rules import embedded_reward, exact_match_reward, gsm8k_reward

RewardFn = Callable[..., float]

BUILTIN_REWARDS: dict[str, RewardFn] = {
    "embedded": embedded_reward,
    "gsm8k": gsm8k_reward,
    "exact_match": exact_match_reward,
}
#: The reward ``reward.function=auto`` picks for each ``data.dataset`` (``local``: by each row's
#: ``data_source``, :func:`data_source_reward`).
DATASET_REWARDS = {"embedded": "embedded", "gsm8k": "gsm8k", "local": "data_source"}


#: verl's ``data_source`` for each ``data.dataset`` (what verl's own reward functions dispatch on).
DATA_SOURCES = {"gsm8k": "openai/gsm8k", "embedded": "rljax/embedded"}
#: The built-in reward for each ``data_source`` a ``data.dataset=local`` row may name (as
#: verl's ``default_compute_score`` dispatches).
DATA_SOURCE_REWARDS = {"openai/gsm8k": "gsm8k", "rljax/embedded": "embedded"}


def data_source_reward(response: str, answer: str, *, data_source: str | None = None, **extra) -> float:
    """``reward.function=auto`` for ``data.dataset=local``: the built-in reward of the row's
    ``data_source`` (:data:`DATA_SOURCE_REWARDS`); raises ValueError for any other."""
    name = DATA_SOURCE_REWARDS.get(data_source)
    if name is None:
        raise ValueError(f"no built-in reward for data_source={data_source!r} (built-in: "
                         f"{', '.join(DATA_SOURCE_REWARDS)}); set reward.function=path/to/file.py:compute_score")
    return BUILTIN_REWARDS[name](response, answer, **extra)
#: The leading parameters that mark verl's reward signature.
VERL_PARAMS = ("data_source", "solution_str", "ground_truth")


def load_function(spec: str, *, key: str, prefix: str = "rljax_plugin") -> Callable:
    """The callable ``function_name`` of the Python file in ``path/to/file.py:function_name``.

    The file is executed as a fresh module (its directory is not added to ``sys.path``);
    relative paths are taken from the CWD. Every failure is a :class:`ConfigError` naming
    ``key`` and the spec.
    """
    if ":" not in spec:
        raise ConfigError(f"{key}={spec!r} must be path/to/file.py:function_name")
    path_text, name = spec.rsplit(":", 1)
    if not path_text or not name.isidentifier():
        raise ConfigError(f"{key}={spec!r} must be path/to/file.py:function_name with a Python identifier after ':'")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise ConfigError(f"{key}={spec!r}: file {str(path)!r} not found (cwd {os.getcwd()})")
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    mod_name = f"{prefix}_{path.stem}_{digest}"
    try:
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        if module_spec is None or module_spec.loader is None:
            raise ImportError("not a Python source file")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module  # dataclasses and pickling look modules up by name
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - any failure of user code is a config problem
        sys.modules.pop(mod_name, None)
        raise ConfigError(f"{key}={spec!r}: importing {str(path)!r} failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise ConfigError(
            f"{key}={spec!r}: {str(path)!r} has no attribute {name!r}; callables there: {', '.join(public) or 'none'}"
        )
    fn = getattr(module, name)
    if not callable(fn):
        raise ConfigError(f"{key}={spec!r}: {name!r} is not callable (it is {type(fn).__name__})")
    return fn


#: Python callables handed to :func:`rljax.train` (``reward.function=callable:<name>``): they live in
#: this process only, so they run in it (``reward.num_workers=0``).
CALLABLE = "callable:"
_CALLABLES: dict[str, Callable] = {}


def register_callable(fn: Callable) -> str:
    """The reward spec (``callable:<name>``) of a Python callable, registered in this process."""
    if not callable(fn):
        raise ConfigError(f"a reward function must be callable or 'path/to/file.py:function', got {fn!r}")
    base = "".join(c if c.isalnum() or c == "_" else "_" for c in getattr(fn, "__name__", "reward")).strip("_")
    base = base if base and not base[0].isdigit() else f"reward_{base}"
    for name, known in _CALLABLES.items():
        if known is fn:
            return CALLABLE + name
    name, i = base, 1
    while name in _CALLABLES:
        i += 1
        name = f"{base}_{i}"
    _CALLABLES[name] = fn
    return CALLABLE + name


def adapt_signature(fn: Callable, *, name: str, key: str, data_source: str | None = None) -> RewardFn:
    """``fn`` called as rljax calls a reward, ``(response, answer, **extra)``, whichever of the three
    signatures it has: rljax's, verl's ``compute_score(data_source, solution_str, ground_truth,
    extra_info=None)``, or TRL's ``fn(completions, **kwargs) -> list`` (called with one completion,
    and the answer as ``answer`` / ``ground_truth`` / ``solution``, each a one-element list)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: call as is
        return fn
    positional = [p.name for p in sig.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if tuple(positional[:3]) == VERL_PARAMS:
        return _verl_call(fn, sig, data_source or "unknown")
    if positional[:1] == ["completions"]:
        return _trl_call(fn, sig)
    try:
        sig.bind("response", "answer")
    except TypeError:
        raise ConfigError(
            f"{key}={name!r}: {name.rsplit(':', 1)[-1]}{sig} must accept (response, answer, **extra) (rljax's "
            "signature), (data_source, solution_str, ground_truth, extra_info=None) (verl's) or (completions, "
            "**kwargs) returning a list (TRL's)"
        ) from None
    return _with_extra_filter(fn, sig)


def _trl_call(fn: Callable, sig: inspect.Signature) -> RewardFn:
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())

    def call(response, answer, **extra):
        kw = {"answer": [answer], "ground_truth": [answer], "solution": [answer], **{k: [v] for k, v in extra.items()}}
        out = fn([response], **(kw if var_kw else {k: v for k, v in kw.items() if k in sig.parameters}))
        if not isinstance(out, (list, tuple)) or len(out) != 1:
            raise TypeError(f"a TRL-style reward returns one score per completion; got {type(out).__name__}")
        return 0.0 if out[0] is None else out[0]  # TRL: None for a sample the function does not apply to

    call.__name__ = getattr(fn, "__name__", "reward")
    call.__wrapped__ = fn
    return call


def load_reward_plugin(spec: str, *, key: str = "reward.function", data_source: str | None = None) -> RewardFn:
    """Loads ``function_name`` from the Python file ``path/to/file.py`` (relative paths from the CWD).

    The file is executed as a fresh module (its directory is not added to ``sys.path``).
    Two signatures are accepted, told apart by the parameter names:

    * rljax's ``fn(response: str, answer: str, **extra) -> float``; a function without
      ``**extra`` receives only the extra keys it names;
    * verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``,
      returning a number or a dict with a ``"score"`` entry; it is called with
      ``data_source`` (verl's name of the dataset, e.g. ``"openai/gsm8k"``), the response,
      the reference answer and ``extra_info`` (the extra keys as a dict), so verl reward
      files work unchanged; a dict's other entries are logged (``reward/extra/<key>``).

    Raises:
      ConfigError: malformed spec, missing or unreadable file, error while executing the
        file, missing attribute, an attribute that is not callable, or a function that
        takes neither signature.
    """
    if spec.startswith(CALLABLE):
        fn = _CALLABLES.get(spec[len(CALLABLE):])
        if fn is None:
            raise ConfigError(f"{key}={spec!r} names a Python callable handed to rljax.train in another process; "
                              "pass it again (rljax.train(..., reward_funcs=[fn])) or name a path/to/file.py:function")
    else:
        fn = load_function(spec, key=key, prefix="rljax_reward_plugin")
    return adapt_signature(fn, name=spec, key=key, data_source=data_source)


def _verl_call(fn: Callable, sig: inspect.Signature, data_source: str) -> RewardFn:
    takes_extra = "extra_info" in sig.parameters or any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())

    def call(response, answer, **extra):
        source = extra.pop("data_source", data_source)
        # verl's dict ({"score": ..., "acc": ..., "pred": ...}) goes through whole: score_batch
        # logs its other numbers as reward/extra/<key> (rljax.reward.as_result)
        return fn(source, response, answer, **({"extra_info": extra} if takes_extra else {}))

    call.__name__ = getattr(fn, "__name__", "compute_score")
    call.__wrapped__ = fn
    return call


def _with_extra_filter(fn: RewardFn, sig: inspect.Signature) -> RewardFn:
    params = list(sig.parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fn
    names = {p.name for p in params[2:] if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}

    def call(response, answer, **extra):
        return fn(response, answer, **{k: v for k, v in extra.items() if k in names})

    call.__name__ = getattr(fn, "__name__", "reward")
    call.__wrapped__ = fn
    return call


#: The spec of several weighted functions (``reward.functions`` / ``reward.weights``): this prefix and
#: a JSON list of ``[spec, weight]`` pairs (a string, so a worker process loads it as it loads one).
WEIGHTED = "weighted:"


def weighted_spec(functions, weights) -> str:
    """The reward spec of ``reward.functions`` with ``reward.weights`` (all 1 when empty)."""
    weights = list(weights) or [1.0] * len(functions)
    return WEIGHTED + json.dumps([[f, float(w)] for f, w in zip(functions, weights)])


def reward_spec(reward_cfg) -> str:
    """What a ``reward`` section scores with: ``reward.function``, or the weighted spec of ``reward.functions``."""
    functions = tuple(getattr(reward_cfg, "functions", ()) or ())
    return weighted_spec(functions, reward_cfg.weights) if functions else reward_cfg.function


def weighted_parts(spec: str) -> list[tuple[str, float]]:
    """``[(function spec, weight), ...]`` of a weighted spec; ``[(spec, 1.0)]`` for one function."""
    return [(f, float(w)) for f, w in json.loads(spec[len(WEIGHTED):])] if spec.startswith(WEIGHTED) else [(spec, 1.0)]


def builtin_only(spec: str) -> bool:
    """Every function of ``spec`` is ``auto``, a built-in or a Python callable of this process (in-process by
    default: no user file to isolate, or nothing a worker could load)."""
    return all(f == "auto" or f in BUILTIN_REWARDS or f.startswith(CALLABLE) for f, _ in weighted_parts(spec))


def has_callable(spec: str) -> bool:
    return any(f.startswith(CALLABLE) for f, _ in weighted_parts(spec))


class WeightedRewards:
    """Several reward functions (TRL's ``reward_funcs`` / ``reward_weights``): the score is the
    weighted sum; the returned dict also carries each function's score as ``fn/<name>`` and, for
    a function that raised on this row, ``error/<name>`` (its part scores 0; the batch's error
    bound applies to each function: :meth:`rljax.reward.RewardReport.check`). A function
    returning a dict adds its other entries too."""

    def __init__(self, named: list[tuple[str, RewardFn, float]]):
        self.named = named

    def __call__(self, response, answer, **extra):
        out, total = {}, 0.0
        for name, fn, weight in self.named:
            try:
                value = fn(response, answer, **extra)
                if isinstance(value, dict):
                    out.update((k, v) for k, v in value.items() if k != "score")
                    value = value["score"]
                score = float(value)
                if score != score or score in (float("inf"), float("-inf")):
                    raise ValueError(f"returned non-finite {score}")
            except Exception as e:  # noqa: BLE001 - one function's failure is that function's error
                out[f"error/{name}"] = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                score = 0.0
            out[f"fn/{name}"] = score
            total += weight * score
        out["score"] = total
        return out


def _function_names(specs: list[str]) -> list[str]:
    """A short unique name per function: ``compute_score``, or ``file.compute_score`` where two share one."""
    short = [s.rsplit(":", 1)[-1] for s in specs]
    return [n if short.count(n) == 1 else f"{Path(s.rsplit(':', 1)[0]).stem}.{n}" if ":" in s else s
            for n, s in zip(short, specs)]


def get_reward_fn(spec: str = "auto", *, dataset: str | None = None) -> RewardFn:
    """The reward function for ``reward.function``: ``auto`` (the dataset's own), a built-in
    name (``embedded``, ``gsm8k``, ``exact_match``), ``path/to/file.py:function_name``, or the
    :data:`WEIGHTED` spec of several (:class:`WeightedRewards`)."""
    if spec.startswith(WEIGHTED):
        parts = weighted_parts(spec)
        names = _function_names([f for f, _ in parts])
        return WeightedRewards([(name, get_reward_fn(f, dataset=dataset), w) for name, (f, w) in zip(names, parts)])
    if spec == "auto":
        if dataset not in DATASET_REWARDS:
            raise ConfigError(
                f"reward.function=auto has no default for data.dataset={dataset!r}; "
                f"set reward.function to one of {', '.join(BUILTIN_REWARDS)} or path/to/file.py:function_name"
            )
        spec = DATASET_REWARDS[dataset]
        if spec == "data_source":
            return data_source_reward
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    return load_reward_plugin(spec, data_source=DATA_SOURCES.get(dataset, dataset))


class InProcessReward:
    """The reward function called in the trainer's process (``reward.num_workers=0``), with the
    section's ``clip`` for :func:`rljax.reward.score_batch`."""

    def __init__(self, fn: RewardFn, *, clip: float | None = None):
        self.fn, self.clip = fn, clip

    def __call__(self, response, answer, **extra):
        return self.fn(response, answer, **extra)
