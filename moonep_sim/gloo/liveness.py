"""Naming the silent peer: heartbeats and phase progress kept in the process group's store.

When a collective fails or times out, the rank that sees it must say *which* peer is at fault. A
peer's progress alone cannot tell: a rank stopped with SIGSTOP (or dead) may have entered the same
phase as everyone else before going silent. So each rank process keeps a **heartbeat**: a daemon
thread that increments a counter in the store every ``HEARTBEAT_INTERVAL_S`` (over its own store
connection, so a blocked collective never delays it). A failing rank watches every member's
counter for up to ``LIVENESS_WINDOW_S``: a peer whose counter does not move is stopped or dead, and
is named as the silent peer; a peer that announced its own failure or exit (it writes its state
before leaving) is never blamed for its silence.

Progress comes second: each rank records the phase it enters (``mark``), so a live peer that is
merely behind is named with the last phase it entered, and every failure names its own phase.

Store keys (under ``moonep_sim/live/``): ``hb<rank>`` the heartbeat counter, ``st<rank>`` a state
a rank announces (``failed in PHASE``, ``exited N``); progress keys live under each tracker's prefix
(``<prefix>r<ep rank>`` = ``seq|phase``). Ranks here are global process-group ranks unless named
"EP rank".

The heartbeat is a process-wide resource (one thread per rank process, started by the first
tracker, living until the process exits); it is the one piece of module state here.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

import torch.distributed as dist

from moonep_sim.errors import CommError, require

HEARTBEAT_INTERVAL_S = 0.2
LIVENESS_WINDOW_S = 2.0  # a live rank beats ~10 times in this window, even on a loaded machine
_ROOT = "moonep_sim/live/"


class _Heartbeat:
    """One rank's heartbeat thread (see the module docstring)."""

    def __init__(self, store, rank: int, interval_s: float):
        self.rank = rank
        self.base = store  # where every rank of the job keeps its heartbeat (silent_ranks reads it)
        try:
            own = store.clone()  # its own connection: never queued behind the main thread's calls
        except Exception:
            own = store
        self._store = dist.PrefixStore(_ROOT, own)
        self._stop = threading.Event()
        self._interval_s = interval_s
        self.state = ""  # what this rank last announced
        self._store.set(f"hb{rank}", "0")
        self._thread = threading.Thread(target=self._beat, name=f"moonep-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        n = 0
        while not self._stop.wait(self._interval_s):
            n += 1
            try:
                self._store.set(f"hb{self.rank}", str(n))
            except Exception:  # the store is gone (the job is ending): nothing left to tell
                return

    def announce(self, state: str) -> None:
        self.state = state
        with contextlib.suppress(Exception):
            self._store.set(f"st{self.rank}", state)


_PROCESS_HEARTBEAT: _Heartbeat | None = None  # this process's heartbeat (one rank per process)


def default_store():
    """The default process group's store, or None (no group, or a backend without one)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def ensure_heartbeat(rank: int | None = None, store=None) -> bool:
    """Start this process's heartbeat (once) in ``store`` (default: the default group's); True when one runs."""
    global _PROCESS_HEARTBEAT
    store = default_store() if _PROCESS_HEARTBEAT is None and store is None else store
    if _PROCESS_HEARTBEAT is None and store is not None:
        with contextlib.suppress(Exception):
            _PROCESS_HEARTBEAT = _Heartbeat(store, dist.get_rank() if rank is None else rank, HEARTBEAT_INTERVAL_S)
    return _PROCESS_HEARTBEAT is not None


def announced_failure() -> bool:
    """True when this process announced a failure (``failed in PHASE``)."""
    return _PROCESS_HEARTBEAT is not None and _PROCESS_HEARTBEAT.state.startswith("failed")


def stop_heartbeat(timeout_s: float = 5.0) -> None:
    """Stop this process's heartbeat thread and join it (process teardown,
    :func:`moonep_sim.gloo.teardown.shutdown`): no thread is left inside a store call at exit."""
    global _PROCESS_HEARTBEAT
    hb, _PROCESS_HEARTBEAT = _PROCESS_HEARTBEAT, None
    if hb is not None:
        hb._stop.set()
        hb._thread.join(timeout_s)


def announce(state: str) -> None:
    """Tell the peers why this rank is about to go quiet (``failed in PHASE``, ``exited 0``), so its
    silence is not taken for a stopped or dead process. A no-op without a heartbeat."""
    if _PROCESS_HEARTBEAT is not None:
        _PROCESS_HEARTBEAT.announce(state)


def _read(store, key: str) -> str | None:
    if not store.check([key]):
        return None
    return store.get(key).decode()


def silent_ranks(ranks: Sequence[int], me: int, window_s: float = LIVENESS_WINDOW_S,
                 store=None) -> tuple[dict[int, str], dict[int, str]]:
    """Watch the heartbeats of ``ranks`` (global ranks, ``me`` skipped) for up to ``window_s``.

    Returns ``(silent, announced)``: rank -> why it is silent (``"no heartbeat for 2.0 s"``,
    ``"never started"``), and rank -> the state it announced (those are never called silent).
    Returns early once every rank has beaten or announced. The heartbeats are read where this
    process's own heartbeat writes (every rank of a job starts it the same way), else in ``store``."""
    hb = _PROCESS_HEARTBEAT
    store = (hb.base if hb is not None else None) or store or default_store()
    if store is None:
        return {}, {}
    live = dist.PrefixStore(_ROOT, store)
    others = [r for r in ranks if r != me]
    first = {r: _read(live, f"hb{r}") for r in others}
    pending = set(others)
    announced: dict[int, str] = {}
    t0 = time.monotonic()
    while True:
        for r in list(pending):
            st = _read(live, f"st{r}")
            if st is not None:
                announced[r] = st
                pending.discard(r)
            elif first[r] is not None and _read(live, f"hb{r}") != first[r]:
                pending.discard(r)
        if not pending or time.monotonic() - t0 >= window_s:
            break
        time.sleep(HEARTBEAT_INTERVAL_S / 2)  # polling the peers' counters, on the failure path only
    silent = {r: ("never started" if first[r] is None else f"no heartbeat for {window_s:.1f} s: stopped or dead")
              for r in sorted(pending)}
    return silent, announced


