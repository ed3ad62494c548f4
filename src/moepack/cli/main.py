"""The ``moepack`` command: library errors become one-line messages with the documented exit
codes (2 bad input, 1 failed verification), an interrupt one line saying what was written,
exit 128 + signal; never a traceback. ``moepack.entry`` runs this after putting interrupt
handling in place.

The commands come from ``registry``'s table; a command's module (and the library it uses) is
imported only when that command runs, so ``moepack --help`` imports click and little else.
rich is imported when there is something to print."""

from __future__ import annotations

import os
import sys
from collections import Counter

import click

from .. import __version__, interrupts
from ..errors import MoepackError, one_line
from .flags import reword
from .lazy import LazyGroup
from .registry import COMMANDS


@click.group(
    name="moepack",
    cls=LazyGroup,
    lazy=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, prog_name="moepack")
def cli() -> None:
    """The bytes of Mixture-of-Experts checkpoints: where experts sit, how they move,
    and proof that every weight survived."""
    from ..safeio import set_notice  # before a command runs: it may sweep a folder

    set_notice(_warn)


def _say(line: str) -> None:
    """One line on stderr, as every command's own messages are printed."""
    from .render import stderr

    stderr.print(line, soft_wrap=True)


def _fail(message: str, code: int) -> None:
    from .render import say

    say("error", message)
    sys.exit(code)


def _worded(e: MoepackError) -> str:
    """The error's line as a user of the command line reads it: parameters as flags."""
    message = one_line(reword(e.message))
    return f"{one_line(e.path)}: {message}" if e.path else message


def _warn(message: str) -> None:
    from .render import say

    say("warning", message)


def interrupted_message(account: str | None = None) -> str:
    """What an interrupt left: outputs already complete are named, never a claim beyond.
    ``account``: what work that ends this way did (a server: the requests it answered)."""
    safeio = sys.modules.get("moepack.safeio")  # not imported yet: nothing was written
    done = safeio.written_outputs() if safeio is not None else []
    names = ""
    if len(done) <= 3:
        names = ", ".join(str(p) for p in done)
    else:  # an NPU pack is a hundred files: say where they are
        per_folder = Counter(p.parent for p in done)
        names = ", ".join(f"{n} files in {folder}" for folder, n in per_folder.items())
    if account is not None:
        wrote = f"; wrote {names} (complete)" if done else ""
        return f"moepack: stopped; {account}{wrote}"
    if not done:
        return "moepack: interrupted; no output was written"
    return f"moepack: interrupted after writing {names} (complete); nothing else was written"


def _account(e: BaseException) -> str | None:
    """What the interrupted work said it did (``interrupts.Stopped``; click raises its
    ``Abort`` from the interrupt)."""
    for seen in (e, e.__cause__, e.__context__):
        if isinstance(seen, interrupts.Stopped):
            return seen.account
    return None


def main(argv: list[str] | None = None, *, whole_process: bool = False) -> None:
    """Run the CLI; exit 0 on success, 1 on a failed verification, 2 on bad input, 128 +
    the signal on SIGINT, SIGTERM or SIGHUP (outputs in progress are removed).

    ``whole_process``: this run is the process (``moepack``, ``python -m``), so interrupt
    signals stay ignored while it exits; otherwise the caller's handlers are put back."""
    saved = interrupts.saved_handlers()
    try:
        _run(argv)
    finally:
        if not whole_process:
            interrupts.restore(saved)


def _run(argv: list[str] | None) -> None:
    interrupts.install()
    finished = False
    rc: object = 0
    try:
        try:
            rc = cli.main(args=argv, prog_name="moepack", standalone_mode=False)
            finished = True
        finally:
            interrupts.ignore()  # from here on only reporting and leaving are left
    except (KeyboardInterrupt, click.exceptions.Abort) as e:
        interrupts.ignore()
        if not finished:
            _say(interrupted_message(_account(e)))
            sys.exit(128 + interrupts.last_signal())
    except MoepackError as e:
        _fail(_worded(e), e.exit_code)
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
    except OSError as e:
        from ..safeio import describe_os_error

        _fail(str(describe_os_error(e, None)), 2)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main(whole_process=True)
