"""CLI commands of this concern (being written)."""

from __future__ import annotations

import click


def register(cli: click.Group) -> None:
    """Add this concern's commands to ``cli``."""
