"""Independent experiment points in worker processes, or on a Dask cluster.

``run_points(fn, items, jobs=..., cluster=...)`` calls ``fn(item)`` for every item and returns the
results in item order, whatever order they complete in, so a parallel run assembles the same
report as a serial one (each point is deterministic by its own seed). ``progress(label, done,
total)`` is called as points complete.

- ``jobs = 1``: in this process, one after another.
- ``jobs = N > 1`` (default: the machine's cores): a ``ProcessPoolExecutor`` of N workers.
- ``cluster = "tcp://host:8786"``: the points are submitted to an existing Dask scheduler
  (``pip install moonep-sim[cluster]``). Dask rather than Ray: its distributed scheduler is a pure
  Python wheel of a few MB that any Python the project supports can install, ``LocalCluster``
  starts in a second or two (the test runs one), and its submit / as_completed model is exactly
  this one (independent function calls); Ray brings a large native runtime and object store that a
  sweep of a few dozen small points does not use. The workers must have moonep-sim installed.

``fn`` and the items must be picklable (module-level functions, plain data).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from moonep_sim.errors import ConfigError, require
from moonep_sim.perf import host_cores

Progress = Callable[[str, int, int], None]


def check_jobs(jobs: int | None) -> int:
    jobs = host_cores() if jobs is None else int(jobs)
    require(jobs >= 1, f"--jobs ({jobs}) must be >= 1")
    return jobs


def run_points(fn: Callable[[Any], Any], items: Sequence[Any], *, jobs: int | None = 1, cluster: str | None = None,
               progress: Progress | None = None, label: Callable[[Any], str] = str) -> list[Any]:
    """``[fn(x) for x in items]``, computed serially, in ``jobs`` processes or on a Dask cluster."""
    items = list(items)
    total = len(items)
    out: list[Any] = [None] * total
    done = 0

    def tick(i: int) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(f"{label(items[i])} done", done, total)

    if cluster:
        from moonep_sim.experiments.checks import check_cluster_address
        return _run_dask(fn, items, check_cluster_address(cluster), out, tick)
    jobs = check_jobs(jobs)
    if jobs == 1 or total <= 1:
        for i, x in enumerate(items):
            if progress:
                progress(str(label(x)), done, total)
            out[i] = fn(x)
            tick(i)
        return out
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor, as_completed

    # fork: workers start at once with the parent's imports (no torch or threads are running here)
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    ex = ProcessPoolExecutor(max_workers=min(jobs, total), mp_context=ctx, initializer=_ignore_interrupts)
    try:
        futs = {ex.submit(fn, x): i for i, x in enumerate(items)}
        if progress:
            progress(f"{total} points on {min(jobs, total)} workers", 0, total)
        for f in as_completed(futs):
            i = futs[f]
            out[i] = f.result()
            tick(i)
    except BaseException:  # Ctrl-C or a failed point: stop the workers now, not after their running points
        for p in list(getattr(ex, "_processes", {}).values()):
            p.terminate()
        ex.shutdown(wait=True, cancel_futures=True)
        raise
    ex.shutdown(wait=True)
    return out


def _ignore_interrupts() -> None:
    """A worker leaves Ctrl-C to the parent (which stops it): no worker prints a KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _run_dask(fn, items, address: str, out: list, tick) -> list:
    try:
        from distributed import Client, as_completed
    except ImportError:
        raise ConfigError(f"--cluster ({address}) needs Dask's distributed scheduler: "
                          "pip install 'moonep-sim[cluster]' (or: pip install distributed)") from None
    try:
        client = Client(address, timeout=10)
    except (OSError, TimeoutError) as e:
        raise ConfigError(f"--cluster ({address}) must be a reachable Dask scheduler address "
                          f"(tcp://host:8786): {e}") from None
    try:
        futs = client.map(fn, items, pure=False)
        index = {f.key: i for i, f in enumerate(futs)}
        for f in as_completed(futs):
            i = index[f.key]
            out[i] = f.result()
            tick(i)
    finally:
        client.close()
    return out


__all__ = ["check_jobs", "run_points"]
