"""Generated hostile inputs per category (part of the bad-input corpus, see corpus.py): model files,
Hugging Face config.json files, topology values, sweep axes, generator keys, strategy options and
cluster addresses. Each case is a field (or key, option, axis) x a bad value, sent through a
command; the one error line must name the file and the field, or the argument.

Python API arguments (``Scenario(...)``, ``GeneratorSpec(...)``, ``ModelSpec(...)``) are in
``tests/test_badinput_api.py``; output over input in ``output_cases.py``."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRESET = REPO / "moonep_sim" / "data" / "topology-h800-cx7.toml"
GEN = "maxvio=1,model=mixtral-8x7b,tokens-per-rank=64"
TRACE_GEN = ["trace", "gen", "--tokens", "64", "--seed", "1", "--uniform", "-o", "{out}/g.safetensors"]

# ----------------------------------------------------------------------------------- model files
MODEL = {"num_experts": 8, "top_k": 2, "hidden": 64, "expert_ffn": 32, "layers": 4, "moe_layers": 4}
MODEL_INT_FIELDS = ("num_experts", "top_k", "hidden", "expert_ffn", "layers", "moe_layers", "shared_experts",
                    "dispatch_hidden", "groups", "topk_groups")
# JSON texts of bad values for an integer field (NaN / Infinity as Python's json writes them)
BAD_INTS = {"string": '"4"', "float": "2.5", "negative": "-3", "bool": "true", "2e63": str(1 << 63), "nan": "NaN",
            "inf": "Infinity", "null": "null", "list": "[4]", "object": '{"a": 1}'}


def _model_json(field: str, raw: str) -> bytes:
    body = json.dumps({k: v for k, v in MODEL.items() if k != field})
    return (body[:-1] + f', "{field}": {raw}}}').encode()


def _model_cases(Case) -> list:
    out = []
    for field in MODEL_INT_FIELDS:
        for vname, raw in BAD_INTS.items():
            if field == "shared_experts" and vname == "null":
                continue  # null: not given (the default), fine
            def make(d: Path, field=field, raw=raw) -> list[str]:
                (d / "m.json").write_bytes(_model_json(field, raw))
                return [*TRACE_GEN, "--model", str(d / "m.json")]
            out.append(Case(f"model-{field}-{vname}", "model files", make, rf"m\.json.*{field}"))
    toml_values = {"nan": "nan", "inf": "inf", "float": "2.5", "string": '"4"', "negative": "-3", "2e63": str(1 << 63)}
    for field in ("num_experts", "hidden", "layers", "shared_experts"):
        for vname, raw in toml_values.items():
            if vname == "2e63":
                continue  # beyond TOML's own integer range: refused as invalid TOML, covered below
            def make(d: Path, field=field, raw=raw) -> list[str]:
                lines = [f"{k} = {v}" for k, v in MODEL.items() if k != field] + [f"{field} = {raw}"]
                (d / "m.toml").write_text("[model]\n" + "\n".join(lines) + "\n")
                return [*TRACE_GEN, "--model", str(d / "m.toml")]
            out.append(Case(f"model-toml-{field}-{vname}", "model files", make, rf"m\.toml.*{field}"))
    structural = {
        "moe_layers_above_layers": (b'{"num_experts": 8, "top_k": 2, "hidden": 64, "expert_ffn": 32, "layers": 2, '
                                    b'"moe_layers": 5}', "moe_layers"),
        "top_k_above_experts": (b'{"num_experts": 8, "top_k": 9, "hidden": 64, "expert_ffn": 32}', "top_k"),
        "router_number": (b'{"num_experts": 8, "top_k": 2, "hidden": 64, "expert_ffn": 32, "router": 5}', "router"),
        "unknown_field": (b'{"num_experts": 8, "top_k": 2, "hidden": 64, "expert_ffn": 32, "colour": "red"}', "colour"),
        "deep_nesting": (b"[" * 100000 + b"]" * 100000, "nested"),
        "deep_object": (b'{"a": ' * 5000 + b"1" + b"}" * 5000, "nested"),
        "not_json": (b"{num_experts: 8", "JSON"),
        "top_level_list": (b"[1, 2]", "table|object"),
        "missing_required": (b'{"num_experts": 8}', "top_k"),
    }
    for name, (content, field) in structural.items():
        def make(d: Path, content=content) -> list[str]:
            (d / "m.json").write_bytes(content)
            return [*TRACE_GEN, "--model", str(d / "m.json")]
        out.append(Case(f"model-{name}", "model files", make, rf"m\.json.*({field})"))
    toml_structural = {"deep": "[model]\na = " + "[" * 5000 + "]" * 5000 + "\n", "int_2e63": f"num_experts = {1 << 63}\n",
                       "invalid": "[model\n"}
    for name, text in toml_structural.items():
        def make(d: Path, text=text) -> list[str]:
            (d / "m.toml").write_text(text)
            return [*TRACE_GEN, "--model", str(d / "m.toml")]
        out.append(Case(f"model-toml-{name}", "model files", make, r"m\.toml"))
    kinds = {"fifo": lambda p: os.mkfifo(p), "dir": lambda p: p.mkdir(), "symlink_loop": lambda p: p.symlink_to(p),
             "missing": lambda p: None}
    for kind, mk in kinds.items():
        def make(d: Path, mk=mk) -> list[str]:
            mk(d / "m.json")
            return [*TRACE_GEN, "--model", str(d / "m.json")]
        words = {"fifo": "named pipe", "dir": "directory", "symlink_loop": "symbolic links", "missing": "no such file"}
        out.append(Case(f"model-special-{kind}", "model files", make, rf"m\.json.*{words[kind]}"))
    return out


# ------------------------------------------------------------------------------- HF config.json
HF = {"model_type": "qwen2_moe", "hidden_size": 64, "num_experts": 8, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "num_hidden_layers": 4}
HF_FIELDS = ("hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "num_hidden_layers",
             "first_k_dense_replace", "mlp_only_layers", "decoder_sparse_step", "moe_layer_freq", "n_shared_experts",
             "shared_expert_intermediate_size", "n_group", "topk_group")
HF_GENERIC = {"string": '"one"', "nan": "NaN", "inf": "Infinity", "float": "1.9", "negative": "-2", "bool": "true",
              "2e63": str(1 << 63)}
HF_SPECIFIC = {("first_k_dense_replace", "100"): "100", ("first_k_dense_replace", "4"): "4",
               ("n_group", "2.7"): "2.7", ("n_group", "3"): "3", ("n_group", "16"): "16", ("topk_group", "5"): "5",
               ("decoder_sparse_step", "0"): "0", ("decoder_sparse_step", "9"): "9", ("mlp_only_layers", "3"): "3",
               ("mlp_only_layers", "9"): "[9]", ("mlp_only_layers", "dup"): "[1, 1]", ("mlp_only_layers", "all"): "[0, 1, 2, 3]",
               ("mlp_only_layers", "strings"): '["a"]', ("scoring_func", "relu"): '"relu"', ("scoring_func", "5"): "5",
               ("model_type", "5"): "5", ("num_experts_per_tok", "9"): "9", ("hidden_size", "0"): "0"}


def _hf_json(field: str, raw: str) -> bytes:
    body = json.dumps({k: v for k, v in HF.items() if k != field})
    return (body[:-1] + f', "{field}": {raw}}}').encode()


def _hf_cases(Case) -> list:
    out = []
    items = [((f, v), raw) for f in HF_FIELDS for v, raw in HF_GENERIC.items()] + list(HF_SPECIFIC.items())
    for (field, vname), raw in items:
        if field == "mlp_only_layers" and vname == "negative":
            raw = "[-2]"
        def make(d: Path, field=field, raw=raw) -> list[str]:
            (d / "hf").mkdir()
            (d / "hf" / "config.json").write_bytes(_hf_json(field, raw))
            return [*TRACE_GEN, "--model", str(d / "hf" / "config.json")]
        stem = {"num_experts_per_tok": "num_experts_per_tok|top_k"}.get(field, field)
        out.append(Case(f"hf-{field}-{vname}", "HF configs", make, rf"config\.json.*({stem}|first_k_dense|MoE layer)"))
    return out


# ------------------------------------------------------------------------------- topology values
def _toml_tables() -> dict[str, list[str]]:
    from moonep_sim.sim.topology import _TABLES, Topology
    from dataclasses import fields

    types = {f.name: f.type for f in fields(Topology)}
    return {t: [k for k in keys if types[prefix + k] not in (str, "str")] for t, (prefix, keys) in _TABLES.items()}


def _set_key(text: str, table: str, key: str, raw: str) -> str:
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip() == f"[{table}]"), None)
    if start is None:
        return text.rstrip("\n") + f"\n\n[{table}]\n{key} = {raw}\n"
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("[")), len(lines))
    for i in range(start + 1, end):
        if re.match(rf"{re.escape(key)}\s*=", lines[i]):
            lines[i] = f"{key} = {raw}"
            return "\n".join(lines) + "\n"
    lines.insert(start + 1, f"{key} = {raw}")
    return "\n".join(lines) + "\n"


TOPO_BAD = {"inf": "inf", "ninf": "-inf", "nan": "nan", "string": '"x"', "bool": "true", "1e300": "1e300"}
SIM_TOPO = ["simulate", "--gen", GEN, "--strategy", "alltoall", "--ranks", "2", "--topology", "{in}/b.toml"]


def _topology_cases(Case) -> list:
    out = []
    base = PRESET.read_text()
    for table, keys in _toml_tables().items():
        for key in keys:
            for vname, raw in TOPO_BAD.items():
                def make(d: Path, table=table, key=key, raw=raw) -> list[str]:
                    (d / "b.toml").write_text(_set_key(base, table, key, raw))
                    return list(SIM_TOPO)
                out.append(Case(f"topo-{table}.{key}-{vname}", "topology values", make, rf"b\.toml: .*{key}"))
    for key, raw in (("gpus_per_node", "1.5"), ("nodes", "2.5"), ("gpus_per_node", "0"), ("gpus_per_node", "-8")):
        def make(d: Path, key=key, raw=raw) -> list[str]:
            (d / "b.toml").write_text(_set_key(base, "node", key, raw))
            return list(SIM_TOPO)
        out.append(Case(f"topo-node.{key}-{raw}", "topology values", make, rf"b\.toml: .*{key}"))
    structural = {"name_number": "name = 5\n", "unknown_key": base + "colour = 1\n",
                  "table_not_table": base.replace("[fabric]\n", "fabric = 3\n[fabric2]\n"),
                  "deep": 'name = "x"\na = ' + "[" * 100000 + "]" * 100000 + "\n", "invalid": "[node\n",
                  "no_name": base.split("\n", 1)[1], "binary": "\x00\x01\x02"}
    for name, text in structural.items():
        def make(d: Path, text=text) -> list[str]:
            (d / "b.toml").write_text(text)
            return list(SIM_TOPO)
        out.append(Case(f"topo-{name}", "topology values", make, r"b\.toml"))
    for kind, mk in {"fifo": lambda p: os.mkfifo(p), "dir": lambda p: p.mkdir(), "symlink_loop": lambda p: p.symlink_to(p),
                     "missing": lambda p: None}.items():
        def make(d: Path, mk=mk) -> list[str]:
            mk(d / "b.toml")
            return list(SIM_TOPO)
        out.append(Case(f"topo-special-{kind}", "topology values", make, r"b\.toml"))
    return out


# ------------------------------------------------------------------------------- sweep axes
SWEEP = ["sweep", "--model", "mixtral-8x7b", "--strategies", "alltoall", "--ranks", "8", "--tokens-per-rank", "64",
         "--json", "--out", "{out}/sw"]
SWEEP_BAD = {
    "gpus_per_node": ["1.5", "inf", "nan", "0"], "nodes": ["2.5", "-1"],
    "nic_bandwidth_GBps": ["inf", "nan", "-1", "0", "1e300"], "nvlink_efficiency": ["2", "nan"],
    "ep": ["2.5", "0", "-8", "1000000000", "inf", "nan"], "maxvio": ["0", "-1", "nan", "inf", "1e9"],
    "kernel_relay_message_rows": ["0.5"],
}
BY_BAD = {"tokens-per-rank": ["10000000", "1.5", "0", "-5", "nan", "inf"], "ep": ["1000000000", "2.5", "0", "nan"],
          "maxvio": ["0", "-1", "nan", "inf"]}


def _sweep_cases(Case) -> list:
    out = []
    for axis, values in SWEEP_BAD.items():
        for v in values:
            out.append(Case(f"sweep-over-{axis}={v}", "sweep axes",
                            lambda d, axis=axis, v=v: [*SWEEP, "--over", axis, "--values", v],
                            rf"--values|{axis}|maxvio|EP size|--over"))
    for knob, values in BY_BAD.items():
        over = "nic_bandwidth_GBps"
        for v in values:
            out.append(Case(f"sweep-by-{knob}={v}", "sweep axes",
                            lambda d, knob=knob, v=v: [*SWEEP, "--over", over, "--values", "50", "--by", knob,
                                                       "--by-values", v], rf"--by-values|{knob}|maxvio"))
    return out


# ------------------------------------------------------------------------------- generator keys
GEN_BAD = {"layers": ["nan", "inf", "0", "-1", "1.5", "1000000"], "tokens-per-rank": ["nan", "inf", "0", "-1", "1.5",
           "1000000000"], "seed": ["inf", "nan", "-1", "1.5", "1e30"], "experts": ["0", "-8", "nan", "1.5", "1000000000"],
           "top-k": ["0", "-1", "nan", "1.5", "100000"], "maxvio": ["nan", "inf", "0", "-1", "x"],
           "sigma": ["nan", "inf", "-1"], "zipf": ["nan", "inf", "0", "-1"], "hot": ["nan", "1.5", "0"],
           "groups": ["0", "nan", "1.5"], "topk-groups": ["0", "nan"], "uniform": ["nan", "2"], "model": ["nope"]}


def _generator_cases(Case) -> list:
    out = []
    for key, values in GEN_BAD.items():
        for v in values:
            spec = f"{key}={v}" if key in ("maxvio", "sigma", "zipf", "hot", "uniform") else f"maxvio=1,{key}={v}"
            if key == "hot":
                spec = f"hot={v},hot-share=0.5"
            out.append(Case(f"gen-{key}={v}", "generator keys",
                            lambda d, spec=spec: ["simulate", "--gen", spec, "--strategy", "alltoall", "--ranks", "2"],
                            rf"generator spec|--gen|{key}|model"))
            out.append(Case(f"gen-trace-{key}={v}", "generator keys",
                            lambda d, spec=spec: ["plan", "--trace", f"gen:{spec}", "--strategy", "alltoall", "--ranks", "2"],
                            rf"generator spec|--gen|{key}|model"))
    return out


# ------------------------------------------------------------------------------- strategy options
def _option_cases(Case) -> list:
    from moonep_sim.strategies import available

    out = []
    for name, spec in available().items():
        for key, o in spec.options.items():
            if o.type not in (int, float):
                continue
            bad = ["1000000000000", "nan", "inf", "x"] + (["1.5"] if o.type is int else ["1e308"])
            for v in bad:
                out.append(Case(f"opt-{name}.{key}={v}", "strategy options",
                                lambda d, name=name, key=key, v=v: ["plan", "--trace", f"gen:{GEN}", "--strategy", name,
                                                                    "--ranks", "2", "--opt", f"{key}={v}"],
                                rf"option {key}|--opt"))
    return out


# ------------------------------------------------------------------------------- cluster addresses
ADDRESSES = ["garbage", "tcp://", "tcp://[::1", "inproc://x", "ucx://host:13337", "tcp://h:0", "tcp://h:65536",
             "tcp://h:x", "tcp://a b:1", ":8786", "tcp://[zz]:1", "http://h:8786", "tcp://h:1:2", "tcp://-h:1",
             "tcp://h..x:1", "tls://", " ", "tcp://[::1]", "ws://h:1"]


def _cluster_cases(Case) -> list:
    out = []
    for i, a in enumerate(ADDRESSES):
        out.append(Case(f"cluster-{i}-{re.sub(r'[^A-Za-z0-9]+', '_', a).strip('_') or 'blank'}", "cluster addresses",
                        lambda d, a=a: ["sweep", "--model", "mixtral-8x7b", "--over", "maxvio", "--values", "1",
                                        "--strategies", "alltoall", "--ranks", "8", "--cluster", a, "--json",
                                        "--out", "{out}/sw"], r"--cluster"))
        out.append(Case(f"cluster-compare-{i}", "cluster addresses",
                        lambda d, a=a: ["compare", "--trace", f"gen:{GEN}", "--strategies", "alltoall", "--ranks", "2",
                                        "--cluster", a, "--no-plots", "--json", "--out", "{out}/c"], r"--cluster"))
    return out


# ------------------------------------------------------------------------------- the others
def _other_cases(Case) -> list:
    cases = {
        "demo-fast-nproc-0": (["demo", "--fast", "--nproc", "0", "--out", "{out}/demo"], "--nproc"),
        "demo-fast-unknown-strategy": (["demo", "--fast", "--strategies", "nope", "--out", "{out}/demo"], "strategy"),
        "calibrate-repeats-0": (["calibrate", "--quick", "--repeats", "0", "--dry-run"], "--repeats"),
        "calibrate-target-nproc-0": (["calibrate", "--quick", "--target-nproc", "0", "--dry-run"], "--target-nproc"),
        "costaware-grid-1e9": (["plan", "--trace", f"gen:{GEN}", "--strategy", "costaware", "--ranks", "2", "--opt",
                                "grid=1000000000"], "grid"),
    }
    return [Case(f"other-{k}", "arguments", lambda d, argv=argv: list(argv), names) for k, (argv, names) in cases.items()]


def hostile_cases(Case) -> list:
    return (_model_cases(Case) + _hf_cases(Case) + _topology_cases(Case) + _sweep_cases(Case) + _generator_cases(Case)
            + _option_cases(Case) + _cluster_cases(Case) + _other_cases(Case))
