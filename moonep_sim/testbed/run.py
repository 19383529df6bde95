"""Run real gloo jobs across the emulated nodes: one ``torchrun`` per node namespace, ranks bound to
the node's shaped interface, and a guaranteed teardown.

Each node ``i`` runs::

    ip netns exec msim<pid>n<i> python -m torch.distributed.run --nnodes N --node-rank i \\
        --nproc-per-node G --master-addr 10.213.0.1 --master-port 29500 -m MODULE ARGS...

with ``GLOO_SOCKET_IFNAME=eth0`` (gloo's pairs use the node's veth address: ranks of one node talk
over that namespace's unshaped loopback path, ranks of different nodes cross the shaped links) and
``OMP_NUM_THREADS=1``. Rendezvous is torchrun's static one (a TCP store on node 0) rather than
``c10d``: it honours ``--node-rank``, so global ranks ``i*G .. i*G+G-1`` live on node ``i``, which is
what the simulator's topology assumes (with ``c10d`` node ranks follow arrival order).

Teardown is unconditional: ``try/finally`` around the run, SIGTERM/SIGHUP turned into an exit that
runs the ``finally`` (Ctrl-C already raises), every ``torchrun`` in its own process group (killed
as a group), and finally every process still inside the namespaces is killed before they are
deleted. A run killed outright (SIGKILL) cannot tear down, but its jobs still die with it: each
node's job runs in its own PID namespace whose root is killed when the testbed process dies
(``unshare --pid --kill-child`` under a parent-death signal), and the kernel then kills the rest.
``moonep-sim testbed cleanup`` removes the namespaces and temporary folders such a run left.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

from moonep_sim.errors import CommError, require
from moonep_sim.testbed.netns import JOB_PREFIX, NODE_IFNAME, Testbed, TestbedSpec, die_with_parent

REPLAY_MODULE = "moonep_sim.experiments.ranks.replay_rank"
PROBE_MODULE = "moonep_sim.testbed.probe"
# variables that would make a worker join some other job's process group
_SCRUB_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
              "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")


@dataclass(frozen=True)
class LaunchSpec:
    """What each node runs. module: the Python module torchrun starts on every rank, with
    ``module_args``. master_port: the static rendezvous port on node 0. timeout_s: the whole job's
    limit (then every node is killed and the run fails)."""

    gpus_per_node: int
    module: str = REPLAY_MODULE
    module_args: tuple[str, ...] = ()
    master_port: int = 29500
    timeout_s: float = 900.0
    python: str = field(default_factory=lambda: sys.executable)

    def __post_init__(self):
        require(1 <= self.gpus_per_node <= 64, f"--gpus-per-node ({self.gpus_per_node}) must be in [1, 64]")
        require(1024 <= self.master_port <= 65535, f"master_port ({self.master_port}) must be in [1024, 65535]")
        require(self.timeout_s > 0, f"--timeout ({self.timeout_s}) must be > 0 seconds")


def torchrun_command(tb: TestbedSpec, launch: LaunchSpec, node: int) -> list[str]:
    """The command that starts node ``node``'s ranks inside its namespace (pure)."""
    require(0 <= node < tb.nodes, f"node ({node}) must be in [0, {tb.nodes})")
    return ["ip", "netns", "exec", tb.ns(node), *JOB_PREFIX, launch.python, "-m", "torch.distributed.run",
            "--nnodes", str(tb.nodes), "--node-rank", str(node), "--nproc-per-node", str(launch.gpus_per_node),
            "--master-addr", tb.ip(0), "--master-port", str(launch.master_port),
            "--max-restarts", "0", "--monitor-interval", "0.2",
            "-m", launch.module, *launch.module_args]


def node_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of each node's torchrun: gloo bound to the node's interface, one thread."""
    env = dict(os.environ if base is None else base)
    for k in _SCRUB_ENV:
        env.pop(k, None)
    env.update({"GLOO_SOCKET_IFNAME": NODE_IFNAME, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into ``SystemExit(128 + signum)`` so ``finally`` blocks run (SIGINT
    already raises KeyboardInterrupt). Only in the main thread; restores the old handlers."""
    import threading
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])


