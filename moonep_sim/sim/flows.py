"""The network's transfers as named columns: waiting for their latency (:class:`Pending`),
transferring (:class:`ActiveFlows`) and finished (:class:`FlowLog`, one row per transfer).

Notation: F transfers (flows), R ranks, L = ``moonep_sim.sim.ports.L_PATH``. Units: bytes,
microseconds, bytes per microsecond. The tick loop that moves flows between them:
``moonep_sim.sim.network``.
"""

from __future__ import annotations

import numpy as np


class _Column:
    """One column of a :class:`_Columns` table and its dtype (and the value of unwritten slots):
    reading it gives the slots in use, ``data[name][:n]`` (a view: assigning into it updates the
    column)."""

    def __init__(self, dtype=np.int64, empty=0) -> None:
        self.dtype = dtype
        self.empty = empty

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None) -> np.ndarray:
        return obj.data[self.name][:obj.n]


class _Columns:
    """Growable named columns: slots [0, n) are in use; ``data[name]`` the whole buffer (at
    least n slots; the compiled kernels write into it). The one-dimensional columns of one dtype
    and empty value are the rows of one buffer (:meth:`block`), in the order they are declared:
    a kernel takes the block once instead of each column."""

    def __init__(self, with_path: bool = False, path_len: int = 0, capacity: int = 16):
        self.n = 0
        self.capacity = capacity   # slots of every buffer in ``data``
        self._groups: dict[tuple, list[str]] = {}   # (dtype, empty, a slot's shape) -> its columns, in order
        for c in vars(type(self)).values():
            if isinstance(c, _Column) and (with_path or c.name != "path"):
                key = (c.dtype, c.empty, (path_len,) if c.name == "path" else ())
                self._groups.setdefault(key, []).append(c.name)
        self.data: dict[str, np.ndarray] = {}
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        """New buffers of ``capacity`` slots, slots [0, n) copied over from the old ones."""
        old, self.data, self._block = self.data, {}, {}
        for (dtype, empty, shape), names in self._groups.items():
            buf = np.full((len(names), capacity) + shape, empty, dtype=dtype)
            for name, row in zip(names, buf):
                if name in old:
                    row[:self.n] = old[name][:self.n]
                self.data[name], self._block[name] = row, buf

    def block(self, name: str) -> np.ndarray:
        """The buffer holding column ``name``: [columns, capacity], the columns of its dtype and
        empty value as rows in declaration order (``data[name]`` is its row)."""
        return self._block[name]

    def reserve(self, need: int) -> None:
        """Make room for ``need`` slots (at least doubling when growing; the buffers are then
        replaced); slots [0, n) are kept."""
        if need > self.capacity:
            self.capacity = max(need, 2 * self.capacity)
            self._alloc(self.capacity)

    def append(self, **vals: np.ndarray) -> None:
        """Add slots: one array (or scalar) per column, ``vals``' first array giving the length."""
        m = next(v for v in vals.values() if np.ndim(v)).shape[0]
        need = self.n + m
        self.reserve(need)
        for k, v in vals.items():
            self.data[k][self.n:need] = v
        self.n = need

    def keep(self, mask: np.ndarray) -> None:
        """Keep the slots where ``mask`` [n] is True, in order."""
        m = int(mask.sum())
        for arr in self.data.values():
            arr[:m] = arr[:self.n][mask]
        self.n = m


class Pending(_Columns):
    """Flows submitted and waiting for their path latency, in submission order, one slot per flow.

    ready: when each becomes ready (us).  eff: the bytes it is timed for (bytes x jitter).
    id: its flow id (row of the :class:`FlowLog`).  key: its receive group (phase id x R + dst).
    src, dst: sender and receiver rank.  blk: its block (``moonep_sim.sim.ports.Block``, + the SM
    offset).  path: int64 [n, L] ports, only for the per-flow solver.
    """

    ready = _Column(np.float64)
    eff = _Column(np.float64)
    id = _Column()
    key = _Column()
    src = _Column()
    dst = _Column()
    blk = _Column()
    path = _Column()  # [n, path_len]: only with ``with_path``

    def take(self, mask: np.ndarray) -> dict[str, np.ndarray]:
        """The flows where ``mask`` [n] is True (columns, in order), removed; the others stay, in order."""
        out = {k: arr[:self.n][mask] for k, arr in self.data.items()}
        self.keep(~mask)
        return out


class ActiveFlows(_Columns):
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


class FlowLog(_Columns):
    """Every submitted flow, by id: sender, receiver, phase id, bytes and submit time, appended
    as submitted, plus when it became ready, ended and its bottleneck port (filled as it happens;
    NaN / -1 until then)."""

    src = _Column()
    dst = _Column()
    phase = _Column()
    bytes = _Column(np.float64)
    start = _Column(np.float64)
    ready = _Column(np.float64, np.nan)
    end = _Column(np.float64, np.nan)
    bneck = _Column(np.int64, -1)

    def records(self) -> dict[str, np.ndarray]:
        """Per flow: src, dst, phase id, bytes, start (submit), ready, end, bottleneck port."""
        n = self.n
        return {k: self.data[k][:n].copy() for k in ("src", "dst", "phase", "bytes", "start", "ready", "end", "bneck")}


__all__ = ["ActiveFlows", "FlowLog", "Pending"]
