"""A small rank spawner for the multi-process tests (and two benchmarks): ``spawn_ranks(target, world,
...)`` starts ``world`` plain processes joined in one gloo group, runs ``target(rank, world,
**kwargs)`` on each and returns every rank's exit code, output and result.

Like :func:`moonep_sim.gloo.launcher.run_rank_program` it hosts the rendezvous store in this
process (bound to loopback, so it outlives any rank: survivors can still read a dead rank's progress
and heartbeat), runs children in their own process group and kills the whole group on timeout,
and names a rank lost while starting (``RankResult.launcher_note``). Each child runs ``python -m
rank_spawner --worker module:function`` with this folder on its ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from moonep_sim.errors import CommError, MoonEPSimError
from moonep_sim.gloo.launcher import _child_env, _kill_group, _rank_env, loopback_store, start_fault

HERE = str(Path(__file__).resolve().parent)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RankResult:
    """One spawned rank: exit code (None = killed by the spawner), captured output, its result."""

    rank: int
    returncode: int | None
    output: str
    result: dict[str, Any] = field(default_factory=dict)
    launcher_note: str = ""  # what the spawner saw of this rank: "died while starting (...)", ...
    exit_s: float | None = None  # seconds from the spawn to the spawner seeing this rank exit
    noted_s: float | None = None  # seconds from the spawn to launcher_note

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def spawn_ranks(target: str, world: int, kwargs: dict[str, Any] | None = None, *, timeout_s: float = 120.0,
                pythonpath: Sequence[str] = (), kill_on_failure: bool = True,
                pg_timeout_s: float = 60.0, wait_for: Sequence[int] | None = None,
                env: dict[str, str] | None = None) -> list[RankResult]:
    """Run ``module:function`` on ``world`` fresh processes joined in one gloo group.

    The function is called as ``fn(rank, world, **kwargs)`` after ``init_process_group("gloo")``
    and returns a dict of JSON scalars and numpy arrays (saved by each rank, read back here, never
    unpickled). With ``kill_on_failure`` the others are killed as soon as one rank fails (so a
    failing rank never leaves the rest waiting); without it they are left to fail on their own
    (failure tests), and ``timeout_s`` bounds the whole run. ``env``: extra environment for the
    ranks. ``wait_for``: stop (killing the
    rest) as soon as these ranks have exited, e.g. the survivors of a rank made to stall.
    """
    # the rendezvous store lives in this process (as torchrun's agent hosts it), so it outlives
    # any rank: survivors can still read the progress and heartbeat of a rank that died
    store, port = loopback_store(world, timeout_s)
    with tempfile.TemporaryDirectory(prefix=f"msim{os.getpid()}-spawn-") as tmp:
        procs = []
        logs = []
        for r in range(world):
            log = open(Path(tmp) / f"rank{r}.log", "w+")
            logs.append(log)
            child_env = _child_env({**(env or {}), "MOONEP_SIM_UP_DIR": tmp, **_rank_env(r, world, port)},
                                   [HERE, *pythonpath])
            cmd = [sys.executable, "-m", "rank_spawner", "--worker", target, "--out", tmp,
                   "--kwargs", json.dumps(kwargs or {}), "--pg-timeout", str(pg_timeout_s)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                          start_new_session=True))
        t_spawn = time.monotonic()
        deadline = t_spawn + timeout_s
        killed: set[int] = set()
        notes: dict[int, str] = {}
        noted: dict[int, float] = {}
        exits: dict[int, float] = {}
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic() - t_spawn
                exits.update({r: now for r, p in enumerate(procs) if r not in exits and p.poll() is not None})
                fault = None if notes else start_fault(procs, Path(tmp))
                if fault is not None:
                    noted[fault[0]] = now
                    notes[fault[0]] = fault[1]  # named at once; without kill_on_failure the survivors
                    if kill_on_failure:        # are left to name it themselves
                        for r, p in enumerate(procs):
                            if p.poll() is None:
                                _kill_group(p)
                                killed.add(r)
                failed = any(p.poll() not in (None, 0) for p in procs)
                waited = wait_for is not None and all(procs[r].poll() is not None for r in wait_for)
                if time.monotonic() > deadline or (failed and kill_on_failure) or waited:
                    now = time.monotonic() - t_spawn
                    exits.update({r: now for r, p in enumerate(procs) if r not in exits and p.poll() is not None})
                    for r, p in enumerate(procs):
                        if p.poll() is None:
                            _kill_group(p)
                            killed.add(r)
                    break
                time.sleep(0.05)
        finally:
            for r, p in enumerate(procs):
                if p.poll() is None:
                    _kill_group(p)
                    killed.add(r)
                p.wait()
        results = []
        for r, (p, log) in enumerate(zip(procs, logs)):
            log.seek(0)
            text = log.read()
            log.close()
            res: dict[str, Any] = {}
            jpath, npath = Path(tmp) / f"rank{r}.json", Path(tmp) / f"rank{r}.npz"
            if jpath.exists():
                res.update(json.loads(jpath.read_text()))
            if npath.exists():
                with np.load(npath, allow_pickle=False) as z:
                    res.update({k: z[k] for k in z.files})
            results.append(RankResult(r, None if r in killed else p.returncode, text, res, notes.get(r, ""),
                                      exits.get(r), noted.get(r)))
        del store
        return results


def _worker(target: str, out_dir: str, kwargs: dict[str, Any], pg_timeout_s: float) -> int:
    import datetime

    import torch.distributed as dist

    from moonep_sim.gloo.liveness import STARTING, fault_point, start_early

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    watch = None
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=pg_timeout_s))
        # the heartbeat before the group (an explicit store: the group keys it without a prefix)
        watch = start_early(rank, world, pg_timeout_s, store=store, prefix=None)
        fault_point(STARTING, rank)
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world, store=store,
                                    timeout=datetime.timedelta(seconds=pg_timeout_s))
            dist.barrier()  # start together: process start-up skew must not eat into short timeouts
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
            raise CommError(watch.report(f"failed: {first}")) from None
        watch.started()
        fault_point("started", rank)
        mod_name, fn_name = target.split(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        t0 = time.perf_counter()
        try:
            res = fn(rank, world, **kwargs) or {}
        except MoonEPSimError:
            raise  # already one named line (a CommError is a RuntimeError too)
        except RuntimeError as e:  # a collective no phase tracker watched (e.g. a group's lazy connect)
            from moonep_sim.gloo.liveness import announce, gloo_text, who_is_silent
            announce("failed in an unwatched collective")
            raise CommError(f"unwatched collective failed after {time.perf_counter() - t0:.1f} s on rank {rank} "
                            f"({who_is_silent(world, rank)}): {gloo_text(e)[:240]}") from None
        arrays = {k: np.asarray(v) for k, v in res.items() if isinstance(v, np.ndarray) or hasattr(v, "numpy")}
        arrays = {k: (v.detach().numpy() if hasattr(v, "detach") else v) for k, v in arrays.items()}
        scalars = {k: v for k, v in res.items() if k not in arrays}
        np.savez(Path(out_dir) / f"rank{rank}.npz", **{k: np.asarray(v) for k, v in arrays.items()})
        (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(scalars))
    except MoonEPSimError as e:
        print(f"moonep-sim: error: {type(e).__name__}: {e}", flush=True)
        return 2 if not isinstance(e, CommError) else 1
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m rank_spawner")
    ap.add_argument("--worker", required=True, help="module:function to run on this rank")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kwargs", default="{}")
    ap.add_argument("--pg-timeout", type=float, default=60.0)
    a = ap.parse_args(argv)
    rc = _worker(a.worker, a.out, json.loads(a.kwargs), a.pg_timeout)
    from moonep_sim.gloo.liveness import announce
    announce(f"exited {rc}")  # the peers must not take this rank's silence for a stopped process
    sys.stdout.flush()
    sys.stderr.flush()
    # exit without running process-group destructors: after a failed collective they may block
    os._exit(rc)


if __name__ == "__main__":
    main()
