"""Errors rendered in the shape of the API a request was made to.

A client reads a refusal the way its own API words it: the OpenAI clients raise an error
from ``{"error": {"message", "type", "param", "code"}}``, another API's clients from its own
shape. Every refusal the server makes is a ``ApiProblem`` (what went wrong, independent of any
API); a ``Shape`` turns it into a response body, and ``Shapes`` picks the shape by the
request's path (the longest registered prefix; OpenAI's by default), so an API added beside
OpenAI's registers its shape under its paths and every refusal on them, from the guard, the
validator or the routes, reads as that API's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from starlette.types import Send


@dataclass(frozen=True)
class ApiProblem:
    """A refused or failed request. ``kind``: the error's class in OpenAI's vocabulary
    (``invalid_request_error``, ``not_found_error``, ``server_error``, …), which each shape
    maps to its own; ``param``: the request field at fault; ``code``: a machine-readable
    reason (``context_length_exceeded``, ``model_not_found``, …)."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None
    kind: str = "invalid_request_error"
    headers: tuple[tuple[str, str], ...] = ()


class Refused(Exception):
    """A request refused where only an exception can say so (in the thread llama.cpp runs
    in, under routes that turn exceptions into a 500 with the exception's text). Its text
    carries the ``ApiProblem`` behind a mark, so the guard answers with it whatever wrapped it
    on the way out."""

    MARK = "moepack-refused:"

    def __init__(self, problem: ApiProblem) -> None:
        self.problem = problem
        super().__init__(self.MARK + json.dumps(asdict(problem)))

    @classmethod
    def within(cls, exc: BaseException) -> Refused | None:
        """``exc`` if it is a ``Refused``, or the first one in it if it is a group of exceptions
        (a task group's, as sse-starlette's publisher raises a route's failure)."""
        if isinstance(exc, Refused):
            return exc
        for inner in getattr(exc, "exceptions", ()):
            found = cls.within(inner)
            if found is not None:
                return found
        return None

    @classmethod
    def parse(cls, text: str) -> ApiProblem | None:
        """The ``ApiProblem`` a ``Refused``'s text carries (None: it is no such text)."""
        at = text.find(cls.MARK)
        if at < 0:
            return None
        try:
            d, _end = json.JSONDecoder().raw_decode(text, at + len(cls.MARK))
            d["headers"] = tuple(tuple(h) for h in d.get("headers", ()))
            return ApiProblem(**d)
        except (ValueError, TypeError):
            return None


class Shape(Protocol):
    """How one API words an error."""

    def body(self, problem: ApiProblem) -> dict[str, Any]: ...


class OpenAIShape:
    """``{"error": {"message", "type", "param", "code"}}`` (OpenAI's error object)."""

    def body(self, problem: ApiProblem) -> dict[str, Any]:
        return {"error": error_object(problem)}


def error_object(problem: ApiProblem) -> dict[str, Any]:
    """The ``error`` object of OpenAI's error responses."""
    return {
        "message": problem.message,
        "type": problem.kind,
        "param": problem.param,
        "code": problem.code,
    }


OPENAI = OpenAIShape()


class Shapes:
    """Path prefix -> ``Shape``; a path no prefix claims gets the default (OpenAI's)."""

    def __init__(self, default: Shape = OPENAI) -> None:
        self.default = default
        self._by_prefix: dict[str, Shape] = {}

    def register(self, prefix: str, shape: Shape) -> None:
        """Errors on paths starting with ``prefix`` are worded by ``shape``."""
        self._by_prefix[prefix] = shape

    def for_path(self, path: str) -> Shape:
        best = ""
        for prefix in self._by_prefix:
            if path.startswith(prefix) and len(prefix) > len(best):
                best = prefix
        return self._by_prefix[best] if best else self.default

    def render(self, path: str, problem: ApiProblem) -> bytes:
        return json.dumps(self.for_path(path).body(problem)).encode()

    async def answer(self, send: Send, path: str, problem: ApiProblem) -> None:
        """Send ``problem`` as the whole response, in the shape of ``path``'s API."""
        await send_json(send, problem.status, self.render(path, problem), problem.headers)


async def send_json(
    send: Send,
    status: int,
    payload: bytes,
    headers: tuple[tuple[str, str], ...] = (),
    content_type: bytes = b"application/json",
) -> None:
    """A whole JSON response."""
    raw = [
        (b"content-type", content_type),
        (b"content-length", str(len(payload)).encode()),
    ]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload, "more_body": False})
