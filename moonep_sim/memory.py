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


__all__ = ["prefer_small_pages"]
