"""MoonEP's step-level claims, reproduced in kind (or not) by the step model (docs/results/steps.md).

1. Training on one H20 node, EP8, a Kimi-K2-like shape truncated to fit, ``--overlap
   shared-expert``, maxvio 0.2 -> 20: does moonep's step time stay within 5% while deepep's grows,
   and does deepep's peak memory grow with skew and cross the H20's 96 GB where moonep's does not?
   The truncation rule (stated, not tuned to the claim): Kimi K2's layer shapes, 1 dense layer and
   ``--moe-layers`` MoE layers (default 2), 8192 tokens per rank (MoonEP's benchmark S); ``--model
   kimi-k3`` the same with K3's shapes (E=896, K=16, H'=3072, its last layer's attention). The
   layout is one node's DP8 x EP8 with ZeRO-1 (``pure_ep(8)``, the layout account's), memory by
   :func:`moonep_sim.step.memory.memory_for_layout`; ``--moe-layers`` picks how much of the model
   the node holds (the largest that fits is where memory binds).
2. Decode: moonep with a Buffer sized for 8192 tokens per rank, at 32 tokens per rank, against
   alltoall and deepep-ll (Kimi K2, one H20 node, EP8 -- MoonEP's single NVLink domain --,
   context 4096, 4 distinct layers, maxvio 3: 256 tokens of 384 experts cannot be flatter).

Usage::

    python benchmarks/step_claims.py --json OUT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import time

from moonep_sim.experiments import GeneratorSpec, Scenario
from moonep_sim.models import PRESETS


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def train_claim(maxvios, moe_layers: int, tokens: int, strategies, model: str = "kimi-k2",
                recompute: str = "none") -> list[dict]:
    base = PRESETS[model]
    m = dataclasses.replace(base, name=f"{model}-{moe_layers + 1}l", layers=moe_layers + 1, moe_layers=moe_layers,
                            attention=base.attention_kind(base.layers - 1))
    rows = []
    for mv in maxvios:
        sc = Scenario(routing=GeneratorSpec(model=model, maxvio=mv, tokens_per_rank=tokens, layers=moe_layers),
                      cluster="8/8", topology="h20", strategies=list(strategies))
        res = sc.step("train", "shared-expert", model=m, recompute=recompute)
        for s in strategies:
            d = res.figures[s]
            rows.append({"model": m.name, "recompute": recompute, "maxvio": mv, "strategy": s, "step_ms": d["step_time_us"] / 1e3,
                         "exposed_comm_ms": d["exposed_comm_us"] / 1e3, "peak_GiB": d["peak_memory_bytes"] / 2**30,
                         "gpu_GiB": d["gpu_memory_bytes"] / 2**30, "oom": d["oom"],
                         "activations_GiB": d["memory"]["parts"]["activations"] / 2**30,
                         "buffers_GiB": d["memory"]["parts"]["buffers"] / 2**30, "rows_max_mean": d["rows_max_mean"]})
            print(json.dumps(rows[-1]))
    return rows


def decode_claim(tokens: int, static: int) -> list[dict]:
    sc = Scenario(routing=GeneratorSpec(model="kimi-k2", maxvio=3.0, tokens_per_rank=tokens, layers=60),
                  cluster="8/8", topology="h20", strategies=["alltoall", "deepep-ll", "moonep"])
    out = []
    for label, st in (("moonep dynamic", {}), ("moonep static", {"moonep": static})):
        res = sc.step("decode", "none", context=4096, distinct_layers=4, static_tokens=st)
        for s in res.strategies:
            d = res.figures[s]
            out.append({"case": label, "strategy": s, "static_tokens": d["static_tokens"],
                        "step_ms": d["step_time_us"] / 1e3, "exposed_comm_ms": d["exposed_comm_us"] / 1e3,
                        "comm_share": d["comm_share"], "peak_GiB": d["peak_memory_bytes"] / 2**30,
                        "slowest_layer_cause": max(d["layers"], key=lambda x: x["time_us"])["straggler"].get("cause")})
            print(json.dumps(out[-1]))
    return out


def main() -> None:
    from moonep_sim.memory import prefer_small_pages

    prefer_small_pages()  # as the CLI does (moonep_sim/memory.py)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--maxvio", default="0.2,1,5,10,20")
    ap.add_argument("--moe-layers", type=int, default=2)
    ap.add_argument("--model", default="kimi-k2", help="the preset whose layer shapes are truncated (kimi-k2: "
                                                       "E=384, K=8, H'=2048; kimi-k3: E=896, K=16, H'=3072)")
    ap.add_argument("--recompute", default="none", help="train: none, selective or full")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--strategies", default="deepep,moonep,alltoall")
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-decode", action="store_true")
    a = ap.parse_args()
    t0, c0 = time.perf_counter(), cpu_s()
    tr = train_claim([float(x) for x in a.maxvio.split(",")], a.moe_layers, a.tokens, a.strategies.split(","),
                     a.model, a.recompute)
    dec = [] if a.no_decode else decode_claim(32, 8192)
    doc = {"train": tr, "decode": dec, "wall_s": time.perf_counter() - t0, "cpu_s": cpu_s() - c0,
           "load": os.getloadavg()}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
