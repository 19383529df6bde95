"""Starting gloo ranks as local processes: a rank program (the replay, the Hugging Face training).

``run_rank_program(module, nproc, argv, timeout_s)`` starts ``nproc`` processes of ``python -m
MODULE ARGV --json TMP`` and returns the parsed JSON; a rank's error comes back as its own
exception class with its one line (the replay, ``moonep_sim.experiments.ranks.replay_rank``, runs
through it: ``replay_rank.run_replay``). The tests' rank spawner (``tests/rank_spawner.py``) starts
its ranks with the same pieces.

The rendezvous store is hosted in this process (so it outlives any rank: survivors can still read
a dead rank's progress and heartbeat), **bound to the loopback interface** (a TCPStore server
otherwise listens on every interface), and ranks connect to it as clients
(``TORCHELASTIC_USE_AGENT_STORE``); gloo's own sockets are bound to loopback too
(``GLOO_SOCKET_IFNAME=lo``) unless the caller's environment sets an interface. No torchrun agent
is involved, so each rank's exit code is seen directly. Children run in their own process group,
killed as a whole on timeout or Ctrl-C, so no stray process survives, with ``OMP_NUM_THREADS=1``
unless already set.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from moonep_sim.errors import CommError, ConfigError, MoonEPSimError

LOOPBACK = "127.0.0.1"


def loopback_store(world: int, timeout_s: float):
    """A TCPStore server for ``world`` client ranks listening on 127.0.0.1 only (on a free port);
    returns ``(store, port)``. The listening socket is bound here and handed to the store (which
    then owns it): torch's own server would listen on every interface."""
    import datetime

    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(1024)
    port = int(sock.getsockname()[1])
    store = dist.TCPStore(LOOPBACK, port, world + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)), master_listen_fd=sock.fileno())
    sock.detach()  # the store closes it
    return store, port


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    env = {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if "GLOO_SOCKET_IFNAME" not in os.environ and sys.platform.startswith("linux"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def _child_env(extra: dict[str, str] | None = None, pythonpath: Sequence[str] = ()) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra or {})
    return env


@contextlib.contextmanager
def _interrupts_deferred():
    """Hold SIGINT and SIGTERM back while the block runs and deliver them when it ends: a Ctrl-C
    that lands inside ``subprocess.Popen`` (after the fork, before it returns) would otherwise leave
    a started rank that no list holds, so nothing kills it. The ranks start with default handlers
    (a Python handler does not survive exec)."""
    sigs = (signal.SIGINT, signal.SIGTERM)
    if threading.current_thread() is not threading.main_thread() or any(signal.getsignal(s) is None for s in sigs):
        yield  # handlers can only be set from the main thread, and restored only if Python set them
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in sigs}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if got:
            signal.raise_signal(got[0])


def _proc_state(pid: int) -> str:
    """The kernel's one-letter state of process ``pid`` (``R``, ``S``, ``T`` stopped, ...; '' if unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def start_fault(procs: Sequence[subprocess.Popen], up_dir: Path) -> tuple[int, str] | None:
    """The first rank lost while starting, as the launcher sees it from its children: (rank, why)
    for a rank that has not reported the process group up (``up_dir/up<rank>``, see
    :mod:`moonep_sim.gloo.liveness`) and was killed by a signal or is stopped. A rank that exited
    with a status printed its own one line (bad input, a failed set-up) and is not counted here."""
    for r, p in enumerate(procs):
        if (up_dir / f"up{r}").exists():
            continue
        rc = p.poll()
        if rc is not None and rc < 0:
            name = signal.Signals(-rc).name if -rc in signal.valid_signals() else f"signal {-rc}"
            return r, f"died while starting (killed by {name})"
        if rc is None and _proc_state(p.pid) in ("T", "t"):
            return r, "stopped while starting (its process is stopped: SIGSTOP or a debugger)"
    return None


def _start_error(nproc: int, fault: tuple[int, str]) -> CommError:
    r, why = fault
    others = ", ".join(str(i) for i in range(nproc) if i != r)
    return CommError(f"starting: rank {r} of {nproc} {why} before the process group was up; the launcher "
                     f"stopped the other rank{'s' if nproc > 2 else ''} ({others})")


def _kill_group(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)


def reports_by_strategy(rep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A replay's JSON as strategy -> that strategy's report (one, or several when interleaved)."""
    return rep["strategies"] if "strategies" in rep else {rep["strategy"]: rep}


def strip_launch_args(argv: Sequence[str]) -> list[str]:
    """``argv`` without ``--nproc N`` and ``--json PATH`` (or ``--nproc=N``, ``--json=PATH``): the
    launcher's own, which a rank program is not given."""
    out, it = [], iter(argv)
    for a in it:
        if a in ("--nproc", "--json"):
            next(it, None)
        elif not a.startswith(("--nproc=", "--json=")):
            out.append(a)
    return out


