"""Side-effect helpers at the edge: atomic file writes (nothing half-written, ever)."""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

import numpy as np


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside ``dest``; on success rename it onto ``dest``, else delete it.

    Writers produce the whole file at the yielded path; readers never see a partial ``dest``.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp creates 0600; outputs get the usual mode
    try:
        yield tmp_path
        os.replace(tmp_path, dest)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def write_text_atomic(dest: str | os.PathLike, text: str) -> None:
    with atomic_path(dest) as tmp:
        tmp.write_text(text)


def to_jsonable(obj: Any, *, lenient: bool = False) -> Any:
    """numpy scalars/arrays -> Python values, recursively (dict keys become strings).

    lenient: also turn non-finite floats and objects JSON cannot hold into strings (reports that
    carry arbitrary simulator and replay records).
    """
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v, lenient=lenient) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v, lenient=lenient) for v in obj]
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        obj = obj.item()
    if not lenient:
        return obj
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)
