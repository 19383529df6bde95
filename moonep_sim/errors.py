"""The package's exceptions.

Every error a user can cause is a :class:`MoonEPSimError`; its message is one line worded
``name (value) must <constraint> (other value): reason`` or ``FILE: record N: field: expected X, found Y``.
The CLI prints it alone (no traceback) and exits with status 2.
"""


import argparse
import contextlib
import signal
import sys


class MoonEPSimError(Exception):
    """Base of every error moonep-sim raises for bad input or a failed run."""


class ConfigError(MoonEPSimError, ValueError):
    """A configuration value (shape, option, preset name, world size) is invalid."""


class TraceFormatError(MoonEPSimError, ValueError):
    """A trace or source file is malformed, truncated, or contradicts itself."""


class PlanError(MoonEPSimError, ValueError):
    """A routing cannot be planned (expert id out of range, duplicate ids, ...)."""


class CommError(MoonEPSimError, RuntimeError):
    """A collective failed or timed out; names the phase and the rank(s) involved."""


def require(ok: bool, message: str, exc: type[MoonEPSimError] = ConfigError) -> None:
    """Raise ``exc(message)`` unless ``ok``: the one-line input check used across the package."""
    if not ok:
        raise exc(message)


def is_int(v: object) -> bool:
    """An integer that is not a bool (JSON's ``true``/``false`` are not ids, counts or sizes)."""
    return isinstance(v, int) and not isinstance(v, bool)


def exit_status(fn, *args, **kwargs) -> int:
    """Run an entry point's body and turn its outcome into the exit status the launchers share:
    its own return value (0 when None); on a package error its one line on stderr and 1 for a
    failed collective (:class:`CommError`), 2 for anything else (bad input); 130 on Ctrl-C."""
    try:
        return int(fn(*args, **kwargs) or 0)
    except MoonEPSimError as e:
        print(f"moonep-sim: error: {e}", file=sys.stderr, flush=True)
        return 1 if isinstance(e, CommError) else 2
    except KeyboardInterrupt:
        print("moonep-sim: interrupted", file=sys.stderr, flush=True)
        return 130


@contextlib.contextmanager
def interrupts_deferred():
    """Hold Ctrl-C back while the block runs (imports), then raise it as ``KeyboardInterrupt``:
    an interrupt landing inside an extension module's import is otherwise turned into that
    module's own error (numpy's "Importing the numpy C-extensions failed"), not an interrupt.
    A no-op outside the main thread."""
    got: list[int] = []
    try:
        old = signal.signal(signal.SIGINT, lambda signum, frame: got.append(signum))
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old if old is not None else signal.default_int_handler)
    if got:
        raise KeyboardInterrupt


class OneLineArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, like every other refusal:
    ``moonep-sim: error: <command>: <argparse's message>`` on stderr, exit status 2 (argparse's own
    prints the whole usage first). Subparsers made from it are of this class too."""

    def error(self, message: str):  # noqa: D102 (argparse's hook)
        print(f"moonep-sim: error: {self.prog}: {message.splitlines()[0] if message else 'bad arguments'}",
              file=sys.stderr, flush=True)
        sys.exit(2)
