"""``moepack engines``: parsing and rendering only (the library is ``storage.engines_report``).

Its own module, so that listing the read engines imports no more than the engines do."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.console import Console

from ..storage.engines_report import engines_report
from ..storage.modes import Mode
from .options import input_path, json_option
from .render import emit, print_wide, table


@click.command("engines")
@click.argument("path", required=False, type=input_path)
@click.option("--no-bindings", is_flag=True, help="Skip checking the PyPI io_uring bindings.")
@json_option
def engines_cmd(path: Path | None, no_bindings: bool, as_json: bool) -> None:
    """List the read engines, which modes PATH's filesystem serves, and the io_uring bindings."""
    result = engines_report(path, bindings=not no_bindings).to_json()

    def render(console: Console, r: dict[str, Any]) -> None:
        print_wide(
            console,
            table(
                "read engines",
                ["engine", "modes", "max QD", "status", "what"],
                [
                    [
                        e["name"],
                        ", ".join(e["modes"]),
                        e["max_depth"] or "any",
                        "ok" if not e["unavailable"] else f"unavailable: {e['unavailable']}",
                        e["summary"],
                    ]
                    for e in r["engines"]
                ],
            ),
        )
        if "modes" in r and r["modes"]["untested"]:
            console.print(f"modes on {r['modes']['file']}: untested ({r['modes']['untested']})")
        elif "modes" in r:
            console.print(f"modes on {r['modes']['file']}:")
            for m, why in r["modes"]["unsupported"].items():
                console.print(f"  {Mode(m).label}: " + ("ok" if why is None else f"no — {why}"))
            if "dio_align" in r:
                a = r["dio_align"]
                console.print(
                    f"  O_DIRECT alignment: memory {a['mem']} B, offset/length {a['offset']} B "
                    f"(from {a['source']})"
                )
        if "bindings" in r:
            print_wide(
                console,
                table(
                    "io_uring bindings (each checked in a subprocess)",
                    ["binding", "usable", "detail"],
                    [
                        [b["name"], "yes" if b["usable"] else "no", b["detail"]]
                        for b in r["bindings"]
                    ],
                ),
            )

    emit(result, as_json, render)
