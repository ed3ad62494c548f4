"""Entry point: builds the ``moepack`` command from each concern's CLI module and turns
library errors into one-line messages with the documented exit codes (2 bad input,
1 failed verification), never a traceback."""

from __future__ import annotations

import os
import signal
import sys

import click

from .. import __version__
from ..errors import MoepackError
from ..safeio import describe_os_error
from . import registry
from .render import stderr


@click.group(
    name="moepack",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, prog_name="moepack")
def cli() -> None:
    """The bytes of Mixture-of-Experts checkpoints: where experts sit, how they move,
    and proof that every weight survived."""


registry.register_all(cli)


def _fail(message: str, code: int) -> None:
    stderr.print(f"moepack: error: {message}", markup=False, highlight=False, soft_wrap=True)
    sys.exit(code)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Run the CLI; exit 0 on success, 1 on a failed verification, 2 on bad input.

    SIGTERM and SIGHUP are handled like Ctrl-C: outputs in progress are removed."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        rc = cli.main(args=argv, prog_name="moepack", standalone_mode=False)
    except MoepackError as e:
        _fail(str(e), e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.BadParameter as e:  # a bad value (a missing file, a number out of range)
        _fail(" ".join(e.format_message().split()), 2)
    except click.ClickException as e:  # usage errors: show the usage too
        e.show()
        sys.exit(2)
    except BrokenPipeError:  # `moepack ... | head`: the reader left (JSON output path)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    except (KeyboardInterrupt, click.exceptions.Abort):
        _fail("interrupted; partial outputs were removed, inputs are untouched", 2)
    except OSError as e:
        _fail(str(describe_os_error(e, None)), 2)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
