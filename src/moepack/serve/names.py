"""The names the served model answers to (``--alias``, repeatable, globs allowed).

A client names the model it wants in every request, and agents send their own names (Claude
Code asks for ``claude-…``, an OpenAI tool for ``gpt-…``). ``serve --alias NAME`` may be
given several times; a NAME with a glob character (``*``, ``?``, ``[``) is a pattern
(``fnmatch``, case-sensitive: ``--alias 'claude-*'``, ``--alias '*'`` for any name), a plain
NAME one name. With no ``--alias`` the model's name is its file's without ``.gguf``. The
model lists (``/v1/models``, ``/api/tags``) show the plain names; a pattern is no name to show.
A name none of them matches is refused with a message naming the served model and the flag.
Ollama's clients add a tag (``m:latest`` for ``m``): ``ollama`` matching takes a name with
``:latest`` as the name without it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

GLOB = frozenset("*?[")
LATEST = ":latest"


def is_glob(name: str) -> bool:
    return any(c in GLOB for c in name)


@dataclass(frozen=True)
class ModelNames:
    """``aliases`` as given (plain names and patterns, in order), and the file's own name."""

    aliases: tuple[str, ...]
    default: str

    @classmethod
    def of(cls, aliases: Iterable[str], default: str) -> ModelNames:
        return cls(tuple(aliases), default)

    @property
    def listed(self) -> tuple[str, ...]:
        """The names the model lists show: the plain aliases (the file's name if none)."""
        plain = tuple(a for a in self.aliases if not is_glob(a))
        return plain or (self.default,)

    @property
    def primary(self) -> str:
        """The model's own name: the first plain alias, else the file's."""
        return self.listed[0]

    def matches(self, name: str, ollama: bool = False) -> bool:
        """Whether a request naming ``name`` is for the served model (``ollama``: a name
        tagged ``:latest`` also matches the name without the tag)."""
        names = (name, name.removesuffix(LATEST)) if ollama and name.endswith(LATEST) else (name,)
        patterns = self.aliases or (self.default,)
        return any(fnmatchcase(n, p) if is_glob(p) else n == p for n in names for p in patterns)

    def unknown(self, name: str) -> str:
        """Why ``name`` is refused (the served names, and how to serve more)."""
        served = ", ".join(f"`{a}`" for a in (self.aliases or (self.default,)))
        return (
            f"The model `{name[:200]}` does not exist (this server serves {served}; "
            "`moepack serve --alias NAME` adds names, globs too: --alias 'claude-*', --alias '*')"
        )

    def to_job(self) -> dict[str, object]:
        return {"aliases": list(self.aliases), "default": self.default}

    @classmethod
    def from_job(cls, job: dict[str, object]) -> ModelNames:
        aliases = job.get("aliases") or []
        assert isinstance(aliases, list)
        return cls(tuple(str(a) for a in aliases), str(job["default"]))
