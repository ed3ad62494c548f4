"""The ``moepack`` command's first instructions: interrupt handling before any heavy import.

Importing click, numpy and gguf takes a good part of a second; a Ctrl-C in that time must
end in one line and exit 128 + signal, like one at any later instant, not in a traceback.
The handler goes in through ``_signal``, the interpreter's built-in module behind ``signal``:
importing ``signal`` itself (it builds enums) would hold the window open ~10 ms longer.
"""

import _signal  # type: ignore[import-not-found]  # no stub: the C module behind signal
import os
import sys

_SIGNALS = (_signal.SIGINT, _signal.SIGTERM, _signal.SIGHUP)


def _early(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signum)


for _sig in _SIGNALS:
    _signal.signal(_sig, _early)


def _stop(exc: KeyboardInterrupt) -> None:
    """Say it and leave at once: what was written (if anything) is complete."""
    for sig in _SIGNALS:
        _signal.signal(sig, _signal.SIG_IGN)
    line = "moepack: interrupted; no output was written"
    signum = int(_signal.SIGINT)
    cli = sys.modules.get("moepack.cli.main")
    if cli is not None and hasattr(cli, "interrupted_message"):
        line = cli.interrupted_message()
        signum = sys.modules["moepack.interrupts"].last_signal()
    if exc.args and isinstance(exc.args[0], int):  # raised by _early: it knows the signal
        signum = exc.args[0]
    try:
        sys.stdout.flush()
    except Exception:
        pass
    os.write(2, line.encode(errors="replace") + b"\n")
    os._exit(128 + signum)


def _interrupt_behind(exc: BaseException) -> KeyboardInterrupt | None:
    """The interrupt an exception stands for: Python 3.11 turns one raised while a class body
    sets up its descriptors (numpy's ``finfo`` while it imports) into ``RuntimeError``."""
    seen: BaseException | None = exc
    for _ in range(16):
        if seen is None or isinstance(seen, KeyboardInterrupt):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def main() -> None:
    """Import the command line under the early handler, then run it."""
    try:
        from .cli.main import main as run

        run(whole_process=True)
    except KeyboardInterrupt as e:  # between the handlers: before or after the CLI's own
        _stop(e)
    except Exception as e:
        interrupt = _interrupt_behind(e)
        if interrupt is None:
            raise
        _stop(interrupt)


if __name__ == "__main__":
    main()
