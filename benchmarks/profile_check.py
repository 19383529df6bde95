"""DeepSeek's published H800 training profile against the step model, op class by op class.

Usage::

    python benchmarks/profile_check.py [PROFILE.json.gz] [--summary-only]
    # default profile: ../shared/profiles/deepseek-v3_h800_ep64_train_dualpipe.json.gz;
    # writes docs/results/profile_check.md and traces/profile_check_published.csv

The profile (deepseek-ai/profile-data ``train.json``): one DualPipe pair of a forward and a
backward chunk of DeepSeek-V3 pretraining on H800, each chunk 4 MoE layers, EP64, TP1, one 4K
sequence per micro-batch, FP8 GEMMs, DeepEP internode kernels (20 SMs), perfectly balanced routing.
Every kernel is put in one class by its name (:data:`CLASSES`, first match wins) and its durations
summed: the **published** time per class. The **simulated** time per class is the step model's
price of the same work on the ``h800-cx7`` preset, 4096 tokens, FP8 GEMMs, read one GEMM at a
time from the step's cost model (AIConfigurator's measured GEMM table where installed -- H800 from
the H100 die -- else the roofline) at DeepSeek's shapes, as DeepSeek's recipe runs them:

- GEMMs: MLA's five projections and the shared expert's two, forward, input gradient, and the
  up-projections recomputed in the backward (DeepSeek-V3 report 3.2.3); the router in BF16.
  Weight gradients at their own shapes (n, k, tokens) plus their FP32 accumulation
  (``WGRAD_ACC_BYTES``) times :data:`WGRAD_KERNEL_SLOWDOWN` (FITTED). The routed experts from one
  balanced EP64 ``deepep`` layer simulated with the step's grouped-GEMM pricing.
- Every GEMM and attention kernel on the SMs the communication leaves (:data:`COMM_SMS`).
- Attention: the forward from the cost model; the backward at FlashAttention-3's backward rate
  (``moonep_sim.step.measured.ATTN_BWD_EFFICIENCY``) plus its pre- and post-processing kernels.
- Casts, norms and the other memory-bound kernels: bytes counted from the model's structure
  (:func:`structure_bytes`) at :data:`MEMBOUND_HBM_FRACTION` of HBM (FITTED on the norms' forward).
- Dispatch and combine: **the profile's transfer part** is compared -- DeepEP's internode data
  kernels (``dispatch``, ``combine``) start after a barrier kernel of all ranks
  (``notify_dispatch``, ``cached_notify``), which holds every wait for the peers and is reported
  apart (:data:`WAIT_CLASSES`, not simulated); simulated: the layer simulator's forward dispatch
  (twice: the backward's gradient dispatch is FP8 on the same routes) and its two combines, at
  :data:`TRAINING_COMM_RATE` (FITTED on the cached dispatches).

The chunk pair: published = the trace's wall span; simulated = :func:`pair_total`, the longer of the
compute classes (one compute stream) and the transfers (DualPipe hides the one behind the other).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

DEFAULT = HERE.parent.parent / "shared" / "profiles" / "deepseek-v3_h800_ep64_train_dualpipe.json.gz"
SUMMARY = HERE.parent / "traces" / "profile_check_published.csv"

#: (class, name substrings): a kernel belongs to the first class one of whose substrings its name holds.
CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("grouped GEMMs (fwd + dgrad)", ("m_grouped",)),
    ("weight-gradient GEMMs", ("dptp128c_acc",)),
    ("GEMMs (fwd + dgrad)", ("fp8_ptp128c", "xmma_gemm")),
    ("attention forward", ("compute_attn_ws", "FlashAttnFwd")),
    ("attention backward", ("FlashAttnBwd",)),
    ("barriers (notify_dispatch, cached_notify)", ("notify_dispatch", "cached_notify")),
    ("dispatch", ("internode::dispatch", "get_dispatch_layout")),
    ("combine", ("internode::combine",)),
    ("casts", ("cast", "transpose", "expand_to_fused")),
    ("norms", ("layer_norm",)),
)
OTHER = "other (rotary, SwiGLU, routing, copies, elementwise)"
COMM_CLASSES = ("dispatch", "combine")
#: The kernels that wait for every peer before a transfer (DeepEP's internode ``notify_dispatch``
#: exchanges the counts and ``cached_notify`` cleans the buffers, each behind a barrier of all
#: ranks): what the profile's communication kernels spend waiting, not moving data.
WAIT_CLASSES = ("barriers (notify_dispatch, cached_notify)",)


#: Where the simulation stands against the targets and what drives each gap (read off the
#: profile's kernels; written under the table).
GAPS = """Before (`bb575e0`, 2026-12-07 04:45): 2 of 10 classes within 20%, the pair -31.5% (the
communication kernels' barrier waits counted as transfer, one cast per GEMM input, no recomputation,
no SM share, the forward table's rate for the weight gradients, FlashAttention-2's backward).

