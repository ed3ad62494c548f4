"""One registry for every plug-in family (trace formats, read engines, NPU profiles, layouts,
cache policies, predictors, synthetic architectures, …).

A family is a package; a plug-in is a module in it that defines ``PLUGINS`` (a sequence of
plug-in objects) or ``PLUGIN`` (one). Adding a plug-in is adding a file, the way a model file
is added to mlx-lm or an ioengine to fio: nothing else is edited. Discovery is lazy (the first
lookup imports the package's modules), so a family never depends on import order, and modules
whose names start with ``_`` are helpers, not plug-ins.

Every plug-in object has a ``name`` and may have ``aliases``; a duplicate name or alias within
a family raises ``RegistryError`` when the family is loaded, and so does (with
``every_module``) a public module that defines no plug-in. Listing order is stable: by the
module's ``ORDER`` (default 100), then module name, then position in ``PLUGINS``.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator, Sequence
from typing import Generic, Protocol, TypeVar, runtime_checkable

from .errors import BadInput


@runtime_checkable
class Named(Protocol):
    """What every plug-in has: a name users type, and optional other names for it."""

    @property
    def name(self) -> str: ...


class RegistryError(RuntimeError):
    """A family is inconsistent (duplicate name or alias, a plug-in of the wrong kind): a bug in
    moepack or in a plug-in, not bad user input, so it is not a ``MoepackError``."""


T = TypeVar("T", bound=Named)


def aliases_of(plugin: object) -> tuple[str, ...]:
    """A plug-in's other names (empty when it declares none)."""
    return tuple(getattr(plugin, "aliases", ()) or ())


class Registry(Generic[T]):
    """The plug-ins of one family, found in ``package``; ``kind`` names them in messages
    ("unknown engine 'x'; known: a, b, c"). ``base`` (optional) is the class every plug-in
    must be an instance of. With ``every_module``, a public module that defines neither
    ``PLUGIN`` nor ``PLUGINS`` is an error too (a plug-in written for another interface would
    otherwise vanish silently)."""

    def __init__(
        self, kind: str, package: str, base: type | None = None, *, every_module: bool = False
    ) -> None:
        self.kind = kind
        self.package = package
        self.base = base
        self.every_module = every_module
        self._items: dict[str, T] | None = None
        self._aliases: dict[str, str] = {}

    def _load(self) -> dict[str, T]:
        if self._items is not None:
            return self._items
        pkg = importlib.import_module(self.package)
        modules = []
        for info in pkgutil.iter_modules(pkg.__path__):
            if info.name.startswith("_"):
                continue
            mod = importlib.import_module(f"{self.package}.{info.name}")
            modules.append((getattr(mod, "ORDER", 100), info.name, mod))
        items: dict[str, T] = {}
        aliases: dict[str, str] = {}
        for _order, modname, mod in sorted(modules, key=lambda m: (m[0], m[1])):
            found: Sequence[T]
            if hasattr(mod, "PLUGINS"):
                found = tuple(mod.PLUGINS)
            elif hasattr(mod, "PLUGIN"):
                found = (mod.PLUGIN,)
            elif self.every_module:
                raise RegistryError(
                    f"{self.kind} module {modname} defines neither PLUGIN nor PLUGINS"
                )
            else:
                continue
            for plugin in found:
                self._check(plugin, modname)
                for key in (plugin.name, *aliases_of(plugin)):
                    if key in items or key in aliases:
                        raise RegistryError(
                            f"{self.kind} name {key!r} (module {modname}) is already taken"
                        )
                    if key == plugin.name:
                        items[key] = plugin
                    else:
                        aliases[key] = plugin.name
        self._items, self._aliases = items, aliases
        return items

    def _check(self, plugin: object, modname: str) -> None:
        if self.base is not None and not isinstance(plugin, self.base):
            raise RegistryError(
                f"{self.kind} plug-in in module {modname} is a {type(plugin).__name__}, "
                f"not a {self.base.__name__}"
            )
        name = getattr(plugin, "name", None)
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind} plug-in in module {modname} has no name")

    def names(self) -> list[str]:
        """Every plug-in's name, in listing order (aliases not included)."""
        return list(self._load())

    def all(self) -> list[T]:
        """Every plug-in, in listing order."""
        return list(self._load().values())

    def __iter__(self) -> Iterator[T]:
        return iter(self.all())

    def __contains__(self, name: object) -> bool:
        items = self._load()
        return name in items or name in self._aliases

    def find(self, name: str) -> T | None:
        """The plug-in called ``name`` (or one of its aliases), or None."""
        items = self._load()
        return items.get(self._aliases.get(name, name))

    def get(self, name: str) -> T:
        """The plug-in called ``name`` (or one of its aliases); ``BadInput`` listing the known
        names otherwise."""
        plugin = self.find(name)
        if plugin is None:
            raise BadInput(self.unknown_message(name))
        return plugin

    def unknown_message(self, name: str) -> str:
        return f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}"
