"""Rollout-correction threshold specifications (verl's ``rollout_is_threshold`` /
``rollout_rs_threshold`` strings), parsed on the host. Pure Python: the configuration checks
them before JAX starts and :mod:`rljax.loss` reads the parsed bounds.

* ``rollout_is_threshold``: ``U`` (truncated IS) or ``"L_U"`` (IcePop: weights outside
  ``[L, U]`` are zeroed), ``0 < L <= U``.
* ``rollout_rs`` options (comma separated): ``token_k1..3``, ``seq_sum_k1..3``,
  ``seq_mean_k1..3``, ``seq_max_k2``, ``seq_max_k3``; ``rollout_rs_threshold``: one threshold for
  all or one per option, comma separated; a ``k1`` option takes ``"L_U"`` or ``U`` (then
  ``L = 1/U``), a ``k2`` / ``k3`` option one upper bound.
"""

from __future__ import annotations

import math
from typing import Optional, Union

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
Threshold = Union[str, float, int]


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what}={text!r} is not a number; accepted: a positive number, or 'lower_upper' "
                         "(two positive numbers joined by '_', e.g. 0.5_2.0)") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{what}={text!r} must be a positive finite number")
    return value


def parse_is_threshold(spec: Threshold) -> tuple[float, Optional[float]]:
    """``rollout_is_threshold`` -> ``(upper, lower or None)``: a number is truncated IS's upper
    bound, ``"L_U"`` IcePop's two bounds (``0 < L <= U``). ``ValueError`` in one line otherwise."""
    if isinstance(spec, bool) or not isinstance(spec, (str, int, float)):
        raise ValueError(f"rollout_is_threshold={spec!r}: accepted: a positive number or 'lower_upper' (e.g. 0.5_5.0)")
    text = str(spec).strip()
    if "_" not in text:
        return _number(text, "rollout_is_threshold"), None
    low, high = text.split("_", 1)
    lower, upper = _number(low, "rollout_is_threshold lower bound"), _number(high, "rollout_is_threshold upper bound")
    if lower > upper:
        raise ValueError(f"rollout_is_threshold={spec!r}: the lower bound must be <= the upper bound")
    return upper, lower


def parse_rs_options(rollout_rs: str) -> tuple[str, ...]:
    """``rollout_rs`` (comma separated) -> its options in order, duplicates dropped."""
    options = tuple(dict.fromkeys(o.strip() for o in str(rollout_rs).split(",") if o.strip()))
    if not options:
        raise ValueError(f"rollout_rs={rollout_rs!r} names no option; accepted: {', '.join(RS_OPTIONS)}")
    for o in options:
        if o not in RS_OPTIONS:
            raise ValueError(f"unknown rollout_rs option {o!r}; accepted: {', '.join(RS_OPTIONS)} (comma separated)")
    return options


def parse_rs_thresholds(rollout_rs: str, spec: Optional[Threshold]) -> tuple[tuple[str, Optional[float], float], ...]:
    """``(option, lower or None, upper)`` per option of ``rollout_rs``. ``spec``: one threshold for
    every option or one per option, comma separated; ``k1`` options take ``"L_U"`` or ``U``
    (then ``L = 1/U``), ``k2`` / ``k3`` options a single positive upper bound."""
    options = parse_rs_options(rollout_rs)
    if spec is None or isinstance(spec, bool):
        raise ValueError(f"rollout_rs={rollout_rs} needs rollout_rs_threshold (a positive number, 'lower_upper' for "
                         "k1 options, or one per option, comma separated)")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold={spec!r} gives {len(parts)} thresholds for {len(options)} rollout_rs "
                         "options; give one for all or one per option")
    parts = parts * len(options) if len(parts) == 1 else parts
    out = []
    for option, part in zip(options, parts):
        what = f"rollout_rs_threshold for {option}"
        if option.endswith("k1"):
            low, high = part.split("_", 1) if "_" in part else (None, part)
            upper = _number(high, what)
            lower = 1.0 / upper if low is None else _number(low, what)
            if lower > upper:
                raise ValueError(f"{what}={part!r}: the lower bound must be <= the upper bound")
        else:
            if "_" in part:
                raise ValueError(f"{what}={part!r}: {option} takes one upper bound, not 'lower_upper'")
            lower, upper = None, _number(part, what)
        out.append((option, lower, upper))
    return tuple(out)
