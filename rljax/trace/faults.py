"""Fault hooks: data-flow bugs provoked on purpose, so tests can show the trace catches them.

A fault is switched on by name, in-process (:func:`enable`) or for a launched run through
the ``RLJAX_FAULTS`` environment variable (comma-separated names, read once at import).
The stage that owns the data calls :func:`active` at the one place the bug would be; with
no fault on, a hook is a dict lookup. Faults exist for the tests only: nothing in a run's
configuration switches them on, and every record of a run with a fault on says which
(``trace_summary.json`` ``faults``).

Faults (name: the bug it provokes, where):

* ``keep_batch_field``: a batch field (``advantages``) kept alive past its step
  (``step_metrics`` keeps a reference) -> the ``batch_leak`` alert (error).
"""

from __future__ import annotations

import os
from typing import Any

#: Every known fault with the bug it provokes.
FAULTS = {
    "keep_batch_field": "a batch field (advantages) stays referenced after its step",
}
_on: set[str] = set()
_kept: list = []


def _parse(text: str) -> set[str]:
    names = {n.strip() for n in text.split(",") if n.strip()}
    unknown = sorted(names - set(FAULTS))
    if unknown:
        raise ValueError(f"RLJAX_FAULTS names unknown fault(s) {', '.join(unknown)}; accepted: {', '.join(FAULTS)}")
    return names


def enable(*names: str) -> None:
    _on.update(_parse(",".join(names)))


def disable(*names: str) -> None:
    """Switches the named faults off (all of them when none is named)."""
    if names:
        _on.difference_update(names)
    else:
        _on.clear()
    _kept.clear()


def active(name: str) -> bool:
    return name in _on


def enabled() -> list[str]:
    return sorted(_on)


def keep(value: Any) -> None:
    """``keep_batch_field``: holds a reference past the step (the leak the runner must report)."""
    _kept.append(value)


_on.update(_parse(os.environ.get("RLJAX_FAULTS", "")))
