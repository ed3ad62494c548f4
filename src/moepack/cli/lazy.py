"""A click group that knows its commands from a table and imports a command's module only
when that command runs.

Each command module imports its library (numpy, gguf, llama.cpp's bindings, matplotlib …);
importing them all to print ``moepack --help`` or to run one command took a second. The table
(``cli/registry.py``) names every command, the module and attribute that define it, and its
summary (the first paragraph of its help), so the listing in ``--help`` is drawn from the
table with click's own layout and nothing is imported for it. ``tests/cli/test_cli_lazy.py``
keeps the table and the commands in agreement.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, NamedTuple

import click

PACKAGE = __package__  # the command modules live beside this one


class LazyCommand(NamedTuple):
    """A command defined as ``attribute`` of ``moepack.cli.<module>``; ``summary`` is the
    first paragraph of its help, what ``--help`` lists before the module is imported."""

    module: str
    attribute: str
    summary: str  # (a NamedTuple, not a dataclass: importing dataclasses costs a millisecond)

    @property
    def module_name(self) -> str:
        return f"{PACKAGE}.{self.module}"

    def load(self, name: str) -> click.Command:
        """Import the module and return its command (which must be called ``name``)."""
        command = getattr(importlib.import_module(self.module_name), self.attribute, None)
        if not isinstance(command, click.Command) or command.name != name:
            raise RuntimeError(
                f"{self.module_name}.{self.attribute} is not the click command {name!r}"
            )
        return command

    def listed(self, name: str) -> click.Command:
        """A stand-in carrying only the summary: what the listing reads of a command."""
        return click.Command(name, help=self.summary)


class CommandGroup(NamedTuple):
    """A group of commands with no options of its own (``trace``, ``store``, ``npu`` …): its
    help and its commands, built without importing any of them."""

    help: str
    commands: Mapping[str, LazyCommand | CommandGroup]

    def load(self, name: str) -> click.Command:
        return LazyGroup(name, help=self.help, lazy=self.commands)

    def listed(self, name: str) -> click.Command:
        return self.load(name)  # building the group imports nothing


Entry = LazyCommand | CommandGroup


class LazyGroup(click.Group):
    """A ``click.Group`` whose commands are loaded from ``lazy`` on first use."""

    def __init__(self, *args: Any, lazy: Mapping[str, Entry], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = dict(lazy)
        self._listing = False

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = self.lazy.get(cmd_name)
        if entry is not None and cmd_name not in self.commands:
            if self._listing:
                return entry.listed(cmd_name)
            self.add_command(entry.load(cmd_name), cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's listing, drawn from the summaries: no command module is imported."""
        with self._summaries():
            super().format_commands(ctx, formatter)

    @contextmanager
    def _summaries(self) -> Iterator[None]:
        self._listing = True
        try:
            yield
        finally:
            self._listing = False
