"""The step model's vocabulary: one rank's compute operation (:class:`Op`) and what it runs in a
step (:class:`StepShape`), below the layer stack (``stack``) and the attention kinds
(``attention``) that build ops from them. Bytes are bf16 (:data:`BF16`, 2 per element) unless
named otherwise; FLOPs count 2 per multiply-add.
"""

from __future__ import annotations

from dataclasses import dataclass

BF16 = 2


def gemm(name: str, tokens: int, weights: int, k: int = 0, parts: tuple = ()) -> "Op":
    """A GEMM of ``tokens`` rows through ``weights`` elements (weights read once, rows in/out) whose
    input width is ``k``; ``parts``: its GEMMs as (n, k) each when it is a block of several (kept
    only if their n x k sum to ``weights``; else the block is priced as one GEMM of equal FLOPs)."""
    parts = tuple(parts) if sum(n * kk for n, kk in parts) == weights else ()
    return Op(name, "gemm", 2.0 * tokens * weights, float(weights) * BF16, tokens, f"tokens={tokens}", int(k), parts)


def tp_gemm(name: str, tokens: int, weights: int, k: int = 0, parts: tuple = (), tp: int = 1) -> "Op":
    """A TP-split GEMM on one rank of a ``tp``-way group whose rank holds ``tokens``: the group's
    ``tokens x tp`` rows through ``weights / tp`` elements (each part's output width n split ``tp``
    ways: column-parallel; a row-parallel GEMM has the same FLOPs and weight bytes, ASSUMED the same
    shape). ``tp`` 1: :func:`gemm`."""
    if tp <= 1:
        return gemm(name, tokens, weights, k, parts)
    return gemm(name, tokens * tp, weights // tp, k, tuple((n // tp, kk) for n, kk in parts))


@dataclass(frozen=True)
class Op:
    """One compute operation of one rank.

    name: the op (``attn_proj``, ``attn_core``, ``router`` ...; ``_bwd`` suffix in backward).
    kind: ``gemm`` (FLOPs at the GEMM rate, with the rows-per-GEMM efficiency curve), ``attention``
        (FLOPs and bytes, roofline) or ``bytes`` (memory-bound: elementwise, norm, gather).
    flops / bytes: per rank.  rows: the GEMM's M dimension (tokens), for the efficiency curve.
    shape: the profile key of this op's shape (``tokens=4096`` or ``tokens=32,context=4096``).
    k: a GEMM's reduction dimension (its input width; 0 = not given): with ``rows`` and the FLOPs
        it gives the (m, n, k) a measured GEMM table is read at (``moonep_sim.step.measured``).
    parts: the GEMMs of a block of projections as (n, k) each (() = one GEMM of equal FLOPs).
    attn: an attention core's (mode, sequences, context, heads, kv heads, head dim, window) for a
        measured attention table (() = none).
    """

    name: str
    kind: str
    flops: float
    bytes: float
    rows: int
    shape: str
    k: int = 0
    parts: tuple = ()
    attn: tuple = ()


@dataclass(frozen=True)
class StepShape:
    """What one rank runs in a step: the mode, its tokens and the context per sequence.

    tokens: T per rank (decode: sequences, one new token each).  context: keys per sequence
    (train / prefill: the sequence length, default T; decode: the KV context, default
    :data:`DEFAULT_DECODE_CONTEXT`).  sequences: sequences on the rank.  shards: ranks the
    sequences' tokens are shared over by a parallel layout (tensor parallelism splits the heads,
    context parallelism the sequence): the rank's T tokens are a ``1/shards`` share of whole
    sequences, so a query still attends the causal mean of its whole sequence (1: no layout).
    tp: the tensor-parallel ranks among those shards: each TP-split GEMM (attention projections,
    dense FFN, shared experts, LM head) runs the TP group's ``T x tp`` rows through ``1/tp`` of its
    weight -- the FLOPs of the rank's share, the weight bytes of its shard (1: no TP).
    contexts: decode under data-parallel attention, each rank's KV context ([R] over the ranks the
    step composes; empty: every rank ``context``): rank r's attention core is priced at
    ``contexts[r]``, and the MoE layer's dispatch (a collective) waits for the slowest rank.
    """

    mode: str
    tokens: int
    context: int
    shards: int = 1
    tp: int = 1
    contexts: tuple = ()

    @property
    def sequences(self) -> int:
        if self.mode == "decode":
            return self.tokens
        return max(1, self.tokens // self.context) if self.context <= self.tokens else 1

    def attended(self) -> float:
        """Mean keys one query token attends to (causal in train / prefill)."""
        if self.mode == "decode":
            return float(self.context)
        if self.context <= self.tokens * self.shards:  # whole sequences of `context` tokens (or the rank's share)
            return (self.context + 1) / 2.0
        prior = self.context - self.tokens  # one chunk at the end of a longer sequence
        return prior + (self.tokens + 1) / 2.0


__all__ = ["BF16", "Op", "StepShape", "gemm", "tp_gemm"]
