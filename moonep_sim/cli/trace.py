"""``moonep-sim trace``: import, generate, inspect and re-route routing traces."""

from __future__ import annotations

import math
import sys
import time

from moonep_sim.cli.common import check_int, console, output_rule, print_json
from moonep_sim.experiments.spec import parse_int_list
from moonep_sim.errors import ConfigError


def _tokens(text: str) -> int:
    """``8192`` or ``64x8192`` (ranks x tokens per rank)."""
    try:
        n = 1
        for part in text.lower().split("x"):
            n *= int(part)
        return n
    except ValueError:
        raise ConfigError(f"--tokens ({text!r}) must be an integer or RANKSxTOKENS like 64x8192") from None


def register(sub) -> None:
    from moonep_sim.routing.importers import formats

    p = sub.add_parser("trace", help="import, generate, inspect and re-route routing traces")
    tsub = p.add_subparsers(dest="trace_command", metavar="ACTION")
    p.set_defaults(func=lambda a: (p.print_help(), 0)[1])

    # -- import
    pi = tsub.add_parser("import", help="convert a routing log / histogram / array to a trace")
    pi.add_argument("src", help="source file (JSONL records, vLLM route log, counts JSON, .npy/.npz)")
    pi.add_argument("-o", "--out", required=True, help="output trace (.safetensors)")
    pi.add_argument("--format", default="auto", choices=("auto",) + formats(),
                    help="source format (default: detected; `moonep-sim trace formats` lists them)")
    pi.add_argument("--model", help="model preset or a .toml/.json model file (its experts and top-k must "
                                    "agree with the file; stored with the trace)")
    pi.add_argument("--num-experts", type=int, help="number of experts E (default: the file's metadata or "
                                                     "--model; inferred from the largest id only as a last resort)")
    pi.add_argument("--top-k", type=int, help="top-k (counts histograms carry none; default 1 there)")
    pi.add_argument("--steps-from", default="auto", choices=("auto", "field", "passes", "group", "none"),
                    help="how records group into steps: auto (a step/batch/iter field if present, else "
                         "forward passes), field, passes, group (one step per request id), none")
    pi.add_argument("--warmup-min-rows", type=int, default=64,
                    help="shortest run of rows of one layer with one identical expert set dropped as a dummy "
                         "block, whatever its weights (0: keep them)")
    pi.add_argument("--capture-min-rows", type=int, default=8,
                    help="shortest power-of-two step of one identical expert set dropped as a graph-capture "
                         "block (0: keep them)")
    pi.add_argument("--drop-incomplete-tokens", action="store_true",
                    help="drop a token at every layer when the log misses it at some (default: keep the layers it "
                         "has, under a per-layer token mask, with a warning giving the count)")
    pi.add_argument("--dominant-share", type=float, default=0.3,
                    help="warn when one expert set holds more than this share of a layer's kept rows "
                         "(at least 4x a uniform set's share)")
    pi.add_argument("--json", action="store_true", help="print the import report as JSON")
    pi.set_defaults(func=run_import)

    # -- formats
    pf = tsub.add_parser("formats", help="the source formats `trace import` reads and the field names it accepts")
    pf.set_defaults(func=run_formats)

    # -- gen
    pg = tsub.add_parser("gen", help="generate a synthetic trace (MoonEP's method and others)")
    shape = pg.add_argument_group("shape")
    shape.add_argument("--model", help="model preset or .toml/.json model file (sets E, K, its expert groups; "
                                       "stored with the trace)")
    shape.add_argument("--num-experts", type=int)
    shape.add_argument("--top-k", type=int)
    shape.add_argument("--tokens", required=True, type=_tokens, help="tokens per step (T or RANKSxT)")
    shape.add_argument("--layers", type=int, default=1)
    shape.add_argument("--steps", type=int, default=1)
    shape.add_argument("--seed", type=int, required=True)
    pop = pg.add_mutually_exclusive_group(required=True)
    pop.add_argument("--maxvio", type=float, help="target maxvio (lognormal popularity, sigma by bisection)")
    pop.add_argument("--sigma", type=float, help="lognormal popularity with this sigma")
    pop.add_argument("--zipf", type=float, help="Zipf popularity exponent a")
    pop.add_argument("--hot", type=int, help="number of hot experts (with --hot-share)")
    pop.add_argument("--uniform", action="store_true")
    pg.add_argument("--hot-share", type=float, help="share of selections the hot experts take")
    pg.add_argument("--drift", type=float, default=0.0, help="popularity drift per step, in [0, 1]")
    pg.add_argument("--layer-variation", type=float, default=0.0, help="per-layer popularity variation [0, 1]")
    pg.add_argument("--groups", type=int, help="expert groups G (group-limited routing)")
    pg.add_argument("--topk-groups", type=int, help="groups kept per token M")
    pg.add_argument("--logits", action="store_true", help="store router logits (for `trace route`)")
    pg.add_argument("-o", "--out", required=True)
    pg.add_argument("--json", action="store_true")
    pg.set_defaults(func=run_gen)

    # -- inspect
    pn = tsub.add_parser("inspect", help="per-layer load statistics of a trace")
    pn.add_argument("file")
    pn.add_argument("--json", action="store_true")
    pn.add_argument("--ranks", type=int, help="EP ranks R (per-rank loads, distinct ranks per token)")
    pn.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node (per-node loads)")
    pn.add_argument("--layers", help="model layer ids, e.g. 0,2,5-7 (default all)")
    pn.add_argument("--top", type=int, default=None, help="hottest experts counted in top_share (default E/16)")
    pn.add_argument("--steps", help="inspect only these steps, e.g. 10-20 or 0,3,5- (default: all)")
    pn.set_defaults(func=run_inspect)

    # -- route
    pr = tsub.add_parser("route", help="re-route a trace from its router logits (balanced or not)")
    pr.add_argument("src", nargs="?", help="trace with router_logits (or use --synthetic)")
    pr.add_argument("-o", "--out", required=True)
    pr.add_argument("--mode", default="topk", choices=("topk", "bias", "quantile", "group"))
    pr.add_argument("--score", default="softmax", choices=("softmax", "sigmoid"))
    pr.add_argument("--top-k", type=int, help="top-k (default: the trace's)")
    pr.add_argument("--groups", type=int, default=1)
    pr.add_argument("--topk-groups", type=int, default=1)
    pr.add_argument("--calib-tokens", type=int, help="calibration batch: the first N tokens (default all)")
    pr.add_argument("--bias-file", help=".npy float array [E]: fixed expert bias for --mode bias")
    pr.add_argument("--bias-rounds", type=int, default=100)
    pr.add_argument("--bias-update", type=float, default=1e-3)
    syn = pr.add_argument_group("synthetic logits (instead of SRC)")
    syn.add_argument("--synthetic", type=_tokens, metavar="TOKENS", help="generate logits for this many tokens")
    syn.add_argument("--num-experts", type=int)
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--skew", type=float, default=1.0, help="spread of per-expert popularity in the logits")
    syn.add_argument("--layers", type=int, default=1)
    pr.add_argument("--json", action="store_true")
    pr.set_defaults(func=run_route)


