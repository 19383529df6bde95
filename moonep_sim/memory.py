"""Process-level memory settings of the commands, applied once at the process edge (the CLI).

numpy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on every array of
4 MiB or more. On the project's reference machine (Linux, THP in ``madvise`` mode) a fresh huge
page costs the process far more system time than the 4 KiB pages it replaces: filling 2 GiB of
fresh arrays took 4.4-4.7 s of system time with the advice and 0.7 s without, in one run (user
time 0.1-0.2 s either way). A plan of one Kimi K3 layer at EP64 writes 1-2 GiB of fresh arrays,
so its first run in a new process -- what ``moonep-sim plan`` is -- spent most of its time there:
allgather 3.2 -> 0.7 s, deepep 2.0 -> 0.5 s of system time with :func:`prefer_small_pages`, user
time unchanged (docs/results/planning.md). The library itself never changes the setting; the CLI
does, for its own process.

The C allocator (glibc) maps every block of more than 32 MiB fresh from the kernel and returns it
on free, so each large temporary of a plan -- a sort's keys, a permutation, a gather -- costs
fresh zeroed pages again, though one of the same size was just freed. :func:`reuse_freed_memory`
keeps the process's freed memory for its next allocations instead: the freed pages are reused,
the peak RSS stays what it was (measured: moonep's and alltoall's command path at K3 EP64, system
time 0.43 -> 0.25 s and 0.39 -> 0.23 s, peak RSS within 1%, on the 2-core reference machine at
load ~3, 2026-12-02; docs/results/planning.md). The
process then keeps its peak memory until it exits, which suits a command; the CLI applies it.
"""

from __future__ import annotations


def prefer_small_pages() -> bool:
    """Stop numpy advising huge pages for this process's large arrays (see the module doc).

    Returns whether this numpy has the switch (``numpy._core.multiarray._set_madvise_hugepage``,
    numpy >= 1.20; without it nothing changes)."""
    import numpy as np

    core = getattr(np, "_core", None) or getattr(np, "core", None)
    switch = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if switch is None:
        return False
    switch(False)
    return True


def reuse_freed_memory() -> bool:
    """Let this process reuse the memory it frees rather than give it back (see the module doc):
    glibc's ``mallopt`` with no blocks mapped apart (``M_MMAP_MAX`` 0) and no trimming of the heap
    (``M_TRIM_THRESHOLD`` at its maximum). Returns whether the C library took both settings (False
    where it is not glibc: nothing changes). Where the heap cannot grow, glibc still maps blocks."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's <malloc.h>
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


__all__ = ["prefer_small_pages", "reuse_freed_memory"]
