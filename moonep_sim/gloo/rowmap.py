"""Row maps: the gathers, placements and weighted reduces the gloo executor moves rows with.

Pure torch on CPU int64 index tensors built once per handle from a Plan (``moonep_sim.gloo.handle``
builds them). Notation: m rows of the output (gather) or input (reduce), n_src rows of the source,
C columns.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from moonep_sim.errors import PlanError


def as_index(a: np.ndarray) -> torch.Tensor:
    """int64 CPU tensor of ``a`` (contiguous, shares memory where it can)."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def _inverse_if_permutation(idx: np.ndarray, n: int) -> np.ndarray | None:
    """The inverse of ``idx`` if it is a permutation of range(n), else None."""
    if idx.size != n or (idx < 0).any():
        return None
    seen = np.zeros(n, dtype=bool)
    seen[idx] = True
    if not seen.all():
        return None
    inv = np.empty(n, dtype=np.int64)
    inv[idx] = np.arange(n, dtype=np.int64)
    return inv


@dataclass(frozen=True)
class RowMap:
    """A gather of rows ``out[i] = src[idx[i]]`` (idx -1: zero row) and its adjoint scatter-add.

    idx: int64 [m] source row per output row, -1 = zero row.  n_src: rows of the source.
    Precomputed shortcuts: ``identity`` (idx == arange(n_src)), ``inverse`` (idx is a permutation:
    the adjoint is a gather by the inverse), ``pad_pos`` (output rows that are zero).
    """

    idx: torch.Tensor
    n_src: int
    identity: bool
    inverse: torch.Tensor | None
    safe_idx: torch.Tensor  # idx with -1 replaced by 0 (gather) ...
    pad_pos: torch.Tensor  # ... then these output rows are zeroed
    add_idx: torch.Tensor  # idx with -1 replaced by n_src (adjoint: scatter into a discarded extra row)
    bag_rows: torch.Tensor | None = None  # rows with idx >= 0 grouped by idx (stable): the adjoint as bags
    bag_offsets: torch.Tensor | None = None  # int64 [n_src] start of each source row's bag in bag_rows

    @classmethod
    def build(cls, idx: np.ndarray, n_src: int) -> "RowMap":
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.max(initial=-1) >= n_src or idx.min(initial=0) < -1):
            raise PlanError(f"row index ({int(idx.max())}) must be -1 or < buffer rows ({n_src})")
        identity = idx.size == n_src and bool((idx == np.arange(n_src)).all())
        inv = None if identity else _inverse_if_permutation(idx, n_src)
        pad = idx < 0
        bag_rows = bag_off = None
        if not identity and inv is None:
            order = np.argsort(idx, kind="stable")
            bag_rows = order[int(pad.sum()):]
            bag_off = np.concatenate([[0], np.cumsum(np.bincount(idx[~pad], minlength=n_src))[:-1]]) if n_src else \
                np.zeros(0, dtype=np.int64)
        return cls(as_index(idx), int(n_src), identity, None if inv is None else as_index(inv),
                   as_index(np.where(pad, 0, idx)), as_index(np.flatnonzero(pad)), as_index(np.where(pad, n_src, idx)),
                   None if bag_rows is None else as_index(bag_rows), None if bag_off is None else as_index(bag_off))

    @property
    def rows(self) -> int:
        return int(self.idx.numel())

    def gather(self, src: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[m, C] rows of ``src[n_src, C]`` (zero rows where idx is -1); ``out``: optional workspace.

        Aliasing: with ``identity`` the result IS ``src`` (no copy).
        """
        if self.identity:
            return src
        if self.n_src == 0:
            return src.new_zeros((self.rows,) + tuple(src.shape[1:]))
        out = src.index_select(0, self.safe_idx) if out is None else torch.index_select(src, 0, self.safe_idx, out=out)
        if self.pad_pos.numel():
            out.index_fill_(0, self.pad_pos, 0)
        return out

    def scatter_add(self, vals: torch.Tensor) -> torch.Tensor:
        """The adjoint of :meth:`gather`: [n_src, C] sums of ``vals[m, C]`` into their source rows.

        Aliasing: with ``identity`` the result IS ``vals``.
        """
        if self.identity:
            return vals
        if self.inverse is not None:
            return vals.index_select(0, self.inverse)
        out = vals.new_zeros((self.n_src + 1,) + tuple(vals.shape[1:]))
        out.index_add_(0, self.add_idx, vals)
        return out[: self.n_src]

    def reduce(self, vals: torch.Tensor, weights: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`scatter_add` of ``vals * weights[:, None]``: [n_src, C] (``weights`` [m] optional,
        in ``vals``' dtype).

        One pass over ``vals`` where the dtype allows: float32 / float64 as one sparse-times-dense
        product written into ``out`` (``torch.addmm`` of a CSR matrix of the weights, see
        :func:`csr_addmm_ok`; ``out`` freshly allocated when None); bfloat16 as a weighted bag sum
        per source row (``embedding_bag``'s kernel, about half as fast here, which returns a tensor
        of its own: its ``out=`` overload computes into a fresh tensor and then copies it), so
        ``out`` is used only on the other paths.
        """
        if vals.dim() == 2 and vals.dtype in (torch.float32, torch.float64, torch.bfloat16) and self.n_src and \
                vals.shape[0] and vals.is_contiguous():
            rows, offs = self.bag_rows, self.bag_offsets
            if rows is None:  # identity or a permutation: every source row is a bag of one
                rows = torch.arange(self.n_src) if self.identity else self.inverse
                offs = torch.arange(self.n_src)
            psw = None if weights is None else weights.index_select(0, rows)
            if csr_addmm_ok(vals.dtype):
                crow = torch.cat([offs, offs.new_full((1,), rows.numel())])
                v = torch.ones(rows.numel(), dtype=vals.dtype) if psw is None else psw
                if out is None:
                    out = vals.new_empty((self.n_src,) + tuple(vals.shape[1:]))
                return torch.addmm(out, csr_matrix(crow, rows, v, (self.n_src, int(vals.shape[0]))), vals, beta=0, out=out)
            return torch.ops.aten._embedding_bag_forward_only(vals, rows, offs, False, 0, False, psw, False, -1)[0]
        if out is None:
            out = vals.new_empty((self.n_src,) + tuple(vals.shape[1:]))
        return self._reduce_slow(vals, out, weights)

    def _reduce_slow(self, vals: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        yw = vals if weights is None else vals * weights[:, None]
        if self.inverse is not None or self.identity:
            return torch.index_select(yw, 0, torch.arange(self.n_src) if self.identity else self.inverse, out=out)
        out.zero_()
        keep = self.idx >= 0
        out.index_add_(0, self.idx[keep], yw[keep] if not bool(keep.all()) else yw)
        return out


@dataclass(frozen=True)
class Placer:
    """Placing received rows into a buffer: ``buf[rows[i]] = recv[i]``; rows not named stay zero."""

    rows: torch.Tensor  # int64 [m] destination row of each received row, in receive order
    n_dst: int
    identity: bool
    gather_back: RowMap  # the adjoint: recv = buf[rows]

    @classmethod
    def build(cls, rows: np.ndarray, n_dst: int) -> "Placer":
        rows = np.asarray(rows, dtype=np.int64)
        identity = rows.size == n_dst and bool((rows == np.arange(n_dst)).all())
        return cls(as_index(rows), int(n_dst), identity, RowMap.build(rows, n_dst))

    def place(self, recv: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return recv
        out = recv.new_zeros((self.n_dst,) + tuple(recv.shape[1:]))
        out.index_copy_(0, self.rows, recv)
        return out


@lru_cache(maxsize=None)
def csr_addmm_ok(dtype: torch.dtype) -> bool:
    """True when this torch build accumulates a sparse CSR matrix times dense rows into an existing
    tensor (``torch.addmm(out, S_csr, rows, out=out)``) for ``dtype`` (float32 / float64 with MKL;
    not bfloat16), and with ``beta=0`` overwrites it (NaN included, rows of S without entries
    zeroed). Probed once per dtype with 2x2 products checked against their known values."""
    if dtype not in (torch.float32, torch.float64):
        return False
    try:
        s = csr_matrix(torch.tensor([0, 1, 1]), torch.tensor([1]), torch.tensor([2.0], dtype=dtype), (2, 2))
        rows = torch.tensor([[5.0], [7.0]], dtype=dtype)
        acc = torch.addmm(torch.ones(2, 1, dtype=dtype), s, rows, out=torch.ones(2, 1, dtype=dtype))
        out = torch.full((2, 1), float("nan"), dtype=dtype)
        torch.addmm(out, s, rows, beta=0, out=out)
        return acc.flatten().tolist() == [15.0, 1.0] and out.flatten().tolist() == [14.0, 0.0]
    except (RuntimeError, NotImplementedError):
        return False


def csr_matrix(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """A sparse CSR matrix from index arrays built once per handle from the Plan (their bounds are
    checked there, by ``RowMap.build``), so not checked again on every call."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")
        return torch.sparse_csr_tensor(crow, col, values, size, check_invariants=False)



__all__ = ["Placer", "RowMap", "as_index", "csr_addmm_ok", "csr_matrix"]
