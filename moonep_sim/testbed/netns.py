"""Emulated nodes on one Linux machine: network namespaces, veth links into a bridge, ``tbf`` shaping.

Layout (N nodes, names carry a unique prefix ``msim<pid>`` so concurrent testbeds never collide)::

    namespace msim<pid>h  (the hub: a bridge, no address, no route anywhere)
        br0 -- n0 -- veth -- eth0 in namespace msim<pid>n0  10.213.0.1/24
            \\- n1 -- veth -- eth0 in namespace msim<pid>n1  10.213.0.2/24   ...

Nothing is created in the caller's (root) namespace: the bridge lives in its own hub namespace and
both ends of each veth pair are created directly inside namespaces, so the host's links, addresses
and routes are never touched. Deleting the namespaces deletes every link of the testbed with them.
The private subnet (``10.213.0.0/24`` by default) exists only inside these namespaces; they have no
default route, so nothing can leave them.

Shaping: each node's link is a token bucket (``tbf``) in both directions, like a NIC with a
bandwidth per direction: the node's egress on ``eth0`` (what it sends) and the hub-side ``n<i>``
egress (what it receives). Ranks of one node talk over the namespace's own loopback path, which is
not shaped -- that is the node's "intra-node" fabric.

tbf parameters (see :class:`LinkShape`): ``rate`` is the link rate; ``burst`` (bucket size) is
``max(128 KiB, rate * 1 ms)``, large enough that a 64 KiB GSO segment passes unsplit and that
the kernel timer granularity does not cap the rate, small enough (a few ms of line rate at most)
that multi-MB transfers see the rate; ``latency`` (queue bound) is 100 ms: deep enough that many
concurrent TCP flows into one node rarely overflow the queue (drops would add retransmission
stalls that no simulator models), which matters more here than queueing delay.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from moonep_sim.errors import CommError, require
from moonep_sim.io import pid_alive

PROJECT_PREFIX = "msim"
NODE_IFNAME = "eth0"  # the node-side end of its veth, inside the node's namespace
BRIDGE = "br0"
DEFAULT_SUBNET = "10.213.0"  # /24, used only inside namespaces the testbed creates
_NAME_RE = re.compile(rf"^{PROJECT_PREFIX}(\d+)(h|n\d+)$")

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


def parse_rate(text: str, what: str = "--bandwidth") -> int:
    """``"1gbit"``, ``"200mbit"``, ``"500kbit"``, ``"1e9bit"`` -> bits per second (int > 0)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]+)\s*", str(text).lower())
    require(m is not None and m.group(2) in _RATE_UNITS,
            f"{what} ({text!r}) must be a rate like 200mbit or 1gbit (units: {', '.join(_RATE_UNITS)})")
    bps = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    require(10**5 <= bps <= 10**11, f"{what} ({text!r}) must be between 100kbit and 100gbit")
    return bps


def parse_node_rates(items: Sequence[str] | None, nodes: int) -> dict[int, int]:
    """``["1:200mbit", "3:50mbit"]`` -> ``{1: 200_000_000, 3: 50_000_000}`` (per-node overrides)."""
    out: dict[int, int] = {}
    for it in items or []:
        node, sep, rate = str(it).partition(":")
        require(sep == ":" and node.strip().isdigit(),
                f"--node-bandwidth ({it!r}) must look like NODE:RATE, e.g. 1:200mbit")
        i = int(node)
        require(0 <= i < nodes, f"--node-bandwidth node ({i}) must be in [0, {nodes}) (--nodes {nodes})")
        out[i] = parse_rate(rate, f"--node-bandwidth {i}")
    return out


def format_rate(bps: int) -> str:
    for unit, mult in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps % mult == 0:
            return f"{bps // mult}{unit}"
    return f"{bps}bit"


@dataclass(frozen=True)
class LinkShape:
    """One direction of one node's link: a tbf token bucket.

    rate_bps: bits per second. burst_bytes: bucket size. latency_ms: longest a packet may queue.
    """

    rate_bps: int
    burst_bytes: int
    latency_ms: float

    @classmethod
    def for_rate(cls, rate_bps: int, latency_ms: float = 100.0) -> "LinkShape":
        return cls(rate_bps, max(128 * 1024, rate_bps // 8 // 1000), latency_ms)

    def tc_args(self) -> list[str]:
        return ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes),
                "latency", f"{self.latency_ms:g}ms"]


