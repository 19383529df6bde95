"""Memory the gloo executor reuses across calls: workspaces for rows consumed inside one call and
a pool of result tensors recycled once nothing references them.

Large fresh CPU tensors page-fault on first touch, which costs as much as a pass over the rows;
MoonEP sizes its buffers once. Notation: C columns of a row.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


class RowPool:
    """Workspaces (never returned to the caller) and recycled result memory."""

    def __init__(self) -> None:
        self._workspace: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._results: dict[tuple[str, torch.dtype], list[torch.Tensor]] = {}

    def workspace(self, name: str, rows: int, like: torch.Tensor) -> torch.Tensor:
        """A reusable workspace [rows, C] (grown when needed) for rows consumed inside one call.

        Intermediate send / receive buffers live here, so a layer does not fault in fresh pages
        for them on every call. Never returned to the caller (see :meth:`owned`).
        """
        cols = int(np.prod(like.shape[1:]))
        key = (name, like.dtype)
        t = self._workspace.get(key)
        if t is None or t.numel() < rows * cols:
            t = torch.empty(rows * cols, dtype=like.dtype)
            self._workspace[key] = t
        return t[: rows * cols].view((rows,) + tuple(like.shape[1:]))

    def result(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised tensor to return to the caller, in recycled memory when possible.

        Memory from an earlier result of this kind is reused only when nothing references it any
        more (its storage's only owner is this pool); the tensor returned is a new tensor object,
        not a view, so autograd treats it as any fresh output. A result still referenced is never
        reused.
        """
        shape = tuple(int(v) for v in shape)
        numel = int(np.prod(shape)) if shape else 1
        pool = self._results.setdefault((name, dtype), [])
        base = None
        for b in pool:
            if b.numel() >= numel and _unreferenced(b):
                base = b
                break
        if base is None:
            base = torch.empty(numel, dtype=dtype)
            pool.append(base)
            if len(pool) > 3:  # forget the oldest (still-referenced memory stays with its users)
                pool.pop(0)
        return torch.empty(0, dtype=dtype).set_(base.untyped_storage(), 0, shape)

    def owned(self, t: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        """``t``, copied if it lives in a workspace or is the caller's ``source`` (results never alias)."""
        if t.numel() and t.data_ptr() == source.data_ptr():
            return t.clone()
        for ws in self._workspace.values():
            if t.numel() and ws.numel() and t.untyped_storage().data_ptr() == ws.untyped_storage().data_ptr():
                return t.clone()
        return t


def _unreferenced(t: torch.Tensor) -> bool:
    """True when ``t`` (held only by the caller) is the sole owner of its storage: no other tensor,
    view or autograd record shares it. Conservative: False when the count cannot be read."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return False
    try:
        # owners: t itself and the temporary storage object made here
        return t._use_count() == 1 and count(t.untyped_storage()._cdata) <= 2
    except Exception:
        return False


__all__ = ["RowPool"]
