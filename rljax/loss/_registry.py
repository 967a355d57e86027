"""Name -> function registries (advantage estimators, policy losses), verl style."""

from __future__ import annotations

from typing import Callable


class Registry:
    """A named table of functions filled by a decorator; lookups fail naming what exists."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, Callable] = {}

    def register(self, name: str) -> Callable[[Callable], Callable]:
        def decorator(fn: Callable) -> Callable:
            if name in self._fns and self._fns[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._fns[name] = fn
            return fn

        return decorator

    def names(self) -> tuple[str, ...]:
        return tuple(self._fns)

    def get(self, name: str) -> Callable:
        if name not in self._fns:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._fns))}")
        return self._fns[name]
