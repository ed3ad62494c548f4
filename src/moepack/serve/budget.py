"""A request's token budget: the most tokens all the generations it runs may sample together.

A request's ``max_tokens`` bounds what it is answered with, but llama-cpp-python applies it
per completion, and some chat formats run several for one request (``chatml-function-calling``
chooses between a message and a call in one completion, then writes it in another, asking
for no limit). The guard reads the budget from the request's body (``Route.budget``: each API
says where it is) and makes it current (``budgeted``) while the application answers; the
completions wrapper (``textstream.Completions``) takes each token it hands on from it and ends a
generation when it is spent. Threads the application starts copy the request's context, and
with it the budget (one object: what one takes, all see).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


@dataclass
class TokenBudget:
    """Tokens the request may still sample."""

    left: int


_BUDGET: ContextVar[TokenBudget | None] = ContextVar("moepack_budget", default=None)


def current_budget() -> TokenBudget | None:
    """The budget of the request whose code runs in this context (None: no bound)."""
    return _BUDGET.get()


@contextmanager
def budgeted(tokens: int | None) -> Iterator[None]:
    """``tokens`` is the budget of the request run inside (None: no bound)."""
    token = _BUDGET.set(TokenBudget(tokens) if tokens is not None else None)
    try:
        yield
    finally:
        _BUDGET.reset(token)
