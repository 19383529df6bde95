"""Attention kinds: one record per kind, one module per kind, looked up by name.

A kind (:class:`AttentionKind`) states, for one layer of a model (a :class:`ModelSpec`):

- ``params(model)``: the weights of its projections (elements);
- ``kv_elems_per_token(model)``: the K/V cache elements one token keeps (0 for a kind with a fixed
  state), and ``cache_bytes(model, shape)``: what the layer keeps per rank in serving (K/V of every
  sequence at its context, or the fixed state of every sequence);
- ``core(model, shape)``: the core op (``attn_core``: its FLOPs and the bytes it reads and writes,
  per mode), or None for a kind with no attention op;
- ``saved_per_token(model, mode)``: the bytes the forward saves per token for the backward;
- ``cache_shards(model, tp)``: how many ways a tensor-parallel group splits the cache (:func:`head_shards`).

``has_op`` is False for a kind that runs no attention at all (``none``: no norm, projections or
core either). The built-in kinds: ``gqa`` (MHA is GQA with kv_heads == heads), ``sliding`` (GQA
over the last ``sliding_window`` keys), ``mla`` (multi-head latent attention), ``gated-mla`` (MLA
with an output gate, Kimi K3), ``linear`` (a recurrent kind with a fixed state per sequence, laid
out as Kimi's KDA), ``none``.

Adding a kind: a module ``moonep_sim/step/attention/<name>.py`` (dashes as underscores) that subclasses
:class:`AttentionKind` (or a built-in kind) and calls ``ATTENTION.register(Kind())``, and its name
in :data:`moonep_sim.models.ATTENTION_KINDS` -- the registry's module list, which the model spec
also validates its ``attention`` field against (the models sit below the step model, so the names
live there). docs/extending.md has a whole example.
"""

from __future__ import annotations

from moonep_sim.models import ATTENTION_KINDS, ModelSpec
from moonep_sim.registry import Registry
from moonep_sim.step.ops import Op, StepShape


class AttentionKind:
    """One attention kind (see the module docstring). The base is a kind with no weights, no cache
    and no core op; a kind overrides what it has."""

    name: str = ""
    has_op: bool = True

    def params(self, model: ModelSpec) -> int:
        """Weights of one layer's attention projections (elements): its GEMMs' (:meth:`gemm_parts`)."""
        return sum(n * k for n, k in self.gemm_parts(model))

    def gemm_parts(self, model: ModelSpec) -> tuple[tuple[int, int], ...]:
        """The projections as GEMMs, (n, k) each; () or parts whose n x k do not sum to
        :meth:`params` = priced as one GEMM of equal FLOPs. A measured GEMM table reads each at its
        own shape."""
        return ()

    def kv_elems_per_token(self, model: ModelSpec) -> int:
        """K/V cache elements one token of one layer keeps (0: none, or a fixed state instead)."""
        return 0

    def cache_bytes(self, model: ModelSpec, shape: StepShape) -> float:
        """Bytes one layer keeps per rank in serving: the cache of every sequence on the rank."""
        return 0.0

    def core(self, model: ModelSpec, shape: StepShape) -> Op | None:
        """The layer's ``attn_core`` op on one rank (FLOPs and bytes), None when it has none."""
        return None

    def cache_shards(self, model: ModelSpec, tp: int) -> float:
        """How many ways a ``tp``-wide tensor-parallel group splits the layer's cache (one rank holds
        ``1 / cache_shards`` of it): 1 for a cache with no heads to split, whole on every rank."""
        return 1

    def saved_per_token(self, model: ModelSpec, mode: str) -> float:
        """Bytes per token the forward saves for the backward (dropped under recompute)."""
        return 0.0

    def __repr__(self) -> str:
        return f"AttentionKind({self.name!r})"


#: The attention kinds by name; the module list is :data:`moonep_sim.models.ATTENTION_KINDS` (a
#: name's dashes are underscores in its module's name: ``gated-mla`` is ``gated_mla.py``).
ATTENTION: Registry[AttentionKind] = Registry("attention kind", __name__,
                                              tuple(k.replace("-", "_") for k in ATTENTION_KINDS))


def head_shards(heads: int, tp: int) -> float:
    """``cache_shards`` of a cache split by ``heads`` heads over ``tp`` ranks: each holds ``max(heads
    // tp, 1)`` heads (copies beyond the heads, as vLLM and SGLang replicate KV heads)."""
    return heads / max(heads // tp, 1)


def attention_kind(name: str) -> AttentionKind:
    """The kind called ``name`` (one-line ConfigError naming the kinds otherwise)."""
    return ATTENTION.get(name)


__all__ = ["ATTENTION", "AttentionKind", "attention_kind", "head_shards"]
