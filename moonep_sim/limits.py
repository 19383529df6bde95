"""Size limits: the largest shapes moonep-sim accepts from a file or an argument.

Every size that decides an allocation (experts, ranks, tokens, chunks, padding) is bounded by what
the input justifies: a token count by the bytes that hold the tokens, and the rest by the limits
below, checked *before* anything is allocated, each refusal naming its limit. They are far above
any published model or cluster (the largest expert counts in use are in the hundreds) and small
enough that one array of that size fits in memory.
"""

MAX_NUM_EXPERTS = 1 << 16
"""Experts per layer (E); per-expert arrays are [E] or [R, E]."""

MAX_TOP_K = 1 << 10
"""Experts per token (K)."""

MAX_RANKS = 1 << 14
"""EP ranks (R) in a simulation or a plan; [R, R] traffic matrices must fit."""

MAX_LAYERS = 1 << 12
"""Layers stored in one trace (L)."""

MAX_ELEMENTS = 1 << 28
"""Elements of one array built from sizes given by a user (e.g. L * T * K generated ids: 2 GiB as int64)."""

MAX_TOKEN_PADDING = 1 << 16
"""Rows a slot is padded to a multiple of (padding multiplies rows: a slot of one token becomes P rows)."""

MAX_CHUNKS = 1 << 12
"""Pipeline chunks of one simulated layer (each chunk is its own set of simulated transfers)."""

MAX_STALL_US = 1e12
"""A simulated stall (microseconds; about 11 days)."""

MAX_JITTER_CV = 10.0
"""Coefficient of variation of the simulator's lognormal jitter."""

MAX_TOKENS_PER_RANK = 1 << 20
"""Tokens on one rank in generated routing or a sweep (a real batch holds thousands)."""

MAX_WIDTH = 1 << 20
"""A model's hidden, expert FFN or dispatch width (the widest published is 18432): bounds row and
weight sizes before any arithmetic (2^63 would overflow int64 byte counts)."""

MAX_HEADS = 1 << 12
"""Attention heads (or KV heads) of a layer (the most published is 128)."""

MAX_VOCAB = 1 << 24
"""Embedding / LM-head rows (the largest published vocabularies are about 2.6e5)."""

MAX_CONTEXT = 1 << 30
"""A model's longest context or a step's context, in tokens (the longest published is about 1e7)."""
