"""Starting gloo ranks as processes: the torchrun replay, and a small rank spawner for tests.

``run_replay(nproc, argv, timeout_s)`` runs ``python -m torch.distributed.run --standalone
--nproc_per_node N -m moonep_sim.gloo.replay ARGV --json TMP`` and returns the parsed JSON.
``spawn_ranks(target, world, ...)`` starts ``world`` plain processes that rendezvous over a
TCPStore the caller hosts on a free local port (no torchrun agent, so a rank's failure is seen by
the others only through the executor's own timeouts), runs ``target(rank, world, **kwargs)`` on each and returns
every rank's exit code, output and result.

Both run children in their own process group and kill the whole group on timeout or Ctrl-C, so no
stray process survives; both set ``OMP_NUM_THREADS=1`` unless already set.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
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

from moonep_sim.errors import CommError, ConfigError, MoonEPSimError


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child_env(extra: dict[str, str] | None = None, pythonpath: Sequence[str] = ()) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra or {})
    return env


def _kill_group(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def reports_by_strategy(rep: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A replay's JSON as strategy -> that strategy's report (one, or several when interleaved)."""
    return rep["strategies"] if "strategies" in rep else {rep["strategy"]: rep}


def run_replay(nproc: int, argv: Sequence[str], timeout_s: float = 600.0, *, env: dict[str, str] | None = None,
               quiet: bool = True) -> dict[str, Any]:
    """Run the replay on ``nproc`` local gloo ranks under torchrun; return its JSON report.

    argv: replay arguments (``--trace T --strategy S ...``; ``--json`` is added). If a rank
    reports an error, it is raised here as its own class (ConfigError, TraceFormatError, PlanError,
    CommError) with its one-line message; any other failure, or exceeding ``timeout_s``, raises
    :class:`CommError` with the tail of the ranks' output. The process group is killed on
    timeout and on KeyboardInterrupt.
    """
    if nproc < 1:
        raise ConfigError(f"nproc ({nproc}) must be >= 1")
    with tempfile.TemporaryDirectory(prefix="moonep_replay_") as tmp:
        out = Path(tmp) / "replay.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "-m", "moonep_sim.gloo.replay", *map(str, argv), "--json", str(out)]
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=_child_env(env), start_new_session=True)
        try:
            text, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(p)
            text, _ = p.communicate()
            raise CommError(f"replay ({nproc} ranks) must finish within timeout ({timeout_s:.0f} s): killed; "
                            f"output tail: {_tail(text)}") from None
        except BaseException:
            _kill_group(p)
            p.wait()
            raise
        finally:
            if p.poll() is None:
                _kill_group(p)
                p.wait()
        if p.returncode != 0 or not out.exists():
            raise _replay_error(nproc, p.returncode, text)
        if not quiet:
            print(text, end="")
        return json.loads(out.read_text())


def _replay_error(nproc: int, code: int | None, text: str) -> MoonEPSimError:
    """The ranks' own one-line error (re-raised as its class), else the tail of their output."""
    import moonep_sim.errors as errors

    for ln in (text or "").splitlines():
        if "moonep-sim: error:" in ln:
            msg = ln.split("moonep-sim: error:", 1)[1].strip()
            for cls in (errors.ConfigError, errors.TraceFormatError, errors.PlanError, errors.CommError):
                if f"{cls.__name__}: " in msg:
                    where, rest = msg.split(f"{cls.__name__}: ", 1)
                    return cls(f"{rest} ({where.strip().rstrip(':')} of {nproc})")
            return CommError(f"replay ({nproc} ranks) failed: {msg}")
    return CommError(f"replay ({nproc} ranks) exit status ({code}) must be 0: {_tail(text)}")


def _tail(text: str, lines: int = 6) -> str:
    keep = [ln for ln in (text or "").strip().splitlines() if ln.strip() and not ln.startswith(("W1", "I1"))]
    return " | ".join(keep[-lines:])


# ---------------------------------------------------------------------------------------------
# Rank spawner (tests)
# ---------------------------------------------------------------------------------------------

@dataclass
class RankResult:
    """One spawned rank: exit code (None = killed by the spawner), captured output, its result."""

    rank: int
    returncode: int | None
    output: str
    result: dict[str, Any] = field(default_factory=dict)

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
    import datetime

    import torch.distributed as dist

    port = free_port()
    # the rendezvous store lives in this process (as torchrun's agent hosts it), so it outlives
    # any rank: survivors can still read the progress of a rank that died
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))
    with tempfile.TemporaryDirectory(prefix="moonep_spawn_") as tmp:
        procs = []
        logs = []
        for r in range(world):
            log = open(Path(tmp) / f"rank{r}.log", "w+")
            logs.append(log)
            child_env = _child_env({**(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                    "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r)}, pythonpath)
            cmd = [sys.executable, "-m", "moonep_sim.gloo.launcher", "--worker", target, "--out", tmp,
                   "--kwargs", json.dumps(kwargs or {}), "--pg-timeout", str(pg_timeout_s)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                          start_new_session=True))
        deadline = time.monotonic() + timeout_s
        killed: set[int] = set()
        try:
            while any(p.poll() is None for p in procs):
                failed = any(p.poll() not in (None, 0) for p in procs)
                waited = wait_for is not None and all(procs[r].poll() is not None for r in wait_for)
                if time.monotonic() > deadline or (failed and kill_on_failure) or waited:
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
            results.append(RankResult(r, None if r in killed else p.returncode, text, res))
        del store
        return results


def _worker(target: str, out_dir: str, kwargs: dict[str, Any], pg_timeout_s: float) -> int:
    import datetime

    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=pg_timeout_s))
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        dist.barrier()  # start together: process start-up skew must not eat into short timeouts
        mod_name, fn_name = target.split(":")
        fn = getattr(importlib.import_module(mod_name), fn_name)
        res = fn(rank, world, **kwargs) or {}
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
    ap = argparse.ArgumentParser(prog="python -m moonep_sim.gloo.launcher")
    ap.add_argument("--worker", required=True, help="module:function to run on this rank")
    ap.add_argument("--out", required=True)
    ap.add_argument("--kwargs", default="{}")
    ap.add_argument("--pg-timeout", type=float, default=60.0)
    a = ap.parse_args(argv)
    rc = _worker(a.worker, a.out, json.loads(a.kwargs), a.pg_timeout)
    sys.stdout.flush()
    sys.stderr.flush()
    # exit without running process-group destructors: after a failed collective they may block
    os._exit(rc)


if __name__ == "__main__":
    main()
