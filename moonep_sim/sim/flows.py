"""The network's transfers as named columns: waiting for their latency (:class:`Pending`),
transferring (:class:`ActiveFlows`) and finished (:class:`FlowLog`, one row per transfer).

Notation: F transfers (flows), R ranks, L = ``moonep_sim.sim.ports.L_PATH``. Units: bytes,
microseconds, bytes per microsecond. The tick loop that moves flows between them:
``moonep_sim.sim.network``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True)
class Pending:
    """Flows submitted together and waiting for their path latency, one entry per flow [F].

    ready: when each becomes ready (us).  eff: the bytes it is timed for (bytes x jitter).
    id: its flow id (row of the :class:`FlowLog`).  key: its receive group (phase id x R + dst).
    src, dst: sender and receiver rank.  blk: its block (``moonep_sim.sim.ports.Block``, + the SM
    offset).  path: int64 [F, L] ports, only for the per-flow solver (else None).
    """

    ready: np.ndarray
    eff: np.ndarray
    id: np.ndarray
    key: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    blk: np.ndarray
    path: np.ndarray | None = None

    def select(self, mask: np.ndarray) -> "Pending":
        """The flows where ``mask`` is True."""
        return Pending(*(None if v is None else v[mask] for v in self._values()))

    def _values(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))

    @staticmethod
    def concat(batches: list["Pending"]) -> "Pending":
        """One batch of the flows of ``batches`` (in order)."""
        cols = zip(*(b._values() for b in batches))
        return Pending(*(None if vs[0] is None else np.concatenate(vs) for vs in cols))


class _Column:
    """One column of :class:`ActiveFlows` and its dtype: reading it gives the slots in use,
    ``data[name][:n]`` (a view: assigning into it updates the column)."""

    def __init__(self, dtype=np.int64) -> None:
        self.dtype = dtype

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None) -> np.ndarray:
        return obj.data[self.name][:obj.n]


class ActiveFlows:
    """Growable columns of the flows transferring now: slots [0, n) are in use; a finished flow
    stays in its slot (``alive`` False, rate 0 at the sentinel node) until :meth:`keep` drops the
    dead slots in bulk.

    rate: bytes/us now.  rem0: bytes left at ``t0``.  t0: when the rate was last set.  fin: when
    it ends at that rate (inf: not rated yet, or dead).  id: its flow id.  key: its receive group
    (phase id x R + dst).  src, dst: ranks.  blk: its block.  alive: still transferring.
    ns, nd: its sender and receiver node of the block solver (block x R + rank).  path: int64
    [n, L] ports (only with ``with_path``: the per-flow solver).
    """

    rate = _Column(np.float64)
    rem0 = _Column(np.float64)
    t0 = _Column(np.float64)
    fin = _Column(np.float64)
    id = _Column()
    key = _Column()
    src = _Column()
    dst = _Column()
    blk = _Column()
    alive = _Column(np.bool_)
    ns = _Column()
    nd = _Column()
    path = _Column()  # [n, path_len]: only with ``with_path``

    def __init__(self, with_path: bool, path_len: int):
        cols = [c for c in vars(type(self)).values() if isinstance(c, _Column) and (with_path or c.name != "path")]
        self.n = 0
        self.data = {c.name: np.zeros((16, path_len) if c.name == "path" else 16, dtype=c.dtype) for c in cols}

    def append(self, **vals: np.ndarray) -> None:
        """Add flows: one array per column, all of the same length."""
        m = next(iter(vals.values())).shape[0]
        need = self.n + m
        cap = next(iter(self.data.values())).shape[0]
        if need > cap:
            new = max(need, 2 * cap)
            for k, arr in self.data.items():
                grown = np.zeros((new,) + arr.shape[1:], dtype=arr.dtype)
                grown[:self.n] = arr[:self.n]
                self.data[k] = grown
        for k, v in vals.items():
            self.data[k][self.n:need] = v
        self.n = need

    def keep(self, mask: np.ndarray) -> None:
        """Keep the slots where ``mask`` [n] is True, in order."""
        m = int(mask.sum())
        for arr in self.data.values():
            arr[:m] = arr[:self.n][mask]
        self.n = m


class FlowLog:
    """Every submitted flow, by id: sender, receiver, phase id, bytes and submit time, appended
    per batch, plus when it became ready, ended and its bottleneck port (filled as it happens)."""

    def __init__(self) -> None:
        self._src: list[np.ndarray] = []
        self._dst: list[np.ndarray] = []
        self._phase: list[np.ndarray] = []
        self._bytes: list[np.ndarray] = []
        self._start: list[np.ndarray] = []
        self.n = 0
        self.end = np.zeros(0)
        self.bneck = np.zeros(0, dtype=np.int64)
        self.ready = np.zeros(0)

    def add(self, src_F: np.ndarray, dst_F: np.ndarray, pid: int, bytes_F: np.ndarray, now: float) -> np.ndarray:
        """Log a batch of flows submitted at ``now``; returns their ids."""
        m = dst_F.size
        ids = np.arange(self.n, self.n + m)
        self.n += m
        self._src.append(src_F)
        self._dst.append(dst_F)
        self._phase.append(np.full(m, pid, dtype=np.int64))
        self._bytes.append(bytes_F)
        self._start.append(np.full(m, now))
        return ids

    def grow(self) -> None:
        """Make room in ``end``, ``bneck`` and ``ready`` for every logged id."""
        n = self.n
        if self.end.size < n:
            extra = max(n - self.end.size, self.end.size)
            self.end = np.concatenate([self.end, np.full(extra, np.nan)])
            self.bneck = np.concatenate([self.bneck, np.full(extra, -1, dtype=np.int64)])
            self.ready = np.concatenate([self.ready, np.full(extra, np.nan)])

    def records(self) -> dict[str, np.ndarray]:
        """Per flow: src, dst, phase id, bytes, start (submit), ready, end, bottleneck port."""
        n = self.n
        cat = (lambda xs, dt: np.concatenate(xs) if xs else np.zeros(0, dt))
        return dict(src=cat(self._src, np.int64), dst=cat(self._dst, np.int64),
                    phase=cat(self._phase, np.int64), bytes=cat(self._bytes, np.float64),
                    start=cat(self._start, np.float64), ready=self.ready[:n].copy(),
                    end=self.end[:n].copy(), bneck=self.bneck[:n].copy())


__all__ = ["ActiveFlows", "FlowLog", "Pending"]
