"""Several observers as one: each call goes to every observer, in order."""

from __future__ import annotations

from typing import Any


class Fanout:
    def __init__(self, observers: list[Any]) -> None:
        self.observers = observers

    def __getattr__(self, name: str):
        calls = [getattr(o, name) for o in self.observers]

        def each(*args, **kwargs):
            results = [c(*args, **kwargs) for c in calls]
            return next((r for r in results if r), results[0])     # the first non-empty
        return each


def combine(observers: list[Any], null: Any) -> Any:
    """null for none, the observer itself for one, else a Fanout over them."""
    if not observers:
        return null
    return observers[0] if len(observers) == 1 else Fanout(observers)
