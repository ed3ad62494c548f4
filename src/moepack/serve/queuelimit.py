"""``--max-queue``: how many requests may wait for the model; the next is answered 429 at once.

The model runs one generation at a time and the others wait for its lock, each holding a
connection and, for an agent, a client timeout. With a cap, a request to a completion route
(the guard's ``counted`` ones: both APIs' chat, text completion and messages) that finds the
one running and ``max_queue`` already waiting is refused with a 429 in its API's shape
(Anthropic's ``rate_limit_error``) and a ``Retry-After``, as the hosted APIs answer an
overload — the client's own retry then decides. An ASGI middleware in front of the guard: the
requests it counts in flight are the ones already let in.
"""

from __future__ import annotations

from collections.abc import Mapping

from starlette.types import ASGIApp, Receive, Scope, Send

from .guard import Route
from .metrics import RequestCounts
from .shapes import ApiProblem, Shapes


class QueueLimit:
    """The middleware (see the module docstring)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_queue: int,
        routes: Mapping[str, Route],
        counts: RequestCounts,
        shapes: Shapes,
    ) -> None:
        self.app = app
        self.max_queue = max_queue
        self.routes = routes
        self.counts = counts
        self.shapes = shapes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = self.routes.get(str(scope.get("path", ""))) if scope["type"] == "http" else None
        waiting = self.counts.in_flight - 1  # one of those in flight runs
        if route is not None and route.counted and waiting >= self.max_queue:
            problem = ApiProblem(
                429,
                f"{waiting} requests are already waiting for the model (--max-queue "
                f"{self.max_queue}); retry later",
                code="rate_limit_exceeded",
                kind="rate_limit_error",
                headers=(("retry-after", "1"),),
            )
            await self.shapes.answer(send, str(scope["path"]), problem)
            return
        await self.app(scope, receive, send)
