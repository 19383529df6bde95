"""Each entry's slot from its key's run: the planners' slot passes, one function per rule.

Notation: N entries (flat, in entry order), X keys (experts), P pieces or replicas, T tokens, K top-k.
A key's entries, in entry order, are its *run*; a planner gives each entry a slot by its place j
in its key's run:

- :func:`split_runs`: the run cut into consecutive pieces (``moonep``'s split of an expert's entries
  over ranks; ``eplb``'s contiguous replicas);
- :func:`cycle_runs`: the run dealt round-robin over the key's slots (``eplb``'s default);
- :func:`distinct_per_token`: not a slot but the same kind of pass: the distinct values among each
  token's K keys (``deepep``'s nodes per token).

Each is written here in numpy, the plainest way (one stable sort by key); from
``perf.plan_compiled_min`` entries (:func:`moonep_sim.plan.compiled.covers`) the compiled pass of
:mod:`moonep_sim.plan.fused` runs instead: the same array, one loop in entry order
(``tests/test_plan_fused.py``). Both refuse a key out of range with the same :class:`PlanError`,
naming the first offending entry.
"""

from __future__ import annotations

import numpy as np

from moonep_sim.perf import DEFAULT_PERF, PerfConfig
from moonep_sim.plan import compiled
from moonep_sim.plan.compiled import check_at, key_starts
from moonep_sim.plan.kinds import INDEX
from moonep_sim.routing.metrics import distinct_per_token as distinct_owners


def _place_in_run(key_N: np.ndarray, n_keys: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(key int64 [N], j int64 [N] each entry's place in its key's run, order int64 [N] the entries
    sorted by (key, entry), first entry with a key outside [0, n_keys) or -1)."""
    key = np.asarray(key_N).ravel().astype(np.int64)
    X = int(n_keys)
    out = (key < 0) | (key >= X)
    bad = int(np.argmax(out)) if bool(out.any()) else -1
    k = np.where(out, 0, key)
    order = np.argsort(k, kind="stable")
    cnt = np.bincount(k, minlength=X)
    j = np.empty(key.size, dtype=np.int64)
    j[order] = np.arange(key.size, dtype=np.int64) - np.repeat(np.cumsum(cnt) - cnt, cnt)
    return k, j, order, bad


def _first(*at: int) -> int:
    """The first of several entry positions (-1: none)."""
    hits = [a for a in at if a >= 0]
    return min(hits) if hits else -1


def split_runs(key_N: np.ndarray, n_keys: int, piece_key_P: np.ndarray, piece_len_P: np.ndarray,
               piece_slot_P: np.ndarray, *, perf: PerfConfig = DEFAULT_PERF) -> np.ndarray:
    """INDEX [N] the slot of each entry when each key's run is cut into consecutive pieces: the
    first ``piece_len_P[c]`` entries of key x into the slot of x's first piece c, the next into its
    second, and so on. piece_key_P: int [P] non-decreasing keys in [0, n_keys) (a key's pieces in
    order); piece_len_P: int [P] entries of each piece (each key's lengths summing to at least its
    entries); piece_slot_P: int [P] each piece's slot."""
    key = np.asarray(key_N).ravel()
    if compiled.covers(key.size, perf):
        from moonep_sim.plan import fused

        return fused.split_runs(key, n_keys, piece_key_P, piece_len_P, piece_slot_P)
    X = int(n_keys)
    first = key_starts(piece_key_P, X, "piece")
    pk = np.asarray(piece_key_P, dtype=np.int64)
    ln = np.asarray(piece_len_P, dtype=np.int64)
    k, j, order, bad = _place_in_run(key, X)
    tot_X = np.zeros(X, dtype=np.int64)
    np.add.at(tot_X, pk, ln)
    beyond = j >= tot_X[k]
    check_at(_first(bad, int(np.argmax(beyond)) if bool(beyond.any()) else -1),
             f"entry key (must be in [0, {X}) and within its pieces)")
    cnt = np.bincount(k, minlength=X)
    cum = np.cumsum(ln) - ln
    before = cum - cum[first[pk]] if pk.size else cum  # entries of the key's earlier pieces
    used = np.clip(cnt[pk] - before, 0, ln)  # entries each piece takes: the run's part it covers
    out = np.empty(key.size, dtype=INDEX)
    out[order] = np.repeat(np.asarray(piece_slot_P, dtype=np.int64), used)
    return out


def cycle_runs(key_N: np.ndarray, n_keys: int, rep_key_P: np.ndarray, rep_slot_P: np.ndarray, *,
               perf: PerfConfig = DEFAULT_PERF) -> np.ndarray:
    """INDEX [N] the slot of each entry when each key's run is dealt round-robin over its slots: the
    j-th entry of key x to x's slot ``j % c_x``. rep_key_P: int [P] non-decreasing keys in
    [0, n_keys); rep_slot_P: int [P] the slots of each key in that order."""
    key = np.asarray(key_N).ravel()
    if compiled.covers(key.size, perf):
        from moonep_sim.plan import fused

        return fused.cycle_runs(key, n_keys, rep_key_P, rep_slot_P)
    X = int(n_keys)
    first = key_starts(rep_key_P, X, "replica")
    c = np.diff(first)
    k, j, _, bad = _place_in_run(key, X)
    none = c[k] <= 0
    check_at(_first(bad, int(np.argmax(none)) if bool(none.any()) else -1),
             f"entry key (must be in [0, {X}) with a slot)")
    rep = np.asarray(rep_slot_P, dtype=np.int64)
    return rep[first[k] + j % np.maximum(c[k], 1)].astype(INDEX)


def distinct_per_token(key_TK: np.ndarray, value_X: np.ndarray, *, perf: PerfConfig = DEFAULT_PERF) -> np.ndarray:
    """int64 [T]: the distinct ``value_X[key]`` among each token's K keys (``deepep``'s nodes per
    token from the entries' slots and the slots' nodes). value_X: int [X], non-negative; values
    below 64 on a layer the compiled kernels cover are counted as bits in one pass over the entries
    (``fused.distinct_per_token``), else from one-byte values where they fit."""
    key = np.asarray(key_TK)
    val = np.asarray(value_X)
    if compiled.covers(key.size, perf) and val.size and 0 <= int(val.min()) and int(val.max()) < 64:
        from moonep_sim.plan import fused

        return fused.distinct_per_token(key, val)
    narrow = val.astype(np.uint8) if val.size and int(val.max()) < 256 else val
    return distinct_owners(key, narrow)


__all__ = ["cycle_runs", "distinct_per_token", "split_runs"]