Three constants are FITTED on the profile (named in `benchmarks/profile_check.py`), each
on a few kernels of one class, the rest of the class and the other classes being the check:
`MEMBOUND_HBM_FRACTION` (0.307 of HBM, on the 32 RMSNorm forward kernels: norms forward is a fit,
norms backward, casts, other and the attention's pre/post kernels are checks),
`WGRAD_KERNEL_SLOWDOWN` (1.26, on the 4 output-projection weight gradients: 56 of 60 kernels are
the check), `TRAINING_COMM_RATE` (0.74, on the 4 cached dispatches: the 4 forward dispatches and 8
combines are the check). The rest is sourced:

- **SMs**: every GEMM and attention kernel runs on 112 of the H800's 132 SMs (x 1.18): DualPipe
  gives the communication 20 SMs (DeepSeek-V3 report 3.2.2), and its stream holds them from kernel
  to kernel (busy 114.5 of the pair's 129.0 ms).
- **Grouped GEMMs**: the rank's experts read as one GEMM with their N side by side (DeepGEMM's
  grouped kernels schedule every expert's tiles at once; `moonep_sim.step.costs`).
- **Weight gradients**: DeepGEMM's kernel accumulates into the FP32 gradient (read and write 8
  bytes per weight, `WGRAD_ACC_BYTES`); its 1x128-by-1x128 scaling runs below the forward's rate
  (the fitted 1.26).
- **GEMMs**: MLA's up-projections (q_b, kv_b) recomputed in the backward (report 3.2.3).
- **Attention backward**: 2.5x the forward's FLOPs (FlashAttention-2) at FlashAttention-3's backward
  rate, 542/638 of its forward's (FA3 paper, H100, head dim 128, 4k), plus the preprocess (O, dO)
  and the dQ conversion. +18%: the priced forward is already +10%.
- **Casts** (+18%): per GEMM input once forward; per GEMM the output gradient per token and per
  channel transposed, each input transposed, in the backward; the routed experts' the same at
  their rows; the FP8 weights cast once per step (no weight-sized cast per layer in the profile).
- **Norms** and **other**: every RMSNorm recomputed in the backward (report 3.2.3); rotary,
  SwiGLU's backward with its recomputation, the combine side's weighted reduce, residual adds.
- **Dispatch and combine**: the profile's transfer part (the data kernels) against the layer
  simulator's transfers; the barrier kernels (32.6 ms of the comm stream) are waits for peers, not
  simulated. The forward dispatches run ~0.94 ms longer than the cached ones for the same FP8
  rows (-13%): the one part of a transfer kernel the fitted rate does not hold, a wait inside it
  the model does not see.
- **The pair** (+2%): compute-bound; the communication (77 ms of transfers) is hidden.

Not sourced, and what would replace the fits: a published rate of DeepSeek's memory-bound kernels
(or of Transformer Engine's RMSNorm) on H800, DeepGEMM's weight-gradient kernel's rate, DeepEP's
internode rate beside running GEMMs."""


def classify(name: str) -> str:
    for cls, subs in CLASSES:
        if any(s in name for s in subs):
            return cls
    return OTHER


def published(path: Path) -> tuple[dict[str, tuple[int, float]], float]:
    """({class: (kernels, us)}, wall span us) of the profile's kernels."""
    with gzip.open(path) as f:
        ev = json.load(f)["traceEvents"]
    ks = [e for e in ev if e.get("cat") == "kernel"]
    out: dict[str, list] = {}
    for e in ks:
        c = out.setdefault(classify(e["name"]), [0, 0.0])
        c[0] += 1
        c[1] += float(e["dur"])
    span = max(e["ts"] + e["dur"] for e in ks) - min(e["ts"] for e in ks)
    return {k: (int(v[0]), float(v[1])) for k, v in out.items()}, float(span)


def _balanced_routing(model, ranks: int, tokens: int):
    """Perfectly balanced node-limited routing: each token picks 2 experts in each of 4 of the 8
    nodes (groups), every expert the same number of times."""
    from moonep_sim.plan import GlobalRouting

    T = ranks * tokens
    t = np.arange(T, dtype=np.int64)[:, None]
    j = np.arange(model.top_k, dtype=np.int64)[None, :]
    per_node = model.num_experts // 8
    node = (t + (j // 2) * 2) % 8
    local = (t // 8 * 2 + j % 2 + (j // 2) * 7) % per_node
    ids = (node * per_node + local).astype(np.int64)
    w = np.full(ids.shape, 1.0 / model.top_k, np.float32)
    return GlobalRouting.split_evenly(ids, w, model.num_experts, ranks)


#: SMs DualPipe gives the communication kernels (DeepSeek-V3 technical report, section 3.2.2: "only
#: 20 SMs" for the all-to-all; DeepEP's ``Buffer.set_num_sms(20)``): the compute-bound kernels
#: (GEMMs, attention) run on the other SMs for the whole pair, since the communication stream holds
#: its kernels' SMs from one kernel to the next (busy 114.5 of the pair's 129.0 ms in the profile).
COMM_SMS = 20
#: The rate DeepSeek's memory-bound kernels (casts, norms, rotary, SwiGLU, permutes, copies) reach,
#: as a fraction of the H800's HBM bandwidth: FITTED on the profile -- its 32 RMSNorm forward kernels
#: (``ln_fwd_kernel``: 4 per layer at widths 7168, 1536, 512 and 7168, each once in the forward and
#: once recomputed in the backward; read and write bf16: 2.15 GB in 2,085 us). No published rate of
#: these kernels exists; every other memory-bound class is priced at it, as a check.
MEMBOUND_HBM_FRACTION = 0.307
#: DeepGEMM's weight-gradient kernel (``fp8_dptp128c_acc``: both operands scaled per 1x128 along
#: the tokens, FP32 accumulation) over the forward table's time at its shape (plus its FP32
#: accumulator traffic, ``WGRAD_ACC_BYTES``): FITTED on the profile -- its four output-projection
#: weight gradients (7168 x 16384 over 4096 tokens, 1,466-1,517 us, the largest per layer) against
#: 1,191 us priced. The mechanism is the scaling: with per-1x128 scales on both operands every
#: 128-deep K block promotes the accumulator tile by an outer product of row and column scales
#: on the CUDA cores (the forward's 1x128 x 128x128 scaling promotes by one scale per column
#: block); no published rate of that kernel exists. The other 56 weight-gradient kernels are the check.
WGRAD_KERNEL_SLOWDOWN = 1.26
#: The rate DeepEP's internode kernels move data at inside the training pair, over the layer
#: simulator's isolated rate for the same rows (its DeepEP V1 model, which holds DeepEP's published
#: isolated EP64 rates): FITTED on the profile -- its 4 cached dispatches (the backward's FP8
#: gradient dispatch: it starts after its barrier kernel, so its duration is the transfer; mean
#: 3,405 us against 2,515 us simulated). Part of it may be the SMs: DualPipe runs the kernels on 20
#: SMs (10 channels) where DeepEP's benchmark gives them 24, 0.83x if the channels bind (in the
#: simulator the NIC binds); the rest is the compute kernels beside them. The 8 combines and 4
#: forward dispatches are the check.
TRAINING_COMM_RATE = 2515.0 / 3405.0
#: Bytes per element of a cast to FP8 with one FP32 scale per 128 (read bf16, write fp8 + scale),
#: and of a transposed copy of FP8 data (read and write fp8, scales).
CAST_B = 2 + 1 + 4 / 128
FP8_T_B = 2 + 8 / 128


def _mla_gemms(m) -> list[tuple[str, int, int]]:
    """(name, n, k) of one layer's non-expert FP8 GEMMs: MLA's projections (q_a, q_b, kv_a, kv_b,
    o) and the shared expert (gate/up, down)."""
    H, n, hd, rope = m.hidden, m.heads, m.head_dim, m.qk_rope_dim
    v, ql, kl = m.v_head_dim or hd, m.q_lora_rank, m.kv_lora_rank
    F = m.expert_ffn * m.shared_experts
    return [("q_a", ql, H), ("q_b", n * (hd + rope), ql), ("kv_a", kl + rope, H), ("kv_b", n * (hd + v), kl),
            ("o", H, n * v), ("shared_gate_up", 2 * F, H), ("shared_down", H, F)]


def structure_bytes(m, T: int, rows: float) -> dict[str, float]:
    """Bytes one MoE layer's memory-bound kernels move in DeepSeek's FP8 training (forward,
    recomputation and backward), by class, counted from the model's structure (T tokens, ``rows``
    routed rows on the rank):

    - casts: forward, one per-token cast per distinct GEMM input (the layer input, the two latents,
      the heads' output, the MoE input, the shared SwiGLU's output) and the routed SwiGLU fused
      with its cast (reads the 2F-wide input); backward, per GEMM the output gradient cast per
      token (input gradient) and per channel, transposed (weight gradient), each distinct input
      cast transposed (DeepSeek-V3 report section 3.3: 1x128 activation tiles; the profile's
      ``per_channel_cast_and_transpose`` kernels); the routed experts' gradients the same at
      ``rows`` (their output gradient arrives in FP8 from the dispatch: its cast is on the
      sender); the dispatched rows expanded to the experts' layout (FP8). The weights' FP8 copies
      (128x128 blocks, transposable without re-quantising) are cast once per step, not per chunk:
      the profile has no weight-sized cast per layer, only the scales' 2-11 us transposes
      (``utils::transpose``) before each GEMM, left out.
    - norms: 4 RMSNorms per layer (widths H, q latent, kv latent, H), forward (read, write) twice
      -- DeepSeek recomputes every RMSNorm in the backward (report section 3.2.3) -- and backward
      (read input and gradient, write gradient).
    - other: rotary on the queries' and keys' RoPE part (forward, recomputed, backward), SwiGLU's
      backward with its recomputation (routed and shared: read the 2F input and the F gradient,
      write the 2F gradient), the combine side's weighted reduce of each token's K rows (forward
      and backward), the residual adds (read 2, write 1) forward and backward.
    """
    H, F = m.hidden, m.expert_ffn
    n, rope, ql, kl = m.heads, m.qk_rope_dim, m.q_lora_rank, m.kv_lora_rank
    g = _mla_gemms(m)
    fwd_inputs = [H, ql, kl, n * (m.v_head_dim or m.head_dim), H, F * m.shared_experts]
    casts = T * sum(fwd_inputs) * CAST_B + rows * (2 * F * 2 + F * (1 + 4 / 128))
    distinct_k = {k for _, _, k in g}
    casts += T * (2 * sum(nn for _, nn, _ in g) + sum(distinct_k)) * CAST_B
    casts += rows * (2 * 2 * F * CAST_B + (H + H) * FP8_T_B + F * CAST_B)  # dY(gate/up) x2, X^T, dY(down)^T, h^T
    casts += rows * H * FP8_T_B  # expand to the experts' layout
    widths = H + ql + kl + H
    norms = T * widths * (2 * 4 + 6)
    other = 3 * T * (n + 1) * rope * 4
    other += (rows + T * m.shared_experts) * (2 * F + F + 2 * F) * 2
    other += 2 * rows * H * 2 + 2 * T * H * 2
    other += 2 * 2 * T * H * 3 * 2
    return {"casts": casts, "norms": norms, OTHER: other}


def simulated(tokens: int = 4096, ranks: int = 64, layers: int = 4) -> dict[str, float]:
    """{class: us} of the step model for the chunk pair (see the module docstring)."""
    from moonep_sim.models import get_model
    from moonep_sim.plan import ClusterShape, Placement, RowCosts
    from moonep_sim.sim.topology import load_topology
    from moonep_sim.step import CostModel
    from moonep_sim.step.costs import WGRAD_ACC_BYTES
    from moonep_sim.step.layer_sim import simulate_moe_layer
    from moonep_sim.step.measured import load_measured
    from moonep_sim.step.ops import gemm
    from moonep_sim.step.stack import backward_op, layer_ops, step_shape
    from moonep_sim.strategies import PlanContext, make_plan

    m = dataclasses.replace(get_model("deepseek-v3"), layers=layers, moe_layers=layers)
    topo = load_topology("h800-cx7")
    costs = CostModel(topo, "fp8", measured=load_measured(topo), permute=False)
    bf16 = dataclasses.replace(costs, gemm_dtype="bf16")
    shape = step_shape(m, "train", tokens, tokens)
    lo = layer_ops(m, m.dense_layers, shape)
    T = tokens
    out = {c: 0.0 for c, _ in CLASSES} | {OTHER: 0.0}

    def g(cm, rows, n, k):  # one GEMM of (rows, n, k) read from the table (or the roofline)
        return cm.op_us(gemm("g", int(rows), int(n) * int(k), int(k)))

    mem = topo.gpu_mem_bandwidth_GBps * 1e3
    for name, n, k in _mla_gemms(m):
        out["GEMMs (fwd + dgrad)"] += layers * (g(costs, T, n, k) + g(costs, T, k, n))
        out["weight-gradient GEMMs"] += layers * (g(costs, n, k, T) + WGRAD_ACC_BYTES * n * k / mem)
        if name in ("q_b", "kv_b"):  # MLA's up-projections, recomputed in the backward (report 3.2.3)
            out["GEMMs (fwd + dgrad)"] += layers * g(costs, T, n, k)
    E = m.num_experts  # the router in BF16 (cuBLAS): forward, input and weight gradients
    out["GEMMs (fwd + dgrad)"] += layers * (g(bf16, T, E, m.hidden) + g(bf16, T, m.hidden, E))
    out["GEMMs (fwd + dgrad)"] += layers * g(bf16, E, m.hidden, T)
    core = next(o for o in lo.before if o.name == "attn_core")
    out["attention forward"] += layers * costs.op_us(core)
    # FlashAttention-3's backward and its two memory-bound kernels: the preprocess reads O and dO and
    # writes their row sums (fp32), the postprocess converts the fp32 dQ accumulator to bf16
    v, dqk = m.v_head_dim or m.head_dim, m.head_dim + m.qk_rope_dim
    prepost = T * m.heads * (2 * v * 2 + 4 + dqk * (4 + 2))
    out["attention backward"] += layers * (costs.op_us(backward_op(core)) + prepost / (mem * MEMBOUND_HBM_FRACTION))
    ctx = PlanContext(ClusterShape(ranks, 8), Placement.home_groups(m.num_experts, ranks),
                      RowCosts.from_model(m, "fp8"), 1, topo)
    plan = make_plan("deepep", _balanced_routing(m, ranks, tokens), ctx, sms=COMM_SMS)
    lc = simulate_moe_layer(plan, m, topo, costs, train=True)
    rows = float(plan.real_rows_R().max())
    for c, b in structure_bytes(m, T, rows).items():
        out[c] += layers * b / (mem * MEMBOUND_HBM_FRACTION)
    topk = next(o for o in lo.before if o.name == "router_topk")
    out[OTHER] += layers * 2 * costs.op_us(topk) / MEMBOUND_HBM_FRACTION
    exp_f = float(lc.forward.expert_R.max())
    exp_b = float(lc.backward.expert_R.max())
    out["grouped GEMMs (fwd + dgrad)"] += layers * 2 * exp_f
    out["weight-gradient GEMMs"] += layers * max(exp_b - exp_f, 0.0)
    out["weight-gradient GEMMs"] *= WGRAD_KERNEL_SLOWDOWN
    sms = float(topo.sm_count)
    for c in ("grouped GEMMs (fwd + dgrad)", "weight-gradient GEMMs", "GEMMs (fwd + dgrad)", "attention forward",
              "attention backward"):
        out[c] *= sms / (sms - COMM_SMS)
    # the backward's gradient dispatch moves the forward dispatch's routes in FP8, as DeepSeek's
    # recipe does (report section 3.3.2; the profile's cast on the communication stream before each
    # cached dispatch): priced as the forward dispatch (the step's backward sends BF16 gradients);
    # the combines in BF16 both ways
    out["dispatch"] += layers * 2 * float(lc.forward.pre_R.max()) / TRAINING_COMM_RATE
    out["combine"] += layers * float(lc.forward.post_R.max() + lc.backward.post_R.max()) / TRAINING_COMM_RATE
    out["_sources"] = {"gemm": costs.expert_source(), "attention": costs.op_source(backward_op(core))}
    return out


def pair_total(classes: dict[str, float]) -> float:
    """The chunk pair's simulated wall: DualPipe overlaps one chunk's communication with the other
    chunk's compute, so the pair takes the longer of the compute stream's kernels (the compute
    classes, their GEMMs already on the SMs the communication leaves) and the communication's
    transfers."""
    comm = sum(classes[c] for c in COMM_CLASSES)
    comp = sum(v for c, v in classes.items() if c not in COMM_CLASSES and c not in WAIT_CLASSES
               and not c.startswith("_"))
    return max(comp, comm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", nargs="?", default=str(DEFAULT), help="the profile (.json.gz)")
    ap.add_argument("--out", default=str(HERE.parent / "docs" / "results" / "profile_check.md"))
    a = ap.parse_args(argv)
    path = Path(a.profile)
    if not path.is_file():
        print(f"moonep-sim: error: profile ({path}) must be a readable .json.gz trace (deepseek-ai/profile-data "
              "train.json)", file=sys.stderr)
        return 2
    pub, span = published(path)
    with open(SUMMARY, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["class", "kernels", "us"])
        for c, (n, us) in sorted(pub.items()):
            w.writerow([c, n, f"{us:.1f}"])
        w.writerow(["wall span", 0, f"{span:.1f}"])
    sim = simulated()
    src = sim.pop("_sources")
    rows = []
    for c in [c for c, _ in CLASSES] + [OTHER]:
        p = pub.get(c, (0, 0.0))[1]
        s = float("nan") if c in WAIT_CLASSES else sim.get(c, 0.0)
        rows.append((c, pub.get(c, (0, 0.0))[0], p, s, (s / p - 1) if p > 0 else float("nan")))
    pub_pair = span
    sim_pair = pair_total(sim)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3]) if Path("/proc/loadavg").exists() else "?"
    L = ["# DeepSeek-V3's H800 training profile against the step model", "",
         f"Date {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, commit `{commit}`, command "
         f"`python benchmarks/profile_check.py` (profile: `{path.name}`), load average {load}.", "",
         "Published: the profile's kernels by class (name match, `benchmarks/profile_check.py` CLASSES), durations "
         "summed over the DualPipe forward + backward chunk pair (4 MoE layers each, EP64, 4K tokens, FP8). "
         "Simulated: the step model's price of the same work on `h800-cx7` (4 MoE layers, forward, recomputation "
         f"and backward as DeepSeek's recipe runs them, 4096 tokens, FP8 GEMMs; GEMMs from {src['gemm']}; attention "
         f"backward {src['attention']}; dispatch and combine from one balanced EP64 `deepep` layer simulated at 20 "
         "SMs, x 4). The barrier kernels are the communication's waits for its peers: reported, not simulated "
         "(the transfers are compared).", "",
         "| class | kernels | published us | simulated us | error |", "| --- | ---: | ---: | ---: | ---: |"]
    for c, n, p, s, e in rows:
        sv = "waits (not a transfer)" if np.isnan(s) else f"{s:,.0f}"
        L.append(f"| {c} | {n} | {p:,.0f} | {sv} | {'' if np.isnan(e) else f'{e:+.1%}'} |")
    L.append(f"| **chunk pair (wall)** | | {pub_pair:,.0f} | {sim_pair:,.0f} | {sim_pair / pub_pair - 1:+.1%} |")
    L += ["", "Targets: each class within 20%, the pair within 10%. " + GAPS]
    out = Path(a.out)
    out.write_text("\n".join(L) + "\n")
    for c, n, p, s, e in rows:
        print(f"{c:50s} {n:4d} published {p:10.0f} simulated {s:10.0f}  {e:+.1%}")
    print(f"{'chunk pair (wall)':50s}      published {pub_pair:10.0f} simulated {sim_pair:10.0f}  "
          f"{sim_pair / pub_pair - 1:+.1%}")
    print(f"wrote {out} and {SUMMARY}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
