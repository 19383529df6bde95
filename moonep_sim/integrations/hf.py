"""Expert parallelism for Hugging Face transformers MoE models over gloo.

    ep = expert_parallel(model, strategy="moonep")      # on every rank of the gloo group
    loss = model(input_ids=my_shard, labels=my_shard).loss
    loss.backward(); ep.sync_grads(); opt.step(); ep.after_step()
    model.generate(my_prompts, max_new_tokens=8, min_new_tokens=8)   # every rank, in lockstep

transformers (>= 5) gives every MoE family one *experts* module per sparse block (``MixtralExperts``,
``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``, ``DeepseekV2Experts``,
``DeepseekV3Experts``, ``GptOssExperts``): the block calls its own router, then
``experts(hidden [N, H], top_k_index [N, K], top_k_weights [N, K]) -> [N, H]``, then adds its
shared experts. :func:`expert_parallel` replaces each experts module by an :class:`EPExperts` of the
same signature, so the router, the shared experts and everything else stay the model's own:

    the model's router -> Buffer.dispatch -> Buffer.prefetch_weight (the Plan's copies)
      -> this rank's experts, computed by the model's own experts module on its stacked home and
         copied weights (one call per layer; rows of slot i use weights i) -> Buffer.combine

Each rank keeps only its home experts' rows of every expert weight (``[E, ...]`` -> ``[epn, ...]``,
home groups: rank h owns experts ``[h*E/R, (h+1)*E/R)``). Autograd runs through dispatch, the copies'
prefetch (whose backward reduces the copies' gradients home) and combine.

Gradients (the DDP convention). Each rank computes the loss of its own batch shard. Every
parameter that is not an expert weight is replicated, and its gradient is this rank's shard's
contribution; :meth:`ExpertParallel.sync_grads` all-reduces those and divides by R (what DDP does),
and divides the home experts' gradients (already summed over every rank's tokens by the dispatch
backward) by R too. With equal shards and a mean loss, the result equals the gradient of the
single-process model on the whole batch (tests/test_hf_train.py checks every parameter).

Passes. Every rank must run the same number of forward passes (one Plan per MoE layer per pass)
with any number of tokens each (at most ``capacity``; 0 is allowed): ``generate`` therefore needs
``min_new_tokens == max_new_tokens`` (no early stop on EOS), or a stopping rule all ranks share.

Notation: R ranks, E experts, K top-k, H hidden, N tokens of a pass on this rank, W rows of this
rank's expert-grouped layout, epn home experts per rank, X copies fetched by this rank.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist

from moonep_sim.errors import ConfigError, require

_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks)\.(\d+)(?:\.|$)")
MISSING_TRANSFORMERS = ("transformers (not installed) must be installed for the Hugging Face integration: "
                        "pip install 'transformers>=5' (or moonep-sim[hf])")


def require_transformers():
    """The transformers module, or a one-line :class:`ConfigError` saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ConfigError(MISSING_TRANSFORMERS) from None
    major = int(str(transformers.__version__).split(".")[0])
    require(major >= 5, f"transformers version ({transformers.__version__}) must be >= 5 (router and experts "
                        "modules per MoE block)")
    return transformers


@dataclass(frozen=True)
class ExpertsSite:
    """One sparse block's experts module in a model: where it is and its shape."""

    layer_id: int
    name: str            # dotted module path, e.g. model.layers.3.mlp.experts
    parent: torch.nn.Module
    attr: str            # the attribute of ``parent`` holding it
    module: torch.nn.Module
    num_experts: int
    weight_names: tuple[str, ...]   # parameters with a leading [E] dimension (one row per expert)


