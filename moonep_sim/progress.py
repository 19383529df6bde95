"""Progress of long work: one helper for every command, API call and launcher.

A progress callback is ``progress(message, done, total)`` (``total`` 0: unknown). :func:`tracker`
yields one:

- on a terminal (stderr is a tty, this is the main process and nothing asked for quiet): a rich
  progress bar on stderr, removed when the work ends (``transient``), so stdout -- the table or
  the JSON -- is exactly what it is without it;
- otherwise (piped, redirected, a worker process, :func:`set_quiet`, ``MOONEP_SIM_QUIET=1``):
  nothing, at no cost; ``MOONEP_SIM_PROGRESS=lines`` prints plain lines on stderr instead (one
  when the work moves on, at most every 15 s, and a heartbeat while one piece runs long) when a
  long job's log should show it (CI).

Nested trackers share the one live display: an inner call (a sweep point's step, a step's
layers) adds its own bar under the outer one and removes it when done; rich allows one live
display at a time, and every caller goes through here. The bar redraws on rich's own thread at
most 10 times a second; an update is a dict write under a lock (microseconds per layer).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import sys
import threading
import time
from typing import Callable, Iterator

#: a progress callback: (message, done, total); total 0 when unknown
Callback = Callable[[str, int, int], None]

#: seconds between plain progress lines (``MOONEP_SIM_PROGRESS=lines``)
LINE_INTERVAL_S = 15.0

_lock = threading.Lock()
_live: list = []          # [rich Progress] while a bar is shown (one live display per process)
_quiet = [False]


def set_quiet(quiet: bool = True) -> None:
    """Silence every tracker of this process (``--quiet``)."""
    _quiet[0] = bool(quiet)


@contextlib.contextmanager
def quieted(quiet: bool = True) -> Iterator[None]:
    """Silence every tracker for the ``with`` block when ``quiet`` (a command's ``--quiet``), and
    restore what was set before on the way out (so an in-process call leaves no trace)."""
    before = _quiet[0]
    _quiet[0] = before or bool(quiet)
    try:
        yield
    finally:
        _quiet[0] = before


def enabled() -> bool:
    """Whether :func:`tracker` draws a bar here: stderr a terminal, the main process, not quiet."""
    if _quiet[0] or os.environ.get("MOONEP_SIM_QUIET", "") not in ("", "0"):
        return False
    if multiprocessing.parent_process() is not None:
        return False
    try:
        return sys.stderr.isatty() and os.environ.get("TERM", "") != "dumb"
    except (AttributeError, ValueError):
        return False


def _noop(message: str, done: int, total: int) -> None:
    return None


def _lines_wanted() -> bool:
    return os.environ.get("MOONEP_SIM_PROGRESS", "") == "lines" and not _quiet[0]


@contextlib.contextmanager
def tracker(description: str, total: int = 0, *, show: bool | None = None,
            interval_s: float = LINE_INTERVAL_S) -> Iterator[Callback]:
    """A progress callback for the work inside the ``with`` block (see the module docstring).
    ``show``: None -- decide (:func:`enabled`); False -- a no-op callback; True -- a bar even when
    stderr is not a terminal (tests). ``interval_s``: the plain lines' spacing."""
    if multiprocessing.parent_process() is not None:  # a worker: its parent shows the progress
        show = False
    with _lock:
        outer = _live[0] if _live and show is not False else None
    on = outer is not None or (enabled() if show is None else bool(show))
    if not on:
        if show is None and _lines_wanted():
            with _LineProgress(description, interval_s) as cb:
                yield cb
            return
        yield _noop
        return
    if outer is not None:                       # nested: one more bar under the live one
        task = outer.add_task(description, total=total or None, what="")
        try:
            yield lambda msg, done, tot: outer.update(task, completed=done, total=tot or None, what=msg)
        finally:
            outer.remove_task(task)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[what]}"), TimeElapsedColumn(),
                    console=Console(file=sys.stderr, force_terminal=True if show else None), transient=True)
    task = prog.add_task(description, total=total or None, what="")
    with _lock:
        _live.append(prog)
    try:
        with prog:
            yield lambda msg, done, tot: prog.update(task, completed=done, total=tot or None, what=msg)
    finally:
        with _lock:
            _live.remove(prog)


