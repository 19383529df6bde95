"""Hostile inputs on the newer surfaces (part of the bad-input corpus, see corpus.py): the layer-stack
fields of a model file, the step options, the special files a step reads, the commands' own
arguments (calibrate, demo, trace inspect, compare), an output over an input on the step level and
the multi-cluster compare, and one cluster named twice. Each case: one line naming the file or the
argument and what was expected, exit 2, nothing written, no traceback, no hang.

The HF launcher and the replay launcher are in ``tests/test_badinput_launchers.py`` (they import
torch); Ctrl-C during start-up in ``tests/test_badinput_interrupt.py``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOPO = REPO / "moonep_sim" / "data" / "topology-local-gloo.toml"
#: a model file with the whole layer stack (a step can run it)
STACK = {"num_experts": 8, "top_k": 2, "hidden": 64, "expert_ffn": 32, "layers": 2, "moe_layers": 2,
         "attention": "gqa", "heads": 4, "kv_heads": 4, "head_dim": 16, "vocab": 1000, "max_context": 4096}
GEN = "maxvio=1,tokens-per-rank=64"
STEP = ["step", "--model", "{in}/m.json", "--gen", GEN, "--ranks", "2", "--topology", "local-gloo",
        "--strategies", "alltoall", "--no-plots"]
TRACE_GEN = ["trace", "gen", "--tokens", "64", "--seed", "1", "--uniform", "-o", "{out}/g.safetensors"]


def _write_model(d: Path, **over) -> None:
    m = {**STACK, **over}
    (d / "m.json").write_text(json.dumps({k: v for k, v in m.items() if v is not None}))


# ------------------------------------------------------------------------ model files: the layer stack
STACK_INT_FIELDS = ("heads", "kv_heads", "head_dim", "q_lora_rank", "kv_lora_rank", "qk_rope_dim", "v_head_dim",
                    "sliding_window", "max_context", "vocab", "dense_ffn")
STACK_BAD = {"string": '"4"', "float": "2.5", "negative": "-3", "bool": "true", "2e63": str(1 << 63), "nan": "NaN",
             "huge": str(1 << 40)}
#: consistent types, inconsistent values: (fields over the base, the field the line must name)
STACK_INCONSISTENT = {
    "kv_heads_above_heads": ({"kv_heads": 8}, "kv_heads"),
    "kv_heads_not_dividing": ({"heads": 6, "kv_heads": 4}, "kv_heads"),
    "head_dim_zero": ({"head_dim": 0}, "head_dim"),
    "heads_huge": ({"heads": 1 << 30}, "heads"),
    "vocab_huge": ({"vocab": 1 << 40}, "vocab"),
    "max_context_huge": ({"max_context": 1 << 40}, "max_context"),
    "mla_without_kv_lora_rank": ({"attention": "mla", "qk_rope_dim": 64}, "kv_lora_rank"),
    "mla_without_rope": ({"attention": "mla", "kv_lora_rank": 512}, "qk_rope_dim"),
    "sliding_without_window": ({"attention": "sliding,gqa"}, "sliding_window"),
    "attention_number": ({"attention": 5}, "attention"),
}


def _stack_cases(Case) -> list:
    out = []
    for field in STACK_INT_FIELDS:
        for vname, raw in STACK_BAD.items():
            def make(d: Path, field=field, raw=raw) -> list[str]:
                body = json.dumps({k: v for k, v in STACK.items() if k != field})
                (d / "m.json").write_text(body[:-1] + f', "{field}": {raw}}}')
                return [*TRACE_GEN, "--model", str(d / "m.json")]
            out.append(Case(f"stack-{field}-{vname}", "model stack", make, rf"m\.json.*{field}"))
    for name, (over, field) in STACK_INCONSISTENT.items():
        for cmd in ("gen", "step"):
            def make(d: Path, over=over, cmd=cmd) -> list[str]:
                _write_model(d, **over)
                return [*TRACE_GEN, "--model", str(d / "m.json")] if cmd == "gen" else list(STEP)
            out.append(Case(f"stack-{cmd}-{name}", "model stack", make, rf"m\.json.*{field}"))
    # a step-level refusal of a model file names the file, not only the model's name
    out.append(Case("stack-step-no-attention-names-the-file", "model stack",
                    lambda d: ((d / "m.json").write_text(json.dumps({k: STACK[k] for k in list(STACK)[:6]})),
                               list(STEP))[1], r"m\.json.*attention"))
    return out


# ------------------------------------------------------------------------ step options
STEP_BAD: dict[str, tuple[list[str], str]] = {
    "tokens-per-rank-0": (["--tokens-per-rank", "0"], "--tokens-per-rank"),
    "tokens-per-rank-negative": (["--tokens-per-rank", "-4"], "--tokens-per-rank"),
    "tokens-per-rank-huge": (["--tokens-per-rank", str(1 << 40)], "--tokens-per-rank"),
    "jobs-0": (["--jobs", "0"], "--jobs"),
    "jobs-negative": (["--jobs", "-2"], "--jobs"),
    "optimizer-shard-beyond-ranks": (["--optimizer-shard", "99"], "--optimizer-shard"),
    "optimizer-shard-negative": (["--optimizer-shard", "-1"], "--optimizer-shard"),
    "optimizer-bytes-inf": (["--optimizer-bytes-per-param", "inf"], "--optimizer-bytes-per-param"),
    "optimizer-bytes-nan": (["--optimizer-bytes-per-param", "nan"], "--optimizer-bytes-per-param"),
    "optimizer-bytes-negative": (["--optimizer-bytes-per-param", "-1"], "--optimizer-bytes-per-param"),
    "optimizer-bytes-huge": (["--optimizer-bytes-per-param", "1e300"], "--optimizer-bytes-per-param"),
    # under a layout (--dp/--ep, which this corpus's --ranks excludes): tests/test_memory_shard.py and
    # tests/test_memory_offload.py hold the not-dividing shard and the cluster without hosts
    "optimizer-offload-above-1": (["--optimizer-offload-fraction", "1.5"], "--optimizer-offload-fraction"),
    "optimizer-offload-nan": (["--optimizer-offload-fraction", "nan"], "--optimizer-offload-fraction"),
    "optimizer-offload-without-layout": (["--optimizer-offload-fraction", "0.5"], "--optimizer-offload-fraction"),
    "optimizer-offload-in-decode": (["--mode", "decode", "--optimizer-offload-fraction", "1"],
                                    "--optimizer-offload-fraction"),
    "recompute-in-decode": (["--recompute", "--mode", "decode"], "--recompute"),
    "recompute-in-prefill": (["--recompute", "--mode", "prefill"], "--recompute"),
    "steps-with-gen": (["--steps", "0-3"], "--steps"),
    "static-buffer-huge": (["--static-buffer", f"alltoall={10 ** 12}"], "--static-buffer"),
    "static-buffer-zero": (["--static-buffer", "alltoall=0"], "--static-buffer"),
    "static-buffer-unknown-strategy": (["--static-buffer", "moonep=64"], "static buffer strategy"),
    "context-0": (["--context", "0"], "--context"),
    "context-huge": (["--context", str(1 << 40)], "--context"),
    "distinct-layers-negative": (["--distinct-layers", "-1"], "--distinct-layers"),
    "distinct-layers-huge": (["--distinct-layers", str(1 << 20)], "--distinct-layers"),
    "gen-model-other-than-model": (["--gen", "model=mixtral-8x7b," + GEN], "--model.*--gen model"),
}


def _step_cases(Case) -> list:
    out = []
    for name, (extra, names) in STEP_BAD.items():
        def make(d: Path, extra=extra) -> list[str]:
            _write_model(d)
            argv = list(STEP)
            if "--gen" in extra:
                i = argv.index("--gen")
                del argv[i:i + 2]
            return [*argv, *extra]
        out.append(Case(f"step-{name}", "step options", make, names))
    # the same options at compare --level step (the step options are shared)
    for name in ("tokens-per-rank-0", "optimizer-bytes-inf", "recompute-in-decode", "static-buffer-huge",
                 "optimizer-shard-beyond-ranks"):
        extra, names = STEP_BAD[name]
        def make(d: Path, extra=extra) -> list[str]:
            _write_model(d)
            return ["compare", "--level", "step", "--model", str(d / "m.json"), "--trace", f"gen:{GEN}", "--ranks", "2",
                    "--topology", "local-gloo", "--strategies", "alltoall", "--no-plots", "--out", "{out}/c", *extra]
        out.append(Case(f"compare-step-{name}", "step options", make, names))
    for over, values in (("maxvio", "1"), ("ranks", "2,4")):  # and at sweep --level step, every EP size it runs
        out.append(Case(f"sweep-step-optimizer-shard-beyond-ranks-over-{over}", "step options",
                        lambda d, over=over, values=values: [
                            "sweep", "--level", "step", "--model", "mixtral-8x7b", "--ranks", "2", "--tokens-per-rank",
                            "64", "--strategies", "alltoall", "--topology", "local-gloo", "--optimizer-shard", "3",
                            "--over", over, "--values", values, "--no-plots", "--out", "{out}/s"], "--optimizer-shard"))
    # every kind of special file as a compute profile: refused before it is opened (a pipe would block)
    kinds = {"fifo": (lambda p: os.mkfifo(p), "named pipe"), "dir": (lambda p: p.mkdir(), "directory"),
             "missing": (lambda p: None, "no such file"), "symlink_loop": (lambda p: p.symlink_to(p), "symbolic links"),
             "dev_null": (lambda p: p.symlink_to("/dev/null"), "character device")}
    for kind, (mk, word) in kinds.items():
        def make(d: Path, mk=mk) -> list[str]:
            _write_model(d)
            mk(d / "ops.csv")
            return [*STEP, "--compute-profile", str(d / "ops.csv")]
        out.append(Case(f"step-compute-profile-{kind}", "special files", make, rf"--compute-profile.*ops\.csv.*{word}"))
    for kind, (mk, word) in kinds.items():  # trace route's bias file
        def make(d: Path, mk=mk) -> list[str]:
            _trace(d)
            mk(d / "bias.npy")
            return ["trace", "route", "{in}/t.safetensors", "--mode", "bias", "--bias-file", str(d / "bias.npy"), "-o",
                    "{out}/r.safetensors"]
        out.append(Case(f"route-bias-file-{kind}", "special files", make, rf"--bias-file.*bias\.npy.*{word}"))
    for kind, (mk, word) in kinds.items():  # serve's request trace and deployment file
        def make(d: Path, mk=mk) -> list[str]:
            mk(d / "r.jsonl")
            return [*SERVE, "--requests", str(d / "r.jsonl")]
        out.append(Case(f"serve-requests-{kind}", "special files", make, r"r\.jsonl"))
        def make2(d: Path, mk=mk) -> list[str]:
            mk(d / "dep.toml")
            return ["serve", "--model", "olmoe-1b-7b", "--deployment", str(d / "dep.toml"), "--rate", "50", "--json"]
        out.append(Case(f"serve-deployment-{kind}", "special files", make2, rf"dep\.toml.*{word}"))
    for kind, (mk, word) in kinds.items():  # the model file too, through step
        def make(d: Path, mk=mk) -> list[str]:
            mk(d / "m.json")
            return list(STEP)
        out.append(Case(f"step-model-{kind}", "special files", make, rf"m\.json.*{word}"))
    return out


# ------------------------------------------------------------------------ the commands' own arguments
def _topo(d: Path, name: str = "b.toml") -> Path:
    shutil.copy(TOPO, d / name)
    return d / name


def _trace(d: Path) -> None:
    from moonep_sim.routing.generators import generate_trace

    generate_trace(d / "t.safetensors", 8, 2, 64, 1, layers=1, maxvio=1.0)


SERVE = ["serve", "--model", "olmoe-1b-7b", "--topology", "h100-cx7", "--worker", "workers=1,dp=4,ep=4,max_running=8",
         "--num-requests", "20", "--draws", "1", "--strategies", "alltoall", "--no-cache", "--json"]
CMP = ["compare", "--trace", "{in}/t.safetensors", "--strategies", "alltoall", "--ranks", "2", "--no-plots"]
ARGS: dict[str, tuple[list[str], str]] = {  # name -> (argv, what the line must name)
    # (the refusal's own words, not argparse's "invalid <function name> value")
    "simulate-dispatch-dtype-unknown": (["simulate", "--dispatch-dtype", "fp4", "--gen", "maxvio=1", "--ranks", "2"],
                                        r"--dispatch-dtype.*\('fp4'\) must be one of bf16, fp8"),
    "simulate-seed-negative": (["simulate", "--seed=-1", "--gen", "maxvio=1", "--strategy", "alltoall", "--ranks",
                                "2"], "seed"),
    "simulate-gen-model-other-than-model": (["simulate", "--gen", "model=mixtral-8x7b,maxvio=1", "--model",
                                             "olmoe-1b-7b", "--strategy", "alltoall", "--ranks", "2"],
                                            "--model.*--gen model"),
    "compare-gen-model-other-than-model": (["compare", "--trace", "gen:model=mixtral-8x7b,maxvio=1", "--model",
                                            "olmoe-1b-7b", "--strategies", "alltoall", "--ranks", "2", "--no-plots",
                                            "--out", "{out}/c"], "--model.*--gen model"),
    "calibrate-sizes-empty": (["calibrate", "--sizes", "", "--dry-run"], "--sizes"),
    "calibrate-sizes-commas": (["calibrate", "--sizes", ",,", "--dry-run"], "--sizes"),
    "calibrate-sizes-zero": (["calibrate", "--sizes", "0K,4K", "--dry-run"], "--sizes"),
    "calibrate-sizes-huge": (["calibrate", "--sizes", "4K,1000G", "--dry-run"], "--sizes"),
    "demo-fast-gpus-per-node-3": (["demo", "--fast", "--gpus-per-node", "3", "--out", "{out}/d"], "--gpus-per-node"),
    "demo-fast-gpus-per-node-0": (["demo", "--fast", "--gpus-per-node", "0", "--out", "{out}/d"], "--gpus-per-node"),
    "demo-fast-layers-99": (["demo", "--fast", "--layers", "99", "--out", "{out}/d"], "--layers"),
    "demo-layers-99": (["demo", "--layers", "99", "--no-calibrate", "--out", "{out}/d"], "--layers"),
    "inspect-top-0": (["trace", "inspect", "{in}/t.safetensors", "--top", "0"], "--top"),
    "inspect-ranks-3": (["trace", "inspect", "{in}/t.safetensors", "--ranks", "3"], "--ranks"),
    "inspect-ranks-16": (["trace", "inspect", "{in}/t.safetensors", "--ranks", "16"], "--ranks"),
    "compare-real-timeout-0": ([*CMP, "--real", "--real-timeout", "0", "--out", "{out}/c"], "--real-timeout"),
    "compare-real-timeout-nan": ([*CMP, "--real", "--real-timeout", "nan", "--out", "{out}/c"], "--real-timeout"),
    "compare-real-timeout-negative": ([*CMP, "--real", "--real-timeout", "-5", "--out", "{out}/c"], "--real-timeout"),
    "compare-out-in-proc": ([*CMP, "--out", "/proc/nope"], "--out.*/proc/nope"),
    "compare-out-under-a-device": ([*CMP, "--out", "/dev/null/x"], "--out.*/dev/null"),
    "compare-duplicate-alias": ([*CMP, "--topology", "h200,h200-cx7", "--out", "{out}/c"], "--topology.*h200"),
    "compare-duplicate-name": ([*CMP, "--topology", "h800-cx7,h800-cx7", "--out", "{out}/c"], "--topology.*h800"),
    **{f"serve-{flag[2:]}-{name}": ([*SERVE, flag, value], flag) for flag, name, value in (
        ("--isl", "huge", "10000000000"), ("--isl", "uniform-inf", "uniform:1:inf"), ("--osl", "lognormal-nan",
                                                                                          "lognormal:nan:1"),
        ("--osl", "exp-huge", "exp:1e20"), ("--rate", "0", "0"), ("--rate", "nan", "nan"),
        ("--num-requests", "0", "0"))},
}


def _arg_cases(Case) -> list:
    out = []
    for name, (argv, names) in ARGS.items():
        def make(d: Path, argv=argv) -> list[str]:
            _trace(d)
            return list(argv)
        out.append(Case(f"surface-{name}", "arguments", make, names))
    # one topology file twice: by a second path, and through a link
    for how in ("second-path", "symlink"):
        def make(d: Path, how=how) -> list[str]:
            _trace(d)
            b = _topo(d)
            other = f"{d}/./b.toml" if how == "second-path" else str(d / "link.toml")
            if how == "symlink":
                os.symlink(b, d / "link.toml")
            return [*CMP, "--topology", f"{b},{other}", "--out", "{out}/c"]
        out.append(Case(f"surface-compare-duplicate-topology-file-{how}", "arguments", make, r"--topology.*b\.toml"))
    return out


# ------------------------------------------------------------------------ outputs over inputs, newer surfaces
def _over_input_cases(Case) -> list:
    out = []
    for how in ("same", "symlink", "hardlink"):
        def make(d: Path, how=how) -> list[str]:
            _trace(d)
            _write_model(d)
            dest = d / "m.json"
            if how != "same":
                dest = d / "link.json"
                (os.symlink if how == "symlink" else os.link)(d / "m.json", dest)
            return ["compare", "--level", "step", "--model", str(d / "m.json"), "--trace", f"gen:{GEN}", "--ranks", "2",
                    "--topology", "local-gloo", "--strategies", "alltoall", "--no-plots", "--out", "{out}/c",
                    "--json", str(dest)]
        out.append(Case(f"over-input-compare-level-step--json-onto--model-{how}", "output over input", make,
                        r"--json.*--model"))
        def make2(d: Path, how=how) -> list[str]:  # an extensionless topology file of a multi-cluster compare
            _trace(d)
            t = _topo(d, "cluster")
            dest = t
            if how != "same":
                dest = d / "link"
                (os.symlink if how == "symlink" else os.link)(t, dest)
            return [*CMP, "--topology", f"h800-cx7,{t}", "--out", "{out}/c", "--json", str(dest)]
        out.append(Case(f"over-input-compare-clusters--json-onto-topology-{how}", "output over input", make2,
                        r"--json.*--topology"))
    return out


def surface_cases(Case) -> list:
    return _stack_cases(Case) + _step_cases(Case) + _arg_cases(Case) + _over_input_cases(Case)