@dataclass(frozen=True)
class TestbedSpec:
    """N emulated nodes and their links.

    nodes: N >= 1. rate_bps: every node's link rate per direction. node_rate_bps: per-node overrides
    (a degraded NIC). tag: the unique part of the names (default: this process id). subnet: first three
    octets of the private /24. shape_ingress: also cap what a node receives (hub-side egress).
    """

    __test__ = False  # not a pytest class

    nodes: int
    rate_bps: int
    node_rate_bps: Mapping[int, int] = field(default_factory=dict)
    tag: int = field(default_factory=os.getpid)
    subnet: str = DEFAULT_SUBNET
    shape_ingress: bool = True
    latency_ms: float = 100.0

    def __post_init__(self):
        require(1 <= self.nodes <= 250, f"--nodes ({self.nodes}) must be in [1, 250]")
        require(re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", self.subnet) is not None,
                f"subnet ({self.subnet!r}) must be the first three octets of a 10.x.y.0/24 network")
        for i in self.node_rate_bps:
            require(0 <= i < self.nodes, f"node_rate_bps node ({i}) must be in [0, {self.nodes})")

    @property
    def prefix(self) -> str:
        return f"{PROJECT_PREFIX}{self.tag}"

    @property
    def hub(self) -> str:
        return f"{self.prefix}h"

    def ns(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def namespaces(self) -> list[str]:
        return [self.hub] + [self.ns(i) for i in range(self.nodes)]

    def ip(self, node: int) -> str:
        return f"{self.subnet}.{node + 1}"

    def node_rate(self, node: int) -> int:
        return int(self.node_rate_bps.get(node, self.rate_bps))

    def shape(self, node: int) -> LinkShape:
        return LinkShape.for_rate(self.node_rate(node), self.latency_ms)


def setup_commands(spec: TestbedSpec) -> list[list[str]]:
    """The ``ip``/``tc`` commands that build the testbed, in order (pure: nothing is run)."""
    cmds: list[list[str]] = [["ip", "netns", "add", ns] for ns in spec.namespaces()]
    hub = spec.hub
    cmds += [["ip", "-n", hub, "link", "set", "lo", "up"],
             ["ip", "-n", hub, "link", "add", BRIDGE, "type", "bridge"],
             ["ip", "-n", hub, "link", "set", BRIDGE, "up"]]
    for i in range(spec.nodes):
        ns, port = spec.ns(i), f"n{i}"
        cmds += [["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", NODE_IFNAME, "netns", ns],
                 ["ip", "-n", hub, "link", "set", port, "master", BRIDGE],
                 ["ip", "-n", hub, "link", "set", port, "up"],
                 ["ip", "-n", ns, "link", "set", "lo", "up"],
                 ["ip", "-n", ns, "addr", "add", f"{spec.ip(i)}/24", "dev", NODE_IFNAME],
                 ["ip", "-n", ns, "link", "set", NODE_IFNAME, "up"],
                 ["tc", "-n", ns, "qdisc", "replace", "dev", NODE_IFNAME, "root", *spec.shape(i).tc_args()]]
        if spec.shape_ingress:
            cmds.append(["tc", "-n", hub, "qdisc", "replace", "dev", port, "root", *spec.shape(i).tc_args()])
    return cmds


# ---------------------------------------------------------------- side effects below this line


def check_host() -> None:
    """Raise one clear ConfigError unless this process can build a testbed (root, ``ip``, ``tc``)."""
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    require(not missing, f"testbed tools ({', '.join(missing)}) must be installed (package iproute2): "
                         "the testbed builds network namespaces with ip and shapes links with tc")
    require(os.geteuid() == 0, f"testbed (uid {os.geteuid()}) must run as root: creating network namespaces "
                               "and tc qdiscs needs CAP_NET_ADMIN (try sudo)")


# a node's job runs in its own PID namespace: when its first process (the job's root) dies, the
# kernel kills every process of the namespace; ``--kill-child`` kills that root when ``unshare``
# dies, and ``die_with_parent`` kills ``unshare`` when the testbed process dies (even by SIGKILL)
JOB_PREFIX = ("unshare", "--pid", "--fork", "--kill-child=SIGKILL")

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for a job's process: SIGKILL it when the process that started it dies."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _run(cmd: Sequence[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise CommError(f"testbed command ({' '.join(cmd)}) must finish within {timeout_s:g} s: it hung") from None


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def project_namespaces(tag: int | None = None) -> list[str]:
    """Namespaces named like a testbed's (``msim<tag>h``, ``msim<tag>n<i>``); all tags if None."""
    return [ns for ns in list_namespaces() if (m := _NAME_RE.match(ns)) and (tag is None or int(m.group(1)) == tag)]


def namespace_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns]).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(namespaces: Sequence[str], grace_s: float = 3.0) -> list[int]:
    """SIGTERM every process inside the given (testbed) namespaces, SIGKILL what remains after
    ``grace_s``. Returns the pids signalled. Only processes living in these namespaces are touched:
    they were all started into them by a testbed."""
    pids = sorted({p for ns in namespaces for p in namespace_pids(ns)} - {os.getpid()})
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.05)
    for p in pids:
        if pid_alive(p):
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
    return pids