# ---------------------------------------------------------------------------------- actions
def run_import(a) -> int:
    from moonep_sim.routing.importers import import_trace

    output_rule(a, files=("out",), out_flag="-o")  # before parsing: `trace import X -o X` never runs
    t0 = time.perf_counter()
    meta = import_trace(a.src, a.out, a.format, model=a.model, num_experts=a.num_experts, top_k=a.top_k,
                        warmup_min_rows=a.warmup_min_rows, capture_min_rows=a.capture_min_rows,
                        steps_from=a.steps_from, dominant_share=a.dominant_share,
                        incomplete_tokens="drop" if a.drop_incomplete_tokens else "keep")
    out = {"out": a.out, "kind": meta.kind, "layers": meta.num_layers, "tokens": meta.num_tokens,
           "num_experts": meta.num_experts, "top_k": meta.top_k, "steps": meta.steps,
           "import_report": meta.import_report, "seconds": round(time.perf_counter() - t0, 3)}
    r = meta.import_report
    for w in r.get("warnings", []):
        print(f"moonep-sim: warning: {w}", file=sys.stderr)
    if a.json:
        print_json(out)
        return 0
    c = console()
    c.print(f"{a.src} -> {a.out}: {meta.kind}-level, {meta.num_layers} layers, {meta.num_tokens} tokens, "
            f"{r.get('steps', 1)} step(s), E={meta.num_experts}{' (inferred)' if meta.num_experts_inferred else ''}, "
            f"K={meta.top_k} ({out['seconds']} s)")
    for k in ("dummy_records_dropped", "duplicate_records_dropped", "tokens_missing_layers", "tokens_missing_layers_dropped",
              "records_of_incomplete_tokens_dropped", "non_route_records_skipped"):
        if r.get(k):
            c.print(f"  {k.replace('_', ' ')}: {r[k]}")
    if r.get("dummy_records_dropped"):
        reasons = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r["dummy_rows_by_reason"].items() if v)
        c.print(f"  dummy rows by reason: {reasons} ({r['dummy_blocks_total']} block(s))")
    if r.get("fields_ignored"):
        c.print(f"  fields ignored: {', '.join(r['fields_ignored'])}")
    for k in ("weights", "top_k", "num_tokens"):
        if isinstance(r.get(k), str):
            c.print(f"  note: {k}: {r[k]}")
    return 0