def find_experts(model: torch.nn.Module) -> list[ExpertsSite]:
    """Every experts module of a transformers MoE model, by layer (class name ``*Experts`` with a
    ``num_experts`` attribute and parameters of leading dimension ``num_experts``)."""
    out: list[ExpertsSite] = []
    mods = dict(model.named_modules())
    for name, mod in mods.items():
        if isinstance(mod, EPExperts) or not type(mod).__name__.endswith("Experts"):
            continue
        E = getattr(mod, "num_experts", None)
        if not isinstance(E, int) or E < 1:
            continue
        names = tuple(n for n, p in mod.named_parameters(recurse=False) if p.dim() >= 1 and p.shape[0] == E)
        if not names:
            continue
        m = _LAYER.search(name)
        require(m is not None, f"experts module ({name}) must sit under a numbered layer (layers.<i>)")
        parent_name, _, attr = name.rpartition(".")
        out.append(ExpertsSite(int(m.group(1)), name, mods[parent_name], attr, mod, E, names))
    return sorted(out, key=lambda s: s.layer_id)


def _top_k(model: torch.nn.Module, site: ExpertsSite) -> int:
    for sub in site.parent.modules():
        if type(sub).__name__.endswith("Router") and isinstance(getattr(sub, "top_k", None), int):
            return int(sub.top_k)
    k = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    require(isinstance(k, int) and k >= 1, f"layer {site.layer_id}: top-k (unknown) must be found on the router "
                                           "(top_k) or the config (num_experts_per_tok)")
    return int(k)


