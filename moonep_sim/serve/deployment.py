"""A deployment: pools of workers (aggregated, or prefill and decode), each worker's layout and
scheduler limits, and what fits in memory.

A deployment file is a small TOML::

    weight_bytes = 1          # bytes per weight element (1: FP8 weights, as wide-EP serving deploys)
    kv_bytes = 2              # bytes per KV element (2: BF16 cache)
    mem_fraction = 0.85       # share of HBM the engine takes for weights + KV (SGLang's mem_fraction_static)
    [prefill]                 # or [worker] for an aggregated deployment
    workers = 1
    layout = { dp = 32, ep = 32, dp_attention = true }     # moonep_sim.step.parallel.Parallel fields
    max_running = 128         # per attention rank
    token_budget = 8192       # per attention rank and iteration
    scheduler = "mixed"       # or "prefill-first" (SGLang's separate batches; moonep_sim.serve.policies)
    [decode]
    workers = 1
    layout = { dp = 32, ep = 32, dp_attention = true }
    max_running = 128
    cuda_graphs = true

**Memory per GPU** (:meth:`Pool.kv_tokens`): the dense part (attention, shared experts, dense
FFNs, router, embeddings) sharded ``tp`` ways when attention is tensor-parallel (replicated over
attention-DP ranks), the routed experts ``E / (ep x etp)`` per GPU (expert TP shards each), at ``weight_bytes``; the KV cache
takes the rest of ``mem_fraction`` of HBM. One token's KV over every layer is
``sum_l kv_elems(l) / cache_shards(l) x kv_bytes`` (MLA: the latent and the rope key, whole; GQA: K
and V of the KV heads, split over TP by the kind's ``cache_shards``). An attention rank of a TP layout
spans ``tp`` GPUs. A pool whose weights leave no room for one KV block does not fit (one line, exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from moonep_sim.errors import ConfigError, require
from moonep_sim.models import ModelSpec
from moonep_sim.serve.policies import DEFAULT_POLICY, get_policy
from moonep_sim.step.parallel import Parallel

POOL_KEYS = ("workers", "layout", "max_running", "token_budget", "block", "cuda_graphs", "scheduler")
TOP_KEYS = ("weight_bytes", "kv_bytes", "mem_fraction", "mtp_tokens", "mtp_accept", "eplb_every", "worker",
            "prefill", "decode")
#: share of HBM the engine takes for weights and KV (ASSUMED, SGLang's mem_fraction_static for large GPUs)
MEM_FRACTION = 0.85


@dataclass(frozen=True)
class Pool:
    """``workers`` identical workers of ``role`` on ``layout``; scheduler limits per attention rank."""

    role: str
    workers: int
    layout: Parallel
    max_running: int = 128
    token_budget: int = 8192
    block: int = 16
    cuda_graphs: bool = True
    scheduler: str = DEFAULT_POLICY

    def __post_init__(self) -> None:
        require(self.workers >= 1, f"{self.role} workers ({self.workers}) must be >= 1")
        get_policy(self.scheduler)
        require(self.layout.pp == 1 and self.layout.cp == 1,
                f"{self.role} layout ({self.layout.label()}) must have pp = cp = 1: serving workers here are "
                "TP x DP with EP over them")
        require(self.max_running >= 1 and self.token_budget >= 1,
                f"{self.role} max running ({self.max_running}) and token budget ({self.token_budget}) must be >= 1")

    @property
    def gpus(self) -> int:
        return self.workers * self.layout.world

    @property
    def attn_ranks(self) -> int:
        """Scheduler ranks of one worker: its DP attention ranks (``dp`` when ``dp_attention``; one
        TP group otherwise... of ``world / tp`` groups)."""
        return self.layout.world // self.layout.tp

    def label(self) -> str:
        pol = "" if self.scheduler == DEFAULT_POLICY else f" {self.scheduler}"
        return f"{self.workers}x[{self.layout.label()}] run{self.max_running} bud{self.token_budget}{pol}"


@dataclass(frozen=True)
class Deployment:
    """Pools (``both``, or ``prefill`` and ``decode``) and the memory/precision settings."""

    pools: tuple[Pool, ...]
    weight_bytes: float = 1.0
    kv_bytes: float = 2.0
    mem_fraction: float = MEM_FRACTION
    mtp_tokens: int = 0
    mtp_accept: float = 0.0
    eplb_every: int = 0
    source: str = "flags"

    def __post_init__(self) -> None:
        roles = [p.role for p in self.pools]
        require(roles == ["both"] or roles == ["prefill", "decode"],
                f"deployment pools ({', '.join(roles)}) must be one [worker] pool or [prefill] and [decode]")
        require(self.weight_bytes > 0 and self.kv_bytes > 0, f"weight/kv bytes ({self.weight_bytes}/{self.kv_bytes}) "
                                                             "must be > 0")
        require(0 < self.mem_fraction <= 1, f"mem_fraction ({self.mem_fraction}) must be in (0, 1]")
        require(self.mtp_tokens >= 0 and 0 <= self.mtp_accept <= 1,
                f"MTP ({self.mtp_tokens} tokens, acceptance {self.mtp_accept}) must have tokens >= 0, acceptance in "
                "[0, 1]")
        require(self.eplb_every >= 0, f"eplb_every ({self.eplb_every}) must be >= 0 iterations (0: off)")

    @property
    def disaggregated(self) -> bool:
        return len(self.pools) == 2

    @property
    def gpus(self) -> int:
        return sum(p.gpus for p in self.pools)

    def label(self) -> str:
        return ("disagg P " + self.pools[0].label() + " | D " + self.pools[1].label()) if self.disaggregated \
            else "agg " + self.pools[0].label()

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"weight_bytes": self.weight_bytes, "kv_bytes": self.kv_bytes,
                             "mem_fraction": self.mem_fraction, "mtp_tokens": self.mtp_tokens,
                             "mtp_accept": self.mtp_accept, "eplb_every": self.eplb_every}
        for p in self.pools:
            lay = {k: v for k, v in p.layout.to_dict().items() if k in ("tp", "dp", "ep", "etp", "dp_attention")}
            d["worker" if p.role == "both" else p.role] = {"workers": p.workers, "layout": lay,
                                                            "max_running": p.max_running,
                                                            "token_budget": p.token_budget, "block": p.block,
                                                            "cuda_graphs": p.cuda_graphs, "scheduler": p.scheduler}
        return d

    def to_toml(self) -> str:
        """The deployment as the TOML :func:`read_deployment` reads back."""
        import tomli_w

        return tomli_w.dumps(self.to_dict())

    def check(self, model: ModelSpec, gpu_memory_GiB: float, gpus: int | None = None) -> dict[str, int]:
        """Every pool's layout against the model, and its KV capacity per attention rank (tokens);
        one line naming the pool when it does not fit."""
        if gpus is not None:
            require(self.gpus == gpus, f"deployment GPUs ({self.gpus}: {self.label()}) must equal --gpus ({gpus})")
        out = {}
        for p in self.pools:
            p.layout.check(p.layout.world, model)
            out[p.role] = kv_tokens(model, p.layout, gpu_memory_GiB, self.weight_bytes, self.kv_bytes,
                                    self.mem_fraction, p.role)
            require(out[p.role] >= p.block, f"{p.role} pool ({p.layout.label()}, {model.name}) does not fit: its "
                                            f"weights leave {out[p.role]} KV tokens per attention rank of "
                                            f"{gpu_memory_GiB:g} GiB GPUs (need >= one block of {p.block})")
        return out


def weight_bytes_per_gpu(model: ModelSpec, layout: Parallel, weight_bytes: float) -> float:
    """Bytes of weights one GPU holds (see the module docstring)."""
    from moonep_sim.step.stack import dense_params

    dense = float(sum(dense_params(model).values()))
    experts = model.moe_layers * model.num_experts * 3.0 * model.dispatch_hidden * model.expert_ffn
    return (dense / layout.tp + experts / (layout.ep * layout.etp)) * weight_bytes


def kv_bytes_per_token(model: ModelSpec, layout: Parallel, kv_bytes: float) -> float:
    """KV-cache bytes one token of one sequence takes on one GPU over every layer."""
    from moonep_sim.step.attention import attention_kind

    tot = 0.0
    for l in range(model.layers):
        kind = attention_kind(model.attention_kind(l))
        tot += kind.kv_elems_per_token(model) / kind.cache_shards(model, layout.tp) * kv_bytes
    return tot


def kv_tokens(model: ModelSpec, layout: Parallel, gpu_memory_GiB: float, weight_bytes: float, kv_bytes: float,
              mem_fraction: float, role: str = "") -> int:
    """KV-cache tokens one attention rank holds (its GPUs' HBM share less their weights)."""
    require(gpu_memory_GiB > 0, f"GPU memory ({gpu_memory_GiB} GiB) must be > 0 to size the KV cache")
    free = gpu_memory_GiB * 2**30 * mem_fraction - weight_bytes_per_gpu(model, layout, weight_bytes)
    per = kv_bytes_per_token(model, layout, kv_bytes)
    return max(int(free // per), 0) if per > 0 else 1 << 30


def read_deployment(path: str | Path) -> Deployment:
    """A deployment file (see the module docstring); every bad key is one line naming it."""
    from moonep_sim.io import read_toml

    return deployment_from_dict(read_toml(path, "deployment"), str(path))


def deployment_from_dict(doc: Mapping[str, Any], where: str = "deployment") -> Deployment:
    unknown = sorted(set(doc) - set(TOP_KEYS))
    require(not unknown, f"deployment ({where}): unknown key(s) {', '.join(unknown)}: expected {', '.join(TOP_KEYS)}")
    pools = []
    for role, key in (("both", "worker"), ("prefill", "prefill"), ("decode", "decode")):
        if key not in doc:
            continue
        t = doc[key]
        require(isinstance(t, Mapping), f"deployment ({where}) [{key}] must be a table")
        bad = sorted(set(t) - set(POOL_KEYS))
        require(not bad, f"deployment ({where}) [{key}]: unknown key(s) {', '.join(bad)}: expected "
                         f"{', '.join(POOL_KEYS)}")
        lay = t.get("layout", {})
        require(isinstance(lay, Mapping), f"deployment ({where}) [{key}] layout must be a table of Parallel fields")
        kw = {k: t[k] for k in ("workers", "max_running", "token_budget", "block") if k in t}
        for k, v in kw.items():
            require(isinstance(v, int) and not isinstance(v, bool), f"deployment ({where}) [{key}] {k} ({v!r}) must "
                                                                     "be an integer")
        sched = t.get("scheduler", DEFAULT_POLICY)
        require(isinstance(sched, str), f"deployment ({where}) [{key}] scheduler ({sched!r}) must be a policy name")
        pools.append(Pool(role, layout=Parallel.from_dict(dict(lay), f"deployment ({where}) [{key}] layout"),
                          cuda_graphs=bool(t.get("cuda_graphs", True)), scheduler=sched, **{"workers": 1, **kw}))
    kw = {k: doc[k] for k in ("weight_bytes", "kv_bytes", "mem_fraction", "mtp_tokens", "mtp_accept", "eplb_every")
          if k in doc}
    for k, v in kw.items():
        require(isinstance(v, (int, float)) and not isinstance(v, bool), f"deployment ({where}) {k} ({v!r}) must be "
                                                                          "a number")
    return Deployment(tuple(pools), source=where, **kw)


__all__ = ["Deployment", "MEM_FRACTION", "Pool", "deployment_from_dict", "kv_bytes_per_token", "kv_tokens",
           "read_deployment", "weight_bytes_per_gpu"]
