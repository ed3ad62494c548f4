"""Which CLI modules make up ``moepack``. Each exposes ``register(cli)``."""

from __future__ import annotations

import importlib

import click

# One module per concern; adding a command group is adding a module here.
COMMAND_MODULES = [
    "moepack.cli.gguf",
    "moepack.cli.trace",
    "moepack.cli.llama",
    "moepack.cli.storage",
    "moepack.cli.npu",
    "moepack.cli.layout",
    "moepack.cli.run",
    "moepack.cli.quant",
    "moepack.cli.replay",
    "moepack.cli.store",
]


def register_all(cli: click.Group) -> None:
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(cli)