class EPExperts(torch.nn.Module):
    """A sparse block's experts, expert-parallel: same call as the module it replaces.

    forward(hidden [N, H], top_k_index [N, K] int, top_k_weights [N, K]) -> [N, H], the weighted
    sum of each token's K experts' outputs (as the original), computed across the EP group.

    ``local`` is the model's own experts module with its expert weights cut to this rank's home
    experts (``[epn, ...]``, row i = expert ``home_experts[i]``); its forward computes the slots.
    ``last_handle``: the latest pass's handle (its ``plan`` is the Plan of this layer and pass).
    """

    def __init__(self, local: torch.nn.Module, buffer, layer_id: int, weight_names: tuple[str, ...],
                 home_experts: torch.Tensor) -> None:
        super().__init__()
        self.local = local
        self.buffer = buffer
        self.layer_id = int(layer_id)
        self.weight_names = weight_names
        self.register_buffer("home_experts", home_experts, persistent=False)
        self.last_handle = None
        self.bypass = False   # timing of the rest of the model: no expert work, no communication

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        H = hidden_states.shape[-1]
        x = hidden_states.reshape(-1, H)
        if self.bypass:
            return x * 0
        K = top_k_index.shape[-1]
        ids = top_k_index.reshape(-1, K)
        w = top_k_weights.reshape(-1, K).to(x.dtype)
        rows, row_w, _, handle = self.buffer.dispatch(x, ids, w)
        self.last_handle = handle
        home = {n: getattr(self.local, n) for n in self.weight_names}
        copies, rows = self.buffer.prefetch_weight(handle, home, tie=rows, cache_key=("hf", self.layer_id))
        y = self.slots_forward(rows, handle, home, copies)
        return self.buffer.combine(y, handle, row_w)

    def slots_forward(self, rows_WH: torch.Tensor, handle, home: Mapping[str, torch.Tensor],
                      copies: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Every slot's expert over its real rows -> [W, H] (padding rows zero).

        One call of the model's experts module on the stacked weights ``[epn + X, ...]`` (home
        experts, then the fetched copies), each real row routed to its slot's weights with weight
        1 (the routing weights are applied by combine). Vectorised over rows.
        """
        cu, n_S, sl = handle.layout.cu_seqlens, handle.slots.rows, handle.slots
        widx_S = torch.where(sl.is_copy, sl.weight_index + len(self.home_experts), sl.weight_index)
        S = int(n_S.numel())
        slot_of_row = torch.repeat_interleave(torch.arange(S), n_S)
        first_S = torch.cumsum(n_S, 0) - n_S
        pos = cu[:-1][slot_of_row] + (torch.arange(slot_of_row.numel()) - first_S[slot_of_row])
        # keeps the result attached to the rows even when this rank computes nothing: every rank's
        # backward must reach prefetch and dispatch (their collectives run on all ranks)
        out = torch.cat([rows_WH[:0], rows_WH.new_zeros(rows_WH.shape)])
        if pos.numel():
            stacked = {n: torch.cat([home[n], copies[n]]) for n in self.weight_names}
            x = rows_WH.index_select(0, pos)
            idx = widx_S[slot_of_row][:, None]
            ones = x.new_ones((x.shape[0], 1))
            with _num_experts(self.local, int(stacked[self.weight_names[0]].shape[0])):
                y = torch.func.functional_call(self.local, stacked, (x, idx, ones), strict=False)
            out = out.index_copy(0, pos, y.to(out.dtype))
        return out


@contextlib.contextmanager
def _num_experts(mod: torch.nn.Module, n: int) -> Iterator[None]:
    """The experts module's ``num_experts`` set to the rows of the weights it is called with (its
    forward sizes its masks and histograms by it)."""
    old = mod.num_experts
    mod.num_experts = n
    try:
        yield
    finally:
        mod.num_experts = old


class ExpertParallel:
    """What :func:`expert_parallel` made of a model (the model itself is changed in place).

    model: the model.  buffer: the gloo :class:`~moonep_sim.gloo.Buffer` every layer shares.
    layers: the :class:`EPExperts` modules by layer id.  rank / world_size: in the EP group.
    home_experts: int64 [epn] the experts whose weights this rank holds.
    """

    def __init__(self, model, buffer, layers: dict[int, EPExperts], group, full_experts: int, top_k: int,
                 timeout_s: float) -> None:
        from moonep_sim.gloo.liveness import PhaseTracker

        self.model, self.buffer, self.layers, self.group = model, buffer, layers, group
        self.rank, self.world_size = buffer.rank, buffer.world_size
        self.num_experts, self.top_k = full_experts, top_k
        self.home_experts = next(iter(layers.values())).home_experts if layers else torch.zeros(0, dtype=torch.long)
        self._expert_ids = {id(p) for l in layers.values() for n, p in l.local.named_parameters(recurse=False)
                            if n in l.weight_names}
        members = dist.get_process_group_ranks(group) if group is not None else range(self.world_size)
        self._tracker = PhaseTracker("moonep_sim/hf/", self.rank, list(members), timeout_s)

    def is_expert_param(self, p: torch.nn.Parameter) -> bool:
        return id(p) in self._expert_ids

    def replicated_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of every parameter that every rank holds whole (all but expert weights)."""
        return [(n, p) for n, p in self.model.named_parameters() if not self.is_expert_param(p)]

    def expert_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """(name, parameter) of this rank's home expert weights (``[epn, ...]``)."""
        return [(n, p) for n, p in self.model.named_parameters() if self.is_expert_param(p)]

    def sync_grads(self) -> None:
        """Average gradients over the EP group as DDP would: replicated parameters' gradients
        all-reduced (one flat all_reduce) and divided by R; home expert gradients (summed over
        every rank's tokens by the dispatch backward) divided by R. Call on every rank after
        backward. A parameter without a gradient counts as zero."""
        R = self.world_size
        reps = [p for _, p in self.replicated_parameters() if p.requires_grad]
        if reps:
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in reps])
            if R > 1:
                self._tracker.collective("sync_grads", "all_reduce",
                                         lambda: dist.all_reduce(flat, group=self.group, async_op=True))
            flat /= R
            off = 0
            for p in reps:
                n = p.numel()
                p.grad = flat[off:off + n].view_as(p).clone()
                off += n
        for _, p in self.expert_parameters():
            if p.grad is not None:
                p.grad /= R

    def after_step(self) -> None:
        """Call after every optimizer step (every rank): cached resident replicas are refetched."""
        self.buffer.invalidate_replicas()

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Inside: every MoE layer's experts output zeros without communicating (to time the rest
        of the model on its own; the routers and shared experts still run)."""
        for l in self.layers.values():
            l.bypass = True
        try:
            yield
        finally:
            for l in self.layers.values():
                l.bypass = False

    def plans(self) -> dict[int, Any]:
        """layer id -> the Plan of the latest pass."""
        return {lid: l.last_handle.plan for lid, l in self.layers.items() if l.last_handle is not None}


def expert_parallel(model: torch.nn.Module, *, strategy: str = "moonep", options: Mapping[str, Any] | None = None,
                    group=None, capacity: int | None = None, gpus_per_node: int = 0, topology: Any = None,
                    timeout_s: float = 60.0, validate_plans: bool = True) -> ExpertParallel:
    """Make ``model`` expert-parallel over the gloo ``group`` (None: the default group), in place.

    Call on every rank of the group with the same model (same configuration and weights: build it
    with one seed or load one checkpoint) and the same arguments.
    strategy / options: a registered strategy (``moonep_sim.strategies``) and its options.
    capacity: the most tokens one rank passes through a layer in one forward pass (a batch shard's
      ``batch * sequence``); default ``config.max_position_embeddings``.  gpus_per_node: ranks per
      node for two-hop strategies (0: one node).  topology: the modelled cluster for pricing
      planners (``costaware``), e.g. ``moonep_sim.sim.topology.load_topology("local-gloo")``.
    timeout_s: the limit on every collective. Expert weights travel in the model's dtype.
    Returns an :class:`ExpertParallel` (``sync_grads``, ``after_step``, ``plans``...).
    """
    from moonep_sim.gloo import Buffer
    from moonep_sim.plan import RowCosts
    from moonep_sim.strategies import PlanContext, planner

    require(dist.is_initialized(), "torch.distributed (not initialised) must be initialised with the gloo backend "
                                   "before expert_parallel: run under torchrun or launch/train_hf.py --nproc N")
    sites = find_experts(model)
    require(bool(sites), f"model ({type(model).__name__}) must have experts modules (transformers >= 5 MoE "
                         "models: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS): found none")
    E = sites[0].num_experts
    require(all(s.num_experts == E for s in sites), f"every MoE layer must have the same experts ({E}): found "
                                                    f"{sorted({s.num_experts for s in sites})}")
    K = _top_k(model, sites[0])
    R = dist.get_world_size(group)
    require(E % R == 0, f"experts ({E}) must be divisible by the EP group size ({R}): each rank homes E/R")
    cfg = getattr(model, "config", None)
    if capacity is None:
        capacity = int(getattr(cfg, "max_position_embeddings", 0) or 0)
    require(int(capacity) >= 1, f"capacity ({capacity}) must be >= 1 tokens per rank and pass")
    p0 = getattr(sites[0].module, sites[0].weight_names[0])
    dtype = p0.dtype
    H = int(getattr(cfg, "hidden_size", 0) or 0) or _hidden_of(sites[0])
    elem = torch.tensor([], dtype=dtype).element_size()
    per_expert = sum(getattr(sites[0].module, n)[0].numel() for n in sites[0].weight_names)
    costs = RowCosts(H * elem, H * elem, per_expert * elem, per_expert * elem)
    ctx = PlanContext.default(E, R, gpus_per_node, costs, 1, topology)
    buf = Buffer(group, capacity=int(capacity), hidden=H, top_k=K, num_experts=E,
                 planner=planner(strategy, ctx, **dict(options or {})), gpus_per_node=gpus_per_node,
                 timeout_s=timeout_s, dispatch_dtype=dtype, validate_plans=validate_plans)
    home = torch.from_numpy(np.flatnonzero(buf.placement.home_E == buf.rank)).to(torch.long)
    layers: dict[int, EPExperts] = {}
    for s in sites:
        for n in s.weight_names:
            full = getattr(s.module, n)
            setattr(s.module, n, torch.nn.Parameter(full.detach()[home].clone(), requires_grad=full.requires_grad))
        ep = EPExperts(s.module, buf, s.layer_id, s.weight_names, home)
        setattr(s.parent, s.attr, ep)
        layers[s.layer_id] = ep
    return ExpertParallel(model, buf, layers, group, E, K, timeout_s)


def _hidden_of(site: ExpertsSite) -> int:
    hd = getattr(site.module, "hidden_dim", None) or getattr(site.module, "hidden_size", None)
    require(isinstance(hd, int) and hd >= 1, f"layer {site.layer_id}: hidden size (unknown) must be on the config "
                                             "(hidden_size) or the experts module")
    return int(hd)


__all__ = ["EPExperts", "ExpertParallel", "ExpertsSite", "MISSING_TRANSFORMERS", "expert_parallel", "find_experts",
           "require_transformers"]
