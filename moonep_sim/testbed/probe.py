"""Measure what a testbed link delivers: TCP bandwidth and round-trip time between two namespaces,
and what gloo itself sees across nodes (point-to-point and all-to-all), under ``torchrun``.

Run inside namespaces by :mod:`moonep_sim.testbed.run`; three entry points::

    python -m moonep_sim.testbed.probe tcp-sink  --bind IP --port P     # prints 'ready', then JSON
    python -m moonep_sim.testbed.probe tcp-send  --to IP --port P --bytes N [--pings K]
    torchrun ... -m moonep_sim.testbed.probe gloo --json OUT [--mbytes M]

Bandwidth is payload bytes over the receiver's time from first byte to end of stream (so the
connect handshake is excluded), in bits per second to compare with the tbf rate (which counts
bytes on the wire, Ethernet/IP/TCP headers included: about 3-5% more than payload).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

_CHUNK = 1 << 20


def tcp_sink(bind: str, port: int) -> dict:
    """Accept one connection for pings (echo) and one for bulk data; report the bulk rate."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind, port))
    srv.listen(2)
    print("ready", flush=True)
    out: dict = {}
    for _ in range(2):
        conn, _addr = srv.accept()
        with conn:
            kind = conn.recv(1)
            if kind == b"p":  # ping-pong: echo 1-byte messages until EOF
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while (b := conn.recv(1)):
                    conn.sendall(b)
            else:
                buf = bytearray(_CHUNK)
                view = memoryview(buf)
                n = conn.recv_into(view)
                t0 = time.perf_counter()
                total = 0
                while True:
                    k = conn.recv_into(view)
                    if not k:
                        break
                    total += k
                dt = time.perf_counter() - t0
                out = {"bytes": total, "seconds": dt, "bits_per_s": 8 * total / dt if dt > 0 else 0.0,
                       "first_read_bytes": n}
    srv.close()
    return out


def tcp_send(to: str, port: int, nbytes: int, pings: int) -> dict:
    rtts = []
    with socket.create_connection((to, port), timeout=30) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.sendall(b"p")
        for _ in range(pings):
            t0 = time.perf_counter()
            c.sendall(b"x")
            c.recv(1)
            rtts.append(time.perf_counter() - t0)
    payload = bytes(_CHUNK)
    with socket.create_connection((to, port), timeout=30) as c:
        c.sendall(b"d" + payload[:1])  # kind + first byte starts the receiver's clock
        left = nbytes
        while left > 0:
            k = min(left, _CHUNK)
            c.sendall(payload[:k])
            left -= k
    rtts.sort()
    return {"rtt_us_median": 1e6 * rtts[len(rtts) // 2] if rtts else None,
            "rtt_us_min": 1e6 * rtts[0] if rtts else None}


def gloo_probe(json_out: str | None, mbytes: float, reps: int) -> dict:
    """Across nodes under torchrun: (1) ping-pong of a 4-byte tensor between rank 0 and the first
    rank of the last node; (2) a one-way transfer of ``mbytes`` between them; (3) an all-to-all of
    ``mbytes`` per rank (split evenly over ranks) on all ranks; (4) with two nodes, a rail
    exchange: every rank sends its uniform all-to-all's off-node bytes to its one peer on the
    other node (hierarchical's inter-node hop: G flows per node link and direction instead of
    G x G). Reports medians over ``reps``."""
    from statistics import median_high as median   # the upper middle of an even count, as reported

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = world // local
    peer = (nodes - 1) * local  # first rank of the last node
    res: dict = {"world_size": world, "nodes": nodes, "gpus_per_node": local}
    small = torch.zeros(1, dtype=torch.float32)
    big = torch.zeros(int(mbytes * 2**20) // 4, dtype=torch.float32)

    if nodes > 1:
        rtt, one_way = [], []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(small, peer)
                dist.recv(small, peer)
            elif rank == peer:
                dist.recv(small, 0)
                dist.send(small, 0)
            rtt.append(time.perf_counter() - t0)
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(big, peer)
                dist.recv(small, peer)  # ack: the data has fully arrived
            elif rank == peer:
                dist.recv(big, 0)
                dist.send(small, 0)
            one_way.append(time.perf_counter() - t0)
        if rank == 0:
            res["p2p_rtt_us"] = 1e6 * median(rtt[1:])
            res["p2p_seconds"] = median(one_way[1:])
            res["p2p_bits_per_s"] = 8 * big.numel() * 4 / res["p2p_seconds"]
    # all-to-all: each rank sends mbytes split evenly over all ranks
    n = (big.numel() // world) * world
    send, recv = big[:n].clone(), torch.empty(n)
    times = []
    for i in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(recv, send)
        times.append(time.perf_counter() - t0)
    t_all = torch.tensor([median(times[1:])])
    dist.all_reduce(t_all, op=dist.ReduceOp.MAX)
    if rank == 0:
        res["a2a_seconds"] = float(t_all)
        # bytes each node sends off-node: local ranks * (remote ranks / world) * per-rank bytes
        off_node_bytes = local * (world - local) / world * n * 4
        res["a2a_node_off_bytes"] = off_node_bytes
        res["a2a_node_bits_per_s"] = 8 * off_node_bytes / float(t_all) if nodes > 1 else None
    if nodes == 2:  # rail exchange: the same off-node bytes per node, one remote peer per rank
        m = (n // world) * local  # elements to the rail peer (= what the all-to-all sent off-node)
        peer_r = (rank + local) % world
        splits = [m if r == peer_r else 0 for r in range(world)]
        send_r, recv_r = big[:m].clone(), torch.empty(m)
        times = []
        for i in range(reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_to_all_single(recv_r, send_r, splits, splits)
            times.append(time.perf_counter() - t0)
        t_rail = torch.tensor([median(times[1:])])
        dist.all_reduce(t_rail, op=dist.ReduceOp.MAX)
        if rank == 0:
            res["rail_seconds"] = float(t_rail)
            res["rail_node_bits_per_s"] = 8 * local * m * 4 / float(t_rail)
    if rank == 0 and json_out:
        from moonep_sim.io import write_text_atomic
        write_text_atomic(json_out, json.dumps(res, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m moonep_sim.testbed.probe")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("tcp-sink")
    s.add_argument("--bind", required=True)
    s.add_argument("--port", type=int, required=True)
    c = sub.add_parser("tcp-send")
    c.add_argument("--to", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--bytes", type=int, default=32 << 20)
    c.add_argument("--pings", type=int, default=50)
    g = sub.add_parser("gloo")
    g.add_argument("--json", default=None)
    g.add_argument("--mbytes", type=float, default=8.0)
    g.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    if a.cmd == "tcp-sink":
        print(json.dumps(tcp_sink(a.bind, a.port)), flush=True)
    elif a.cmd == "tcp-send":
        print(json.dumps(tcp_send(a.to, a.port, a.bytes, a.pings)), flush=True)
    else:
        gloo_probe(a.json, a.mbytes, a.reps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
