"""Model presets: the MoE shapes of ../ANCHORS (Kimi K3/K2, DeepSeek-V3, Qwen3, Mixtral, ...).

Row-size conventions (DeepEP's):
- bf16 row: ``dispatch_hidden * 2`` bytes.
- fp8 row: ``dispatch_hidden + dispatch_hidden / 128 * 4`` bytes (1 byte per element plus one fp32
  scale per 128 elements).
- One expert's weights: gate, up and down projections, ``3 * dispatch_hidden * expert_ffn``
  elements (bf16: 2 bytes each); its weight gradient is reduced in fp32 (4 bytes each).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moonep_sim.errors import ConfigError, require


@dataclass(frozen=True)
class ModelSpec:
    """One MoE model's shape, as far as expert parallelism cares.

    name: preset name (lower-case, dashes).
    layers / moe_layers: transformer layers and how many of them are MoE.
    num_experts (E): routed experts per MoE layer.  top_k (K): experts per token.
    shared_experts: always-on experts (computed locally, never dispatched).
    hidden (H): model width.  expert_ffn (H'): routed expert intermediate width.
    dispatch_hidden: width of the row that is dispatched and that the expert consumes (== hidden,
        except for latent-MoE designs such as Kimi K3, where it may be narrower).
    n_groups / topk_groups: expert groups for group-limited routing (DeepSeek-V3: 8 / 4); 1 / 1 = none.
    router: ``softmax`` or ``sigmoid`` scores.
    note: provenance or caveats.
    """

    name: str
    layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    shared_experts: int
    hidden: int
    expert_ffn: int
    dispatch_hidden: int = 0
    n_groups: int = 1
    topk_groups: int = 1
    router: str = "softmax"
    note: str = ""

    def __post_init__(self) -> None:
        if self.dispatch_hidden == 0:
            object.__setattr__(self, "dispatch_hidden", self.hidden)
        for field in ("layers", "moe_layers", "num_experts", "top_k", "hidden", "expert_ffn",
                      "dispatch_hidden", "n_groups", "topk_groups"):
            require(getattr(self, field) >= 1, f"{field} ({getattr(self, field)}) must be >= 1")
        require(self.top_k <= self.num_experts,
                f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        require(self.num_experts % self.n_groups == 0,
                f"num_experts ({self.num_experts}) must be divisible by n_groups ({self.n_groups})")
        require(self.topk_groups <= self.n_groups,
                f"topk_groups ({self.topk_groups}) must be <= n_groups ({self.n_groups})")
        require(self.router in ("softmax", "sigmoid"),
                f"router ({self.router!r}) must be 'softmax' or 'sigmoid'")

    # -- row and weight sizes -------------------------------------------------------------
    @property
    def row_bytes_bf16(self) -> int:
        """Bytes of one dispatched (or combined) bf16 row."""
        return self.dispatch_hidden * 2

    @property
    def row_bytes_fp8(self) -> int:
        """Bytes of one fp8 dispatch row, DeepEP style: 1 byte per element + fp32 scale per 128."""
        return self.dispatch_hidden + (self.dispatch_hidden + 127) // 128 * 4

    def dispatch_row_bytes(self, dtype: str = "bf16") -> int:
        require(dtype in ("bf16", "fp8"), f"dispatch dtype ({dtype!r}) must be 'bf16' or 'fp8'")
        return self.row_bytes_fp8 if dtype == "fp8" else self.row_bytes_bf16

    @property
    def combine_row_bytes(self) -> int:
        """Bytes of one combined row (always bf16)."""
        return self.row_bytes_bf16

    @property
    def expert_weight_elems(self) -> int:
        """Elements of one routed expert's weights: gate, up (H x H') and down (H' x H)."""
        return 3 * self.dispatch_hidden * self.expert_ffn

    @property
    def expert_weight_bytes(self) -> int:
        """Bytes of one expert's bf16 weights (what a prefetch copies)."""
        return self.expert_weight_elems * 2

    @property
    def expert_grad_bytes(self) -> int:
        """Bytes of one expert's fp32 weight gradient (what a gradient reduce sends home)."""
        return self.expert_weight_elems * 4

    def expert_flops_per_row(self) -> int:
        """Forward FLOPs of one token row through one SwiGLU expert (3 GEMMs, 2 FLOPs per MAC)."""
        return 2 * self.expert_weight_elems

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(row_bytes_bf16=self.row_bytes_bf16, row_bytes_fp8=self.row_bytes_fp8,
                 expert_weight_bytes=self.expert_weight_bytes,
                 expert_grad_bytes=self.expert_grad_bytes)
        return d


PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec("kimi-k3", 93, 92, 896, 16, 2, 7168, 3072, dispatch_hidden=3584, router="sigmoid",
              note="routed experts appear to work in a 3584-wide latent (read from the weight "
                   "layout, not stated); dispatched rows are taken as 3584 wide"),
    ModelSpec("kimi-k2", 61, 60, 384, 8, 1, 7168, 2048, router="sigmoid"),
    ModelSpec("deepseek-v3", 61, 58, 256, 8, 1, 7168, 2048, n_groups=8, topk_groups=4,
              router="sigmoid", note="8 expert groups, top-4 groups (node-limited routing)"),
    ModelSpec("qwen3-235b", 94, 94, 128, 8, 0, 4096, 1536),
    ModelSpec("mixtral-8x22b", 56, 56, 8, 2, 0, 6144, 16384),
    ModelSpec("mixtral-8x7b", 32, 32, 8, 2, 0, 4096, 14336, note="the shipped real trace"),
    ModelSpec("gpt-oss-120b", 36, 36, 128, 4, 0, 2880, 2880),
    ModelSpec("olmoe-1b-7b", 16, 16, 64, 8, 0, 2048, 1024, note="the shipped real trace"),
]}


def get_model(name: str) -> ModelSpec:
    """The preset called ``name``; a clear error listing the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"model ({name!r}) must be one of the presets: "
                          f"{', '.join(sorted(PRESETS))}") from None


def custom_model(num_experts: int, top_k: int, hidden: int = 1024, expert_ffn: int = 512,
                 name: str = "custom", **kw) -> ModelSpec:
    """A model of an explicit shape (for traces that name no preset)."""
    return ModelSpec(name, kw.pop("layers", 1), kw.pop("moe_layers", 1), num_experts, top_k,
                     kw.pop("shared_experts", 0), hidden, expert_ffn, **kw)
