"""Options every command shares, so flags look the same everywhere."""

from __future__ import annotations

import click

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print the result as JSON for programs."
)
quiet_option = click.option("--quiet", "-q", is_flag=True, help="No progress bars.")