def run_formats(a) -> int:
    from moonep_sim.routing.importers import fields_markdown, formats_markdown
    print(formats_markdown())
    print()
    print("Field names of the record logs (jsonl-records, vllm-routes):")
    print()
    print(fields_markdown())
    return 0


def run_gen(a) -> int:
    from moonep_sim.models import get_model
    from moonep_sim.routing.generators import generate_trace

    output_rule(a, files=("out",), out_flag="-o")  # before the work
    groups, topk_groups = a.groups, a.topk_groups
    if a.model:
        if a.num_experts is not None or a.top_k is not None:
            raise ConfigError("--model and --num-experts/--top-k must not be combined: the model sets E and K")
        m = get_model(a.model)
        E, K = m.num_experts, m.top_k
        groups = m.n_groups if groups is None else groups
        topk_groups = m.topk_groups if topk_groups is None else topk_groups
    else:
        if a.num_experts is None or a.top_k is None:
            raise ConfigError("--num-experts and --top-k (or --model) must be given")
        E, K = a.num_experts, a.top_k
    groups = groups or 1
    topk_groups = topk_groups or (groups if groups > 1 else 1)
    t0 = time.perf_counter()
    rep = generate_trace(a.out, E, K, a.tokens, a.seed, model=m if a.model else None, layers=a.layers, steps=a.steps,
                         maxvio=a.maxvio, sigma=a.sigma, zipf=a.zipf, hot=a.hot, hot_share=a.hot_share,
                         uniform=a.uniform, drift=a.drift, layer_variation=a.layer_variation,
                         groups=groups, topk_groups=topk_groups, with_logits=a.logits)
    secs = time.perf_counter() - t0
    if a.json:
        print_json({"out": a.out, "num_experts": E, "top_k": K, "tokens_per_step": a.tokens,
                    "seconds": round(secs, 3), **rep})
        return 0
    mv = rep["realised_maxvio"]
    c = console()
    c.print(f"wrote {a.out}: E={E} K={K} {a.layers} layer(s) x {a.steps} step(s) x {a.tokens} tokens, "
            f"{rep['popularity']} {rep['params']} seed={a.seed} ({secs:.2f} s)")
    c.print(f"  realised maxvio per (layer, step): min {min(mv):.4f}  mean {sum(mv) / len(mv):.4f}  "
            f"max {max(mv):.4f}")
    return 0