class PhaseTracker:
    """Phase progress and failure naming for one group of ranks (a Buffer's EP group, a replay).

    prefix: store prefix of this group's progress records. rank: this rank's index in ``members``
    (global ranks of the group, in EP order). timeout_s: the limit :meth:`run` waits for."""

    def __init__(self, prefix: str, rank: int, members: Sequence[int], timeout_s: float):
        self.rank = rank
        self.members = list(members)
        self.timeout_s = float(timeout_s)
        self._timeout = datetime.timedelta(seconds=self.timeout_s)
        self.seq = 0
        self.phase = "start"
        store = default_store()
        self._base = store
        self._store = dist.PrefixStore(prefix, store) if store is not None else None
        ensure_heartbeat(self.members[rank])

    def mark(self, phase: str) -> None:
        """Record that this rank enters collective number ``seq`` (phase) -- read when a peer fails."""
        self.seq += 1
        self.phase = phase
        if self._store is not None:
            try:
                self._store.set(f"r{self.rank}", f"{self.seq}|{phase}")
            except Exception:
                self._store = None

    def _progress(self, p: int) -> tuple[int, str] | None:
        if self._store is None or not self._store.check([f"r{p}"]):
            return None
        seq, phase = self._store.get(f"r{p}").decode().split("|", 1)
        return int(seq), phase

    def suspects(self, peers: Sequence[int], focus: int | None = None) -> str:
        """Who is at fault, in words. First liveness over every member: a peer whose heartbeat
        stopped (stopped or dead) is named, with the last phase it entered. Failing that,
        progress over ``peers`` (EP ranks): ``focus`` (the one peer of a failed message) alone when
        it is behind, else every peer that had not reached this phase."""
        if self._store is None:
            return "peer unknown: no progress store"
        try:
            silent, announced = silent_ranks(self.members, self.members[self.rank], store=self._base)
            if silent:
                ep = {g: i for i, g in enumerate(self.members)}
                parts = []
                for g, why in silent.items():
                    prog = self._progress(ep[g])
                    last = f"; last entered {prog[1]}" if prog else ""
                    parts.append(f"{ep[g]} ({why}{last})")
                return f"silent peer rank{'s' if len(parts) > 1 else ''} {', '.join(parts)}"
            behind, gone = [], []
            for p in ([focus] if focus is not None else []) + [p for p in peers if p != focus]:
                if p == self.rank:
                    continue
                prog = self._progress(p)
                if prog is None:
                    gone.append(p)
                elif prog[0] < self.seq:
                    behind.append(f"{p} (last entered {prog[1]})")
                if p == focus and (behind or gone):
                    break
        except Exception:
            return "peer unknown: progress store unreachable"
        failed = [f"{i} ({st})" for i, g in enumerate(self.members) if (st := announced.get(g))]
        tail = f"; peer{'s' if len(failed) > 1 else ''} {', '.join(failed)}" if failed else ""
        if gone:
            return f"peer rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} never started{tail}"
        if behind:
            return f"peer rank{'s' if len(behind) > 1 else ''} {', '.join(behind)} behind, alive{tail}"
        return "every peer alive and at this phase" + tail

    def run(self, phase: str, op: str, issue: Callable[[], Any], peers: Sequence[int] | None = None,
            focus: int | None = None) -> Any:
        """Issue a collective (``issue`` returns its async work, or None) and wait for it with the
        timeout; on failure announce it, then raise :class:`CommError` naming ``phase``, ``op``,
        this rank and the culprit. Returns the work's result (None)."""
        peers = range(len(self.members)) if peers is None else peers
        t0 = time.perf_counter()
        try:
            work = issue()
            if work is not None:
                work.wait(timeout=self._timeout)
        except RuntimeError as e:
            dt = time.perf_counter() - t0
            text = gloo_text(e)
            timed_out = "timed out" in text.lower() or "timeout" in text.lower()
            what = f"timed out after {self.timeout_s:.1f} s" if timed_out else f"failed after {dt:.1f} s"
            announce(f"failed in {phase}")
            raise CommError(f"{phase} {op} {what} on rank {self.rank} ({self.suspects(peers, focus)}): "
                            f"{text[:240]}") from None

    def collective(self, phase: str, op: str, issue: Callable[[], Any]) -> None:
        """:meth:`mark` then :meth:`run` over every member: a named barrier or gather."""
        self.mark(phase)
        self.run(phase, op, issue)