class _LineProgress:
    """Plain progress lines on stderr (``MOONEP_SIM_PROGRESS=lines``): one when the message
    changes, at most every ``interval_s`` (and at the first and the last), and a ``(still running)``
    heartbeat every ``interval_s`` while one piece runs long, so a CI log never goes silent."""

    def __init__(self, description: str, interval_s: float):
        self.description, self.interval_s = description, interval_s
        self.t0 = time.monotonic()
        self.last_print = -1e9
        self.state = ("starting", 0, 0)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._beat, name="moonep-sim-progress", daemon=True)

    def _line(self, note: str = "") -> None:
        msg, done, total = self.state
        frac = f" {done}/{total}" if total else ""
        print(f"[{self.description}{frac}, {time.monotonic() - self.t0:.0f} s] {msg}{note}", file=sys.stderr,
              flush=True)
        self.last_print = time.monotonic()

    def update(self, msg: str, done: int, total: int) -> None:
        with self.lock:
            changed = msg != self.state[0]
            self.state = (msg, done, total)
            if changed and (time.monotonic() - self.last_print >= self.interval_s or done == 0 or msg == "done"):
                self._line()

    def _beat(self) -> None:
        while not self.done.wait(self.interval_s / 3):
            with self.lock:
                if time.monotonic() - self.last_print >= self.interval_s:
                    self._line(" (still running)")

    def __enter__(self) -> Callback:
        self.thread.start()
        return self.update

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


#: the environment variable naming the file a child process reports its progress to (:func:`followed`)
FILE_ENV = "MOONEP_SIM_PROGRESS_FILE"


def to_file(path: str | os.PathLike | None = None, min_interval_s: float = 0.2) -> Callback:
    """A callback another process can follow: each update replaces ``path`` (default: the file
    :data:`FILE_ENV` names; a no-op when none is named) with ``done<TAB>total<TAB>message``, at most
    every ``min_interval_s`` (and always the last piece). For work in other processes (the ranks of
    ``launch/train_hf.py``), whose parent shows the bar (:func:`followed`)."""
    dest = path if path is not None else os.environ.get(FILE_ENV)
    if not dest:
        return _noop
    last = [0.0]

    def cb(message: str, done: int, total: int) -> None:
        now = time.monotonic()
        if now - last[0] < min_interval_s and done < total:
            return
        last[0] = now
        tmp = f"{dest}.{os.getpid()}.tmp"
        try:
            with open(tmp, "w") as f:
                f.write(f"{int(done)}\t{int(total)}\t{message}")
            os.replace(tmp, dest)
        except OSError:
            pass  # progress is never worth failing the work for
    return cb


@contextlib.contextmanager
def followed(path: str | os.PathLike, callback: Callback, poll_s: float = 0.25) -> Iterator[None]:
    """While the block runs, child processes started in it find ``path`` in :data:`FILE_ENV` (their
    :func:`to_file` writes there) and a thread here reads it every ``poll_s`` into ``callback``."""
    if callback is _noop:
        yield
        return
    old = os.environ.get(FILE_ENV)
    os.environ[FILE_ENV] = str(path)
    stop = threading.Event()

    def poll() -> None:
        seen = None
        while not stop.wait(poll_s):
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:
                continue
            if text != seen:
                seen = text
                parts = text.split("\t", 2)
                if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit():
                    callback(parts[2], int(parts[0]), int(parts[1]))

    t = threading.Thread(target=poll, name="moonep-sim-progress-follow", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()
        if old is None:
            os.environ.pop(FILE_ENV, None)
        else:
            os.environ[FILE_ENV] = old


def resolve(progress, description: str):
    """What an API function's ``progress=`` means: a callback is used as given, False or the no-op
    means none, None means a :func:`tracker` of its own (a bar on a terminal). A context manager
    yielding the callback to call."""
    if progress is None:
        return tracker(description)
    return contextlib.nullcontext(_noop if progress is False else progress)


__all__ = ["Callback", "FILE_ENV", "LINE_INTERVAL_S", "enabled", "followed", "quieted", "resolve", "set_quiet",
           "to_file", "tracker"]
