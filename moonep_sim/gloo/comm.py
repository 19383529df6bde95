"""The EP group's transport for the gloo executor: scope subgroups and timed collectives whose
failures name the phase, this rank and the culprit.

Every collective is issued asynchronously and waited on with the group's timeout; a failed or
timed-out one raises :class:`~moonep_sim.errors.CommError` naming the phase (``dispatch.0``,
``combine.1``, ``prefetch``, ...), this rank, and first of all the peer whose heartbeat stopped,
else the peers that had not reached the phase (``moonep_sim.gloo.liveness``).
"""

from __future__ import annotations

import datetime
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from moonep_sim.gloo.liveness import PhaseTracker


class GroupComm:
    """Collectives over one EP process group (gloo) with the Buffer's timeout.

    group: the EP process group (None = the default group); its ranks are EP ranks 0..R-1 in
    ascending global rank order.  timeout_s: limit on every collective (seconds).
    Failures are named by a :class:`~moonep_sim.gloo.liveness.PhaseTracker` (progress records and
    heartbeats in the store).
    """

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.group = group if group is not None else dist.group.WORLD
        self.members = list(dist.get_process_group_ranks(self.group))
        self.world_size = len(self.members)
        self.rank = dist.get_rank(self.group)
        self.timeout_s = float(timeout_s)
        self.timeout = datetime.timedelta(seconds=self.timeout_s)
        self.scopes: dict[str, Any] = {}
        # progress records and heartbeats in the store: a failure names the silent peer
        self.tracker = PhaseTracker(f"moonep_sim/ep{self.members[0]}x{self.world_size}/", self.rank, self.members,
                                    self.timeout_s)

    # -- groups -------------------------------------------------------------------------------
    def _new_group(self, ep_ranks: Sequence[int]):
        return dist.new_group([self.members[r] for r in ep_ranks], timeout=self.timeout, backend="gloo")

    def make_scopes(self, gpus_per_node: int) -> None:
        """Process groups with this timeout: global, this rank's node, this rank's rail.

        ``dist.new_group`` is collective over the default group: every rank creates every group, in
        the same order (nodes ascending, then local indices ascending). A scope whose group has one
        member is executed locally (None).
        """
        R, G = self.world_size, gpus_per_node
        glob = self._new_group(range(R)) if R > 1 else None

        def mine(groups: list[list[int]]):
            """Every group of the partition created in order; this rank's (glob when it is all)."""
            out = None
            for ranks in groups:
                g = glob if len(ranks) == R else self._new_group(ranks) if len(ranks) > 1 else None
                if self.rank in ranks:
                    out = g
            return out

        intra = mine([list(range(n * G, (n + 1) * G)) for n in range(R // G)])
        inter = mine([list(range(loc, R, G)) for loc in range(G)])
        self.scopes = {"global": glob, "intra_node": intra, "inter_node": inter}

    # -- failure handling (moonep_sim.gloo.liveness: tracker.run issues one operation and waits for it
    # with the timeout; a failure raises a CommError naming the phase, the op, this rank and the culprit)
    def mark(self, phase: str) -> None:
        """Record that this rank enters a phase (read by a peer that fails)."""
        self.tracker.mark(phase)

    # -- collectives --------------------------------------------------------------------------
    def all_gather(self, phase: str, t: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape everywhere), in EP rank order."""
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self.tracker.run(phase, "all_gather",
                         lambda: dist.all_gather(out, t, group=group or self.group, async_op=True), range(self.world_size))
        return out

    def all_to_all(self, phase: str, scope: str, members: Sequence[int], send: torch.Tensor,
                   send_splits: Sequence[int], recv_splits: Sequence[int],
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``send`` split per member -> rows received, grouped by member (``all_to_all_single``)."""
        self.mark(phase)
        group = self.scopes[scope] if len(members) > 1 else None
        if group is None:  # a one-member scope: the only message is to oneself
            return send
        send = send.contiguous()
        if out is None or out.data_ptr() == send.data_ptr():
            out = send.new_empty((int(sum(recv_splits)),) + tuple(send.shape[1:]))
        self.tracker.run(phase, "all_to_all", lambda: dist.all_to_all_single(
            out, send, list(recv_splits), list(send_splits), group=group, async_op=True), members)
        return out

    def p2p(self, phase: str, scope: str, ops: Sequence[tuple[Any, Any, int, int]],
            local: Callable[[], None] | None = None) -> None:
        """Issue every ``(op, tensor, ep_peer, tag)`` (``send`` / ``recv``; an ``op`` that is a
        callable is local work run at that point, e.g. filling the next send), run ``local``
        meanwhile, then wait for each with the timeout."""
        self.mark(phase)
        group = self.scopes[scope]
        works: list[tuple[Any, int]] = []
        members = range(self.world_size) if scope == "global" else \
            sorted({o[2] for o in ops if not callable(o[0])} | {self.rank})
        # a failed message names its peer when that peer is behind (else every member is checked:
        # the peer may have exited after a failure of its own)
        for op, t, p, tag in ops:
            if callable(op):  # local work between messages (e.g. filling the next send)
                op()
                continue
            fn = dist.isend if op == "send" else dist.irecv
            self.tracker.run(phase, "send/recv", lambda fn=fn, t=t, p=p, tag=tag: works.append(
                (fn(t, self.members[p], group=group, tag=tag), p)), members, p)
        if local is not None:
            local()
        for w, p in works:
            self.tracker.run(phase, "send/recv", lambda w=w: w, members, p)


__all__ = ["GroupComm"]