def gloo_text(e: BaseException) -> str:
    """The first line of a gloo error without its source location and boilerplate advice."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(" This is typically", 1)[0].strip()


# ---------------------------------------------------------------------------------------- start-up
# Before the process group is up there is no default store and no heartbeat, so a peer that dies or
# stops while the group initialises used to be named by nobody (the survivors reported torch's
# "wait timeout ... keys: /default_pg/0//cpu//0/1"). A rank therefore starts its heartbeat on its
# own connection to the rendezvous store *before* init_process_group (:func:`start_early`), under the
# key namespace the default group will use, and a watchdog bounds the set-up: when the group is not
# up within the timeout, the rank names the silent peers (phase "starting") and exits 1 -- after the
# timeout plus at most the liveness window. Once up, the rank touches ``$MOONEP_SIM_UP_DIR/up<rank>``
# (when set): the launcher, which knows its children's pids, reads it to tell a rank lost while
# starting from one lost later (``moonep_sim.gloo.launcher``).

FAULT_ENV = "MOONEP_SIM_FAULT"
"""Test hook: ``RANK:POINT:SIGNAL`` makes rank RANK send itself SIGNAL (``KILL``, ``STOP``, ``INT``)
when it reaches POINT (``starting``: before the process group is set up; ``started``: just after)."""

UP_DIR_ENV = "MOONEP_SIM_UP_DIR"
WATCHDOG_MARGIN_S = 1.0  # the watchdog acts this long after the set-up timeout (then the liveness window)
STARTING = "starting"


def fault_point(point: str, rank: int | str | None) -> None:
    """The :data:`FAULT_ENV` hook at ``point`` (a no-op unless the variable names this rank and point)."""
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    r, _, rest = spec.partition(":")
    p, _, sig = rest.partition(":")
    if p == point and str(r) == str(rank):
        os.kill(os.getpid(), getattr(signal, sig if sig.startswith("SIG") else "SIG" + sig))


def who_is_silent(world: int, me: int, store=None) -> str:
    """In words, which of the ``world`` ranks are silent (stopped or dead, from their heartbeats),
    else which announced why they left, else that every peer is alive."""
    if store is None and _PROCESS_HEARTBEAT is None and default_store() is None:
        return "peers unknown: no rendezvous store"
    try:
        silent, announced = silent_ranks(range(world), me, store=store)
    except Exception:
        return "peers unknown: rendezvous store unreachable"
    if silent:
        return "silent peer rank" + ("s " if len(silent) > 1 else " ") + ", ".join(f"{r} ({why})" for r, why in silent.items())
    gone = [f"{r} ({st})" for r, st in announced.items()]
    return ("peer " + ", ".join(gone)) if gone else "every peer alive"


class StartWatch:
    """One rank's start-up: its early heartbeat and a watchdog over the process group's set-up."""

    def __init__(self, base_store, rank: int, world: int, timeout_s: float):
        self.rank, self.world, self.timeout_s = rank, world, float(timeout_s)
        self.base = base_store
        self.up = threading.Event()
        self._claim = threading.Lock()
        if base_store is not None:  # before the group is up there is no default store to fall back on
            ensure_heartbeat(rank, base_store)
        self._thread = threading.Thread(target=self._watch, name=f"moonep-start-{rank}", daemon=True)
        self._thread.start()

    def failure(self, detail: str) -> str:
        """The one line of a failed start-up: phase, this rank, the silent peers (from heartbeats)."""
        return (f"{STARTING}: process group set-up {detail} on rank {self.rank} of {self.world} "
                f"({who_is_silent(self.world, self.rank, self.base)})")

    def claim(self) -> bool:
        """True for the first caller only: one thread reports a failed start-up (one line)."""
        return self._claim.acquire(blocking=False)

    def report(self, detail: str) -> str:
        """The main thread's failed set-up (``detail``: torch's error): the line to raise, or -- when
        the watchdog reports already -- wait for it to end the process."""
        self.up.set()
        if not self.claim():
            threading.Event().wait()  # the watchdog prints the one line and exits the process
        announce(f"failed in {STARTING}")
        return self.failure(detail)

    def _watch(self) -> None:
        # a little past the set-up's own timeout: torch's error, raised in the main thread, comes first
        if self.up.wait(self.timeout_s + WATCHDOG_MARGIN_S) or not self.claim():
            return
        line = self.failure(f"did not finish within the timeout ({self.timeout_s:.1f} s)")
        announce(f"failed in {STARTING}")
        print(f"moonep-sim: error: rank {self.rank}: CommError: {line}", file=sys.stderr, flush=True)
        os._exit(1)

    def started(self) -> None:
        """The group is up: stop the watchdog and tell the launcher (``$MOONEP_SIM_UP_DIR``)."""
        self.up.set()
        d = os.environ.get(UP_DIR_ENV)
        if d:
            with contextlib.suppress(OSError):
                with open(os.path.join(d, f"up{self.rank}"), "w"):
                    pass


def start_early(rank: int, world: int, timeout_s: float, store=None, prefix: str | None = "default_pg") -> StartWatch:
    """Before ``init_process_group``: the heartbeat on ``store`` (default: a new connection to
    ``MASTER_ADDR:MASTER_PORT``, under ``prefix`` as an ``env://`` group keys it) and the start-up
    watchdog (see the section comment above)."""
    base = store
    if base is None:
        try:
            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                 timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))
        except Exception:
            base = None
    if base is not None and prefix:
        base = dist.PrefixStore(prefix, base)
    return StartWatch(base, rank, world, timeout_s)


def join_group(timeout_s: float, script: str) -> StartWatch | None:
    """Join the gloo process group torchrun's environment describes (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``): the heartbeat and start-up watchdog first (:func:`start_early`), then
    ``init_process_group``, the :data:`FAULT_ENV` hooks around it. Returns the start-up watch; None
    when the group is already up. ``script``: the launch script a missing environment names."""
    if dist.is_initialized():
        return None
    require("RANK" in os.environ and "WORLD_SIZE" in os.environ, "RANK / WORLD_SIZE (unset) must be set: run with "
            f"--nproc N, or under torchrun --nproc_per_node N {script} ...")
    rank = os.environ["RANK"]
    watch = start_early(int(rank), int(os.environ["WORLD_SIZE"]), max(timeout_s, 1.0))
    fault_point(STARTING, rank)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))
    watch.started()
    fault_point("started", rank)
    return watch