def run_rank_program(module: str, nproc: int, argv: Sequence[str], timeout_s: float = 600.0, *,
                     env: dict[str, str] | None = None, quiet: bool = True, grace_s: float = 10.0,
                     what: str = "replay") -> dict[str, Any]:
    """Run ``python -m module`` (a rank program: the replay) on ``nproc`` local gloo ranks; return
    the JSON report rank 0 writes to the path of the ``--json`` argument added here.

    argv: the program's arguments (``--trace T --strategy S ...``). If a rank fails,
    the first rank's error to arrive is raised here as its own class (ConfigError, TraceFormatError,
    PlanError, CommError) with its one-line message; a rank that fails without one, or exceeding
    ``timeout_s``, raises :class:`CommError` with the tail of its output. Once one rank has failed
    the others get ``grace_s`` to fail by themselves (naming the phase), then are killed. The
    process group is killed on timeout and on KeyboardInterrupt (re-raised). ``what``: the program's
    name in those messages (``replay``, ``training``).
    """
    if nproc < 1:
        raise ConfigError(f"nproc ({nproc}) must be >= 1")
    with tempfile.TemporaryDirectory(prefix=f"msim{os.getpid()}-replay-") as tmp:
        out = Path(tmp) / "replay.json"
        store, port = loopback_store(nproc, timeout_s)
        procs, logs = [], []
        up_env = {"MOONEP_SIM_UP_DIR": tmp}
        try:
            with _interrupts_deferred():
                for r in range(nproc):
                    log = open(Path(tmp) / f"rank{r}.log", "w+")
                    logs.append(log)
                    cmd = [sys.executable, "-m", module, *map(str, argv), "--json", str(out)]
                    procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                  env=_child_env({**(env or {}), **up_env, **_rank_env(r, nproc, port)}),
                                                  start_new_session=True))
            order = _wait_ranks(procs, timeout_s, grace_s, Path(tmp))
        finally:  # a failure or an interrupt included: no rank outlives the call
            for p in procs:
                if p.poll() is None:
                    _kill_group(p)
                    p.wait()
            texts = []
            for log in logs:
                log.seek(0)
                texts.append(log.read())
                log.close()
            del store
        codes = [p.returncode for p in procs]
        if isinstance(order, tuple):
            raise _start_error(nproc, order)
        if order == "timeout":
            raise CommError(f"{what} ({nproc} ranks) must finish within timeout ({timeout_s:.0f} s): killed; "
                            f"output tail: {_tail(texts[0])}") from None
        if any(c != 0 for c in codes) or not out.exists():
            raise _replay_error(nproc, codes, texts, order, what)
        if not quiet:
            print(texts[0], end="")
        return json.loads(out.read_text())


def _wait_ranks(procs: list[subprocess.Popen], timeout_s: float, grace_s: float,
                up_dir: Path | None = None) -> list[int] | str | tuple[int, str]:
    """Wait for every rank; returns the ranks that failed in the order they exited, "timeout", or
    (rank, why) for a rank lost while starting (:func:`start_fault`: the caller kills the rest)."""
    deadline = time.monotonic() + timeout_s
    failed: list[int] = []
    starting = up_dir is not None
    while any(p.poll() is None for p in procs):
        if starting:
            fault = start_fault(procs, up_dir)
            if fault is not None:
                return fault
            starting = not all((up_dir / f"up{r}").exists() for r in range(len(procs)))
        for r, p in enumerate(procs):
            if p.poll() not in (None, 0) and r not in failed:
                failed.append(r)
                deadline = min(deadline, time.monotonic() + grace_s)
        if time.monotonic() > deadline:
            if not failed:
                return "timeout"
            break
        time.sleep(0.05)
    failed += [r for r, p in enumerate(procs) if p.poll() not in (None, 0) and r not in failed]
    return failed


def _replay_error(nproc: int, codes: list[int | None], texts: list[str], order: list[int],
                  what: str = "replay") -> MoonEPSimError:
    """The failing ranks' own one-line error (re-raised as its class): the first rank to fail with
    one, preferring an input error (every rank refuses bad input alike) over the CommErrors its
    exit caused in the others; else the tail of the first failing rank's output."""
    import moonep_sim.errors as errors

    classes = (errors.ConfigError, errors.TraceFormatError, errors.PlanError, errors.CommError)
    found = []
    for r in order or range(len(texts)):
        for ln in (texts[r] or "").splitlines():
            if "moonep-sim: error:" in ln:
                found.append((r, ln.split("moonep-sim: error:", 1)[1].strip()))
                break
    found.sort(key=lambda rm: "CommError: " in rm[1])  # stable: input errors first, then by exit order
    for r, msg in found:
        for cls in classes:
            if f"{cls.__name__}: " in msg:
                where, rest = msg.split(f"{cls.__name__}: ", 1)
                return cls(f"{rest} ({where.strip().rstrip(':') or f'rank {r}'} of {nproc})")
        return CommError(f"{what} ({nproc} ranks) failed: {msg}")
    r = (order or [0])[0]
    return CommError(f"{what} rank {r} of {nproc} exit status ({codes[r]}) must be 0: {_tail(texts[r])}")


def _tail(text: str, lines: int = 6) -> str:
    keep = [ln for ln in (text or "").strip().splitlines() if ln.strip() and not ln.startswith(("W1", "I1"))]
    return " | ".join(keep[-lines:])