def run_inspect(a) -> int:
    from moonep_sim.routing.metrics import inspect_trace

    from moonep_sim.limits import MAX_NUM_EXPERTS, MAX_RANKS

    layers = parse_int_list(a.layers, "--layers")
    check_int(a.top, "--top", 1, MAX_NUM_EXPERTS, "the hottest experts counted in top_share (leave it out for E/16)")
    check_int(a.ranks, "--ranks", 1, MAX_RANKS, "EP ranks")
    if a.ranks is not None:  # the simulator's own placement decides which EP sizes a trace's experts allow
        from moonep_sim.plan.placement import Placement
        from moonep_sim.routing.trace import Trace

        E = Trace(a.file).meta.num_experts
        try:
            Placement.home_groups(E, a.ranks)
        except ConfigError as e:
            raise ConfigError(f"--ranks ({a.ranks}): {e}") from None
    res = inspect_trace(a.file, ranks=a.ranks, gpus_per_node=a.gpus_per_node, layers=layers, top=a.top or 0,
                        steps=a.steps)
    if a.json:
        print_json(res)
        return 0
    from rich.table import Table

    c = console()
    st = res["steps"]
    need = 110 + (20 if st["count"] > 1 else 0)           # every column at full width, never truncated
    if c.width < need:
        c.width = need
    inferred = " (inferred from the largest id)" if res["num_experts_inferred"] else ""
    c.print(f"{a.file}: {res['kind']}-level, model={res['model']}, {res['layers']} layers, tokens={res['tokens']}, "
            f"E={res['num_experts']}{inferred}, K={res['top_k']}, steps={st['count']}"
            + (f" (selected {st['selected']} of {st['of']})" if st["selected"] != "all" else ""))
    if res["source"]:
        c.print(f"[dim]source: {res['source']}[/dim]")
    if st["tokens_per_step"]:
        tp, mv = st["tokens_per_step"], st["maxvio_per_step"]
        c.print(f"per step: tokens min {tp['min']:.0f} / median {tp['median']:.0f} / max {tp['max']:.0f}; "
                f"maxvio (mean over layers) min {mv['min']:.3f} / median {mv['median']:.3f} / max {mv['max']:.3f}")
    t = Table()
    top_n = res["per_layer"][0]["top_n"] if res["per_layer"] else 0
    per_step = st["count"] > 1
    cols = ["layer", "maxvio", "max/mean", "gini", f"top{top_n} share"] + (["step maxvio min/med/max"] if per_step else [])
    lay = res.get("layout")
    if lay:
        cols += ["rank max/mean", "node max/mean", "ranks/token", "nodes/token"]
    for col in cols:
        t.add_column(col, justify="right")
    est = False
    for p in res["per_layer"]:
        row = [str(p["layer"]), f"{p['maxvio']:.3f}", f"{p['max_over_mean']:.3f}", f"{p['gini']:.3f}",
               f"{p['top_share']:.3f}"]
        if per_step:
            q = p["maxvio_per_step"]
            row.append(f"{q['min']:.1f}/{q['median']:.1f}/{q['max']:.1f}")
        if lay:
            def fmt(v):
                return "n/a" if v is None else f"{v:.2f}" + ("*" if p.get("distinct_is_estimate") else "")
            est = est or bool(p.get("distinct_is_estimate"))
            row += [f"{p['rank_max_over_mean']:.3f}", f"{p['node_max_over_mean']:.3f}",
                    fmt(p["mean_distinct_ranks"]), fmt(p["mean_distinct_nodes"])]
        t.add_row(*row)
    c.print(t)
    if lay:
        c.print(f"layout: {lay['ranks']} ranks, {lay['gpus_per_node']} per node, {lay['nodes']} nodes, {lay['experts']}")
    if est:
        c.print("* " + res["per_layer"][0]["distinct_note"])
    return 0


