"""The command as a user runs it: time ``moonep-sim ARGS`` in a fresh process, for the benchmarks.

Every benchmark whose figure the docs quote also times the command a user types for the same
work (``python -m moonep_sim ARGS`` with this interpreter, a fresh process each run: imports,
parsing, checks, the work, the report), and prints that command, its figures and the ratio
command / in-process beside its own in-process figure. This module is the one place that does it.

Each run's wall seconds (``time.perf_counter`` around the child) and CPU seconds (user + sys of
that child alone and the processes it waited for, from ``os.wait4``'s rusage), its exit status and
output; over ``repeat`` runs the median and the least of each, and the 1-minute load average
before the first run and after the last (the machine may be shared).
"""

from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: the package's root: the child imports the package of this tree (as the benchmarks do)
REPO = Path(__file__).resolve().parents[1]


def command_text(argv: list[str]) -> str:
    """The command as a user types it (``moonep-sim`` and the arguments, shell-quoted)."""
    return "moonep-sim " + " ".join(shlex.quote(a) for a in argv)


def run_once(argv: list[str], env: dict | None = None, timeout_s: float | None = None) -> dict:
    """One run of ``moonep-sim argv`` in a fresh process: wall, user and sys seconds of that child
    (``os.wait4``), exit status, stdout and stderr (text)."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        p = subprocess.Popen([sys.executable, "-m", "moonep_sim", *argv], stdout=out, stderr=err, env=env)
        killer = None if timeout_s is None else threading.Timer(timeout_s, p.kill)  # the child past its time
        if killer:
            killer.start()
        try:
            _, status, ru = os.wait4(p.pid, 0)
        finally:
            if killer:
                killer.cancel()
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        return {"wall_s": wall, "user_s": ru.ru_utime, "sys_s": ru.ru_stime, "cpu_s": ru.ru_utime + ru.ru_stime,
                "returncode": p.returncode, "timed_out": timeout_s is not None and wall >= timeout_s,
                "stdout": out.read().decode(errors="replace"), "stderr": err.read().decode(errors="replace")}


def time_command(argv: list[str], repeat: int = 1, env: dict | None = None, timeout_s: float | None = None,
                 check: bool = True) -> dict:
    """``repeat`` fresh-process runs of ``moonep-sim argv``: the command's text, each run's figures
    (without its output), the median and least wall and CPU seconds, the load before and after, and
    the last run's stdout. ``check``: a run that fails raises ``RuntimeError`` naming the command."""
    if repeat < 1:
        raise ValueError(f"repeat ({repeat}) must be >= 1")
    load0 = os.getloadavg()[0]
    runs = []
    for _ in range(repeat):
        r = run_once(argv, env, timeout_s)
        if check and r["returncode"] != 0:
            raise RuntimeError(f"{command_text(argv)} failed (exit {r['returncode']}): "
                               f"{r['stderr'].strip()[-400:]}")
        runs.append(r)
    stdout = runs[-1]["stdout"]
    runs = [{k: v for k, v in r.items() if k not in ("stdout", "stderr")} for r in runs]
    walls, cpus = [r["wall_s"] for r in runs], [r["cpu_s"] for r in runs]
    return {"command": command_text(argv), "repeat": repeat, "runs": runs,
            "wall_s": statistics.median(walls), "wall_s_min": min(walls),
            "cpu_s": statistics.median(cpus), "cpu_s_min": min(cpus),
            "load_start": load0, "load_end": os.getloadavg()[0], "stdout": stdout}


def beside(cli: dict, wall_s: float, cpu_s: float, what: str = "in-process") -> dict:
    """The command's median figures beside an in-process figure: both, and command / in-process."""
    return {"cli_command": cli["command"], "cli_wall_s": cli["wall_s"], "cli_cpu_s": cli["cpu_s"],
            "inprocess_wall_s": wall_s, "inprocess_cpu_s": cpu_s, "inprocess": what,
            "cli_over_inprocess_wall": cli["wall_s"] / wall_s if wall_s > 0 else None,
            "cli_over_inprocess_cpu": cli["cpu_s"] / cpu_s if cpu_s > 0 else None,
            "cli_load": [cli["load_start"], cli["load_end"]]}


def report_line(row: dict) -> str:
    """One line for the terminal: the command, its figures, the in-process figures and the ratios."""
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    return (f"command: {row['cli_command']}\n  command {row['cli_wall_s']:.2f} s wall, {row['cli_cpu_s']:.2f} CPU s"
            f" | {row['inprocess']} {row['inprocess_wall_s']:.2f} s wall, {row['inprocess_cpu_s']:.2f} CPU s"
            f" | command / in-process: {ratio(row['cli_over_inprocess_wall'])} wall, "
            f"{ratio(row['cli_over_inprocess_cpu'])} CPU (load {row['cli_load'][0]:.1f} -> {row['cli_load'][1]:.1f})")