def delete_namespaces(namespaces: Sequence[str]) -> list[str]:
    """Kill what runs inside, then delete each namespace. Returns those that could not be deleted."""
    kill_namespace_processes(namespaces)
    failed = []
    for ns in namespaces:
        r = _run(["ip", "netns", "del", ns])
        if r.returncode != 0 and ns in list_namespaces():
            failed.append(ns)
    return failed


_FOLDER_RE = re.compile(rf"^{PROJECT_PREFIX}(\d+)-")


def project_folders(tag: int | None = None) -> list[Path]:
    """Temporary folders of testbed runs (``<tmp>/msim<tag>-*``: logs, replay outputs)."""
    return sorted(p for p in Path(tempfile.gettempdir()).iterdir() if (m := _FOLDER_RE.match(p.name))
                  and p.is_dir() and not p.is_symlink() and (tag is None or int(m.group(1)) == tag))


def cleanup_folders(all_tags: bool = False, tag: int | None = None) -> list[str]:
    """Remove testbed runs' temporary folders: those of ``tag``; else those whose owner process is
    gone (or every testbed's with ``all_tags``). Returns the folders removed."""
    found = project_folders(tag)
    if tag is None and not all_tags:
        found = [p for p in found if not pid_alive(int(_FOLDER_RE.match(p.name).group(1)))]
    for p in found:
        shutil.rmtree(p, ignore_errors=True)
    return [str(p) for p in found if not p.exists()]


def cleanup(all_tags: bool = False, tag: int | None = None) -> list[str]:
    """Remove leftover testbed namespaces: those of ``tag``; else those whose owner process is gone
    (or every testbed's with ``all_tags``). Returns the namespaces removed. (Folders:
    :func:`cleanup_folders`.)"""
    check_host()
    found = project_namespaces(tag)
    if tag is None and not all_tags:
        found = [ns for ns in found if not pid_alive(int(_NAME_RE.match(ns).group(1)))]
    failed = delete_namespaces(found)
    if failed:
        raise CommError(f"namespaces ({', '.join(failed)}) must be deletable: still present after ip netns del")
    return found


class Testbed:
    """Build the emulated nodes on ``__enter__``; tear everything down on ``__exit__`` -- whatever
    happened in between (an exception, Ctrl-C, a failed setup step half way).

    >>> with Testbed(TestbedSpec(nodes=2, rate_bps=200_000_000)) as tb:   # doctest: +SKIP
    ...     subprocess.run(tb.exec_prefix(0) + ["ping", "-c1", tb.spec.ip(1)])
    """

    def __init__(self, spec: TestbedSpec):
        self.spec = spec
        self._up = False

    def exec_prefix(self, node: int) -> list[str]:
        """Prefix a command with this to run it inside node ``node``'s namespace, as a job in its
        own PID namespace (start it with ``preexec_fn=die_with_parent`` so it dies with this process)."""
        return ["ip", "netns", "exec", self.spec.ns(node), *JOB_PREFIX]

    def up(self) -> "Testbed":
        check_host()
        clash = project_namespaces(self.spec.tag)
        require(not clash, f"testbed namespaces ({', '.join(clash)}) must not exist yet: "
                           "run `moonep-sim testbed cleanup` to remove leftovers")
        self._up = True  # from here on, down() must run whatever happens
        for cmd in setup_commands(self.spec):
            r = _run(cmd)
            if r.returncode != 0:
                msg = (r.stderr or r.stdout).strip().splitlines()
                raise CommError(f"testbed setup command ({' '.join(cmd)}) must succeed: "
                                f"{msg[-1] if msg else f'exit {r.returncode}'}")
        return self

    def down(self) -> None:
        if not self._up:
            return
        failed = delete_namespaces(project_namespaces(self.spec.tag))
        self._up = False
        if failed:
            raise CommError(f"namespaces ({', '.join(failed)}) must be deletable: still present after "
                            "ip netns del; run `moonep-sim testbed cleanup --all`")

    def qdisc_stats(self) -> dict[str, str]:
        """``tc -s qdisc`` of each node's egress and (if shaped) ingress, for the record."""
        out = {}
        for i in range(self.spec.nodes):
            out[f"n{i}.egress"] = _run(["tc", "-n", self.spec.ns(i), "-s", "qdisc", "show", "dev",
                                        NODE_IFNAME]).stdout.strip()
            if self.spec.shape_ingress:
                out[f"n{i}.ingress"] = _run(["tc", "-n", self.spec.hub, "-s", "qdisc", "show", "dev",
                                             f"n{i}"]).stdout.strip()
        return out

    def __enter__(self) -> "Testbed":
        try:
            return self.up()
        except BaseException:
            self.down()
            raise

    def __exit__(self, *exc) -> None:
        self.down()