def _error_line(path: Path) -> str:
    """The most telling line of a failed node's log: its last '...Error: ...' line, else the last."""
    lines = [ln.strip() for ln in _tail(path, 200).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error:" in ln.lower() or "Error:" in ln or "Exception" in ln:
            return ln
    return lines[-1] if lines else "no output"


def _kill_group(p: subprocess.Popen, grace_s: float = 3.0) -> None:
    if p.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            p.wait(timeout=grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def launch_nodes(tb: Testbed, launch: LaunchSpec, log_dir: Path) -> float:
    """Start every node's torchrun, wait for all; return the wall time in seconds.

    A node failing (non-zero exit) or the timeout kills every node and raises CommError naming the
    node and the error line from its log (``log_dir/node<i>.log`` keeps the full output)."""
    procs: list[subprocess.Popen] = []
    logs: list[Path] = []
    env = node_env()
    t0 = time.perf_counter()
    try:
        for i in range(tb.spec.nodes):
            log = log_dir / f"node{i}.log"
            logs.append(log)
            with open(log, "wb") as fh:
                procs.append(subprocess.Popen(torchrun_command(tb.spec, launch, i), env=env, stdout=fh,
                                              stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                              start_new_session=True, preexec_fn=die_with_parent))
        deadline = t0 + launch.timeout_s
        while True:
            codes = [p.poll() for p in procs]
            bad = [i for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                i = bad[0]
                raise CommError(f"testbed node {i} ({tb.spec.ns(i)}) must exit 0, exited {codes[i]}: "
                                f"{_error_line(logs[i])} (log: {logs[i]})")
            if all(c == 0 for c in codes):
                return time.perf_counter() - t0
            if time.perf_counter() > deadline:
                raise CommError(f"testbed job must finish within --timeout {launch.timeout_s:g} s: "
                                f"nodes {[i for i, c in enumerate(codes) if c is None]} still running "
                                f"(logs: {log_dir})")
            time.sleep(0.05)
    finally:
        for p in procs:
            _kill_group(p)


# ---------------------------------------------------------------- link measurements


def measure_tcp(tb: Testbed, src: int, dst: int, nbytes: int = 8 << 20, port: int = 5201,
                pings: int = 50, timeout_s: float = 120.0) -> dict:
    """A plain TCP bulk transfer and a 1-byte ping-pong from node ``src`` to node ``dst``.

    Returns ``{"src", "dst", "bytes", "seconds", "bits_per_s", "rtt_us_median", "rtt_us_min"}``;
    ``bits_per_s`` counts payload (the tbf rate counts wire bytes, about 4% more)."""
    spec = tb.spec
    py = [sys.executable, "-m", PROBE_MODULE]
    sink = subprocess.Popen(tb.exec_prefix(dst) + py + ["tcp-sink", "--bind", spec.ip(dst), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=die_with_parent)
    try:
        line = sink.stdout.readline().strip()  # the sink prints 'ready' once listening, or exits
        if line != "ready":
            _kill_group(sink)
            raise CommError(f"tcp probe sink on node {dst} must start: {sink.stderr.read().strip()[-300:]}")
        snd = subprocess.run(tb.exec_prefix(src) + py + ["tcp-send", "--to", spec.ip(dst), "--port", str(port),
                                                         "--bytes", str(nbytes), "--pings", str(pings)],
                             capture_output=True, text=True, timeout=timeout_s, preexec_fn=die_with_parent)
        require(snd.returncode == 0, f"tcp probe from node {src} to node {dst} must succeed: "
                                     f"{snd.stderr.strip()[-300:]}", CommError)
        out, _err = sink.communicate(timeout=timeout_s)
        res = {"src": src, "dst": dst, **json.loads(out.strip().splitlines()[-1]), **json.loads(snd.stdout)}
        return res
    except subprocess.TimeoutExpired:
        raise CommError(f"tcp probe from node {src} to node {dst} must finish within {timeout_s:g} s") from None
    finally:
        _kill_group(sink)


def measure_gloo(tb: Testbed, gpus_per_node: int, log_dir: Path, mbytes: float = 4.0, reps: int = 3,
                 master_port: int = 29510) -> dict:
    """gloo across the nodes: p2p round trip and bandwidth (rank 0 <-> first rank of the last node)
    and an all-to-all; see :func:`moonep_sim.testbed.probe.gloo_probe`."""
    out = log_dir / "gloo_probe.json"
    launch = LaunchSpec(gpus_per_node, PROBE_MODULE, ("gloo", "--json", str(out), "--mbytes", str(mbytes),
                                                      "--reps", str(reps)), master_port, timeout_s=300)
    launch_nodes(tb, launch, log_dir)
    return json.loads(out.read_text())


# ---------------------------------------------------------------- the whole run


@dataclass
class TestbedRun:
    """What :func:`run_testbed` returns (and the CLI prints as JSON)."""

    __test__ = False

    testbed: dict
    probes: dict
    replay: dict | None
    wall_s: float
    topology_path: str | None = None
    logs: str | None = None

    def to_dict(self) -> dict:
        return {"testbed": self.testbed, "probes": self.probes, "replay": self.replay, "wall_s": self.wall_s,
                "topology": self.topology_path, "logs": self.logs}


def describe(spec: TestbedSpec, gpus_per_node: int) -> dict:
    return {"nodes": spec.nodes, "gpus_per_node": gpus_per_node, "prefix": spec.prefix,
            "rate_bps": spec.rate_bps, "node_rate_bps": {str(i): spec.node_rate(i) for i in range(spec.nodes)},
            "shape_ingress": spec.shape_ingress,
            "tbf": {str(i): {"rate_bps": spec.shape(i).rate_bps, "burst_bytes": spec.shape(i).burst_bytes,
                             "latency_ms": spec.shape(i).latency_ms} for i in range(spec.nodes)},
            "addresses": {spec.ns(i): spec.ip(i) for i in range(spec.nodes)}}


def run_testbed(spec: TestbedSpec, launch: LaunchSpec | None, *, probe_tcp: bool = True,
                probe_gloo: bool = False, keep_logs: bool = False, topology_out: str | None = None,
                topology_base: str | None = None, log_dir: str | None = None,
                on_ready=None, gpus_per_node: int | None = None) -> TestbedRun:
    """Build the testbed, probe the links, run ``launch`` (a replay) across the nodes, write the
    matching simulator topology, tear everything down. ``launch=None`` only probes.

    The replay's JSON is read from the path its ``--json`` argument names (``launch.module_args``)."""
    t0 = time.perf_counter()
    tmp = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix=f"{spec.prefix}-"))
    tmp.mkdir(parents=True, exist_ok=True)
    gpn = launch.gpus_per_node if launch else (gpus_per_node or 1)
    probes: dict = {}
    replay = None
    topo_path = None
    ok = False
    with signals_raise(), Testbed(spec) as tb:
        try:
            if on_ready:
                on_ready(tb)
            if probe_tcp and spec.nodes > 1:
                probes["tcp"] = [measure_tcp(tb, 0, spec.nodes - 1)]
                slow = sorted(spec.node_rate_bps)
                probes["tcp"] += [measure_tcp(tb, (i + 1) % spec.nodes, i) for i in slow if i != spec.nodes - 1]
            if probe_gloo and spec.nodes > 1:
                probes["gloo"] = measure_gloo(tb, gpn, tmp)
            if launch is not None:
                launch_nodes(tb, launch, tmp)
                json_path = _json_arg(launch.module_args)
                if json_path is not None:
                    require(Path(json_path).is_file(), f"replay JSON ({json_path}) must be written by the "
                                                       f"replay: it is missing (logs: {tmp})", CommError)
                    replay = json.loads(Path(json_path).read_text())
            probes["qdisc"] = tb.qdisc_stats()
            ok = True
        finally:
            if ok and not keep_logs and not log_dir:
                for f in tmp.iterdir():
                    f.unlink()
                tmp.rmdir()
    if topology_out:
        from moonep_sim.testbed.topology import write_topology
        topo_path = str(write_topology(topology_out, spec, gpn, probes, base=topology_base))
    return TestbedRun(describe(spec, gpn), probes, replay, time.perf_counter() - t0, topo_path,
                      str(tmp) if (keep_logs or not ok or log_dir) else None)


def _json_arg(args: Sequence[str]) -> str | None:
    for i, a in enumerate(args):
        if a == "--json" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--json="):
            return a.split("=", 1)[1]
    return None