def run_route(a) -> int:
    import numpy as np

    from moonep_sim.routing.router import replay_trace

    kwargs = dict(score=a.score, calib_tokens=a.calib_tokens, groups=a.groups, topk_groups=a.topk_groups,
                  bias_rounds=a.bias_rounds, bias_update=a.bias_update)
    if a.bias_file:
        if a.mode not in ("bias", "group"):
            raise ConfigError(f"--bias-file needs --mode bias or group (found --mode {a.mode})")
        from moonep_sim.io import check_input_file
        check_input_file(a.bias_file, "--bias-file")  # a pipe or a device would block the reader
        try:
            b = np.load(a.bias_file, allow_pickle=False)
        except (OSError, ValueError, EOFError) as e:
            raise ConfigError(f"--bias-file ({a.bias_file}) must be a readable .npy float array [E] "
                              f"(never a pickle): {e}") from None
        if not isinstance(b, np.ndarray) or b.ndim != 1 or b.dtype.kind != "f":
            raise ConfigError(f"--bias-file ({a.bias_file}) must hold a 1-D float array [E]")
        kwargs["bias_E"] = b
    from moonep_sim.limits import MAX_LAYERS, MAX_NUM_EXPERTS
    from moonep_sim.routing.generators import check_size

    output_rule(a, files=("out",), out_flag="-o")
    for flag, v, lo in (("--groups", a.groups, 1), ("--topk-groups", a.topk_groups, 1), ("--bias-rounds", a.bias_rounds, 0),
                        ("--calib-tokens", a.calib_tokens, 1), ("--top-k", a.top_k, 1)):
        if v is not None and v < lo:
            raise ConfigError(f"{flag} ({v}) must be >= {lo}")
    if not (math.isfinite(a.bias_update) and a.bias_update > 0):
        raise ConfigError(f"--bias-update ({a.bias_update}) must be a finite number > 0")
    src = a.src
    if a.synthetic is not None:
        if src is not None:
            raise ConfigError("SRC and --synthetic must not be combined")
        if a.num_experts is None or a.top_k is None:
            raise ConfigError("--synthetic needs --num-experts and --top-k")
        check_int(a.num_experts, "--num-experts", 1, MAX_NUM_EXPERTS)
        if not 1 <= a.top_k <= a.num_experts:
            raise ConfigError(f"--top-k ({a.top_k}) must be in [1, --num-experts={a.num_experts}]")
        check_int(a.layers, "--layers", 1, MAX_LAYERS)
        if not (math.isfinite(a.skew) and a.skew >= 0):
            raise ConfigError(f"--skew ({a.skew}) must be a finite number >= 0")
        if a.synthetic < 1:
            raise ConfigError(f"--synthetic ({a.synthetic}) must be >= 1 token")
        check_size(a.synthetic, a.num_experts, a.layers)  # the logits are [L, T, E]
        src = _synthetic_source(a)
    elif src is None:
        raise ConfigError("SRC (a trace with router_logits) or --synthetic TOKENS must be given")
    try:
        rep = replay_trace(src, a.out, a.mode, top_k=a.top_k, **kwargs)
    finally:
        if a.synthetic is not None:
            import os
            os.unlink(src)
    if a.json:
        print_json(rep)
        return 0
    c = console()
    c.print(f"wrote {a.out}: router replay --mode {a.mode} --score {a.score}, K={rep['top_k']}")
    for p in rep["per_layer"]:
        c.print(f"  layer {p['layer']}: max/mean {p['max_over_mean']:.4f} (calibration batch of "
                f"{p['calib_tokens']} tokens: {p['calib_max_over_mean']:.4f})")
    return 0


def _synthetic_source(a) -> str:
    """A temporary trace holding synthetic logits (deleted after the replay)."""
    import os
    import tempfile

    import numpy as np

    from moonep_sim.routing.router import synthetic_logits
    from moonep_sim.routing.trace import TraceMeta, write_trace

    E, K, T, L = a.num_experts, a.top_k, a.synthetic, a.layers
    lg = np.stack([synthetic_logits(T, E, a.seed + 1000 * i, skew=a.skew) for i in range(L)])
    ids = np.argsort(-lg, axis=2)[:, :, :K]
    w = np.full(ids.shape, 1.0 / K, np.float32)
    fd, path = tempfile.mkstemp(suffix=".safetensors", prefix=".moonep-synth-")
    os.close(fd)
    meta = TraceMeta(kind="tokens", num_experts=E, top_k=K, layer_ids=list(range(L)), num_tokens=T,
                     source=f"synthetic router logits (skew={a.skew}, seed={a.seed})",
                     attribution="synthetic (moonep-sim)")
    write_trace(path, meta, {"topk_ids": ids, "topk_weights": w, "router_logits": lg})
    return path
