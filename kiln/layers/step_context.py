"""Per-step inputs the runner hands to layers deep inside a model call (a step's LoRA rows, its
prompt-tuning tables) without threading them through every forward signature."""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class StepContext(Generic[T]):
    """A value active for the model calls inside ``with context.using(value):`` (None outside)."""

    def __init__(self, name: str):
        self._var: ContextVar[T | None] = ContextVar(name, default=None)

    def active(self) -> T | None:
        return self._var.get()

    @contextmanager
    def using(self, value: T | None) -> Iterator[None]:
        token = self._var.set(value)
        try:
            yield
        finally:
            self._var.reset(token)
