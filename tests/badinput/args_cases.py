"""Argument sets out of range, per command (part of the bad-input corpus, see corpus.py).

Each entry: command line (``{in}``/``{out}`` as in corpus.py) and the argument the error line must
name. Generated from a table of (command, base arguments) x (argument, bad values)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

GEN = "maxvio=1,model=mixtral-8x7b,tokens-per-rank=64"
SIM = ["simulate", "--gen", GEN, "--strategy", "alltoall", "--ranks", "2"]
PLAN = ["plan", "--trace", f"gen:{GEN}", "--strategy", "alltoall", "--ranks", "2"]
CMP = ["compare", "--trace", f"gen:{GEN}", "--strategies", "alltoall", "--ranks", "2", "--no-plots", "--json",
       "--out", "{out}/cmp"]
SWEEP = ["sweep", "--model", "mixtral-8x7b", "--over", "maxvio", "--values", "1", "--strategies", "alltoall",
         "--ranks", "8", "--tokens-per-rank", "64", "--json", "--out", "{out}/sw"]
GENT = ["trace", "gen", "--num-experts", "8", "--top-k", "2", "--tokens", "64", "--seed", "1", "--uniform",
        "-o", "{out}/g.safetensors"]
IMPORT = ["trace", "import", "{in}/ids.npy", "-o", "{out}/t.safetensors"]
INSPECT = ["trace", "inspect", "{in}/t.safetensors", "--json"]
ROUTE = ["trace", "route", "--synthetic", "64", "--num-experts", "8", "--top-k", "2", "-o", "{out}/r.safetensors"]

# (base command, argument, bad value, what the line must name); the argument is appended (or
# replaces the base's value of that argument)
TABLE: list[tuple[str, list[str], str, str, str]] = []


def _add(name: str, base: list[str], arg: str, values: list[str], names: str | None = None) -> None:
    for v in values:
        TABLE.append((name, base, arg, v, names or arg))


ON_TRACE = {"simulate": ["simulate", "--trace", "{in}/t.safetensors", "--strategy", "alltoall", "--ranks", "2"],
            "plan": ["plan", "--trace", "{in}/t.safetensors", "--strategy", "alltoall", "--ranks", "2"],
            "compare": ["compare", "--trace", "{in}/t.safetensors", "--strategies", "alltoall", "--ranks", "2",
                        "--no-plots", "--json", "--out", "{out}/cmp"]}
for nm, base in (("simulate", SIM), ("plan", PLAN), ("compare", CMP)):
    _add(nm, base, "--ranks", ["0", "-2", "3", "1000000000"])
    _add(nm, base, "--token-padding", ["0", "1000000000", "-1"], "--token-padding|token.padding")
    if nm == "compare":
        _add(nm, base, "--opt", ["capacity.cf=1e308", "capacity.cf=-1", "nope", "alltoall.dedup=maybe"],
             "--opt|option|cf")
    else:
        _add(nm, ["simulate" if nm == "simulate" else "plan", *base[1:]] if False else base, "--strategy",
             ["nope"], "strategy")
        _add(nm, [*base[:base.index("alltoall")], "capacity", *base[base.index("alltoall") + 1:]], "--opt",
             ["cf=1e308", "cf=-1", "cf=nan", "nope=1"], "--opt|option|cf")
        _add(nm, base, "--opt", ["dedup=maybe", "nope"], "--opt|option|dedup")
    _add(nm, base, "--gpus-per-node", (["-1", "3"] if nm == "plan" else ["0", "-1", "3"]),
         "--gpus-per-node|--ranks|gpus_per_node")
    _add(nm, ON_TRACE[nm], "--steps", ["5-2", "x", "99"], "--steps|steps|step")
    if nm != "plan":
        _add(nm, base, "--redundant-experts", ["-1", "3", "x", "1000000000"], "--redundant-experts|redundant.experts")
_add("simulate", SIM, "--chunks", ["0", "1000000", "-3"])
_add("simulate", SIM, "--stall", ["0:inf", "0:nan", "9:10", "x"], "--stall|stall|fault rank")
_add("simulate", SIM, "--jitter", ["inf", "nan", "-0.5"], "--jitter|jitter")
_add("simulate", SIM, "--slow-gpu", ["0:0", "0:inf", "99:2"], "--slow-gpu|slow GPU|fault rank")
_add("simulate", SIM, "--degrade-nic", ["0:-1", "0:nan"], "--degrade-nic|degraded nic")
_add("simulate", SIM, "--tol", ["-1", "nan"], "--tol|tol")
_add("simulate", SIM, "--topology", ["{in}", "no-such-topology", "{in}/missing.toml"], "--topology|topology")
_add("simulate", SIM, "--gen", ["maxvio=1,nope=3", "tokens-per-rank=1000000000", "maxvio=-1", "tokens-per-rank=0",
                                "maxvio=inf", "model=nope"], "--gen|generator spec|maxvio|model")
_add("simulate", ["simulate", "--trace", "{in}/t.safetensors", "--strategy", "alltoall", "--ranks", "2"], "--layers",
     ["5-2", "a", "99"])
_add("plan", ON_TRACE["plan"], "--layer", ["99"], "--layer|layer")
_add("compare", CMP, "--layers", ["5-2", "a"])
_add("compare", [*CMP, "--real"], "--nproc", ["0", "1000"], "--nproc")
_add("sweep", SWEEP, "--ranks", ["0", "-8", "1000000000"])
_add("sweep", SWEEP, "--tokens-per-rank", ["0", "1000000000", "-5"])
_add("sweep", SWEEP, "--values", ["a", "", "inf"], "--values|maxvio")
_add("sweep", SWEEP, "--over", ["nope"])
_add("sweep", SWEEP, "--maxvio", ["-1", "nan"], "--maxvio|maxvio")
_add("sweep", SWEEP, "--opt", ["alltoall.dedup=maybe", "moonep.nope=1"], "--opt|option|dedup")
# the generator's own words name the quantity (tokens, num_experts, ...) as the library spells it
_add("trace gen", GENT, "--tokens", ["0", "-5", "1000000000000", "x"], "--tokens|tokens")
_add("trace gen", GENT, "--num-experts", ["-4", "0", "1000000000"], "--num-experts|num_experts")
_add("trace gen", GENT, "--top-k", ["0", "9"], "--top-k|top_k")
_add("trace gen", GENT, "--layers", ["0", "1000000"], "--layers|layers")
_add("trace gen", GENT, "--steps", ["0", "-1"], "--steps|steps")
_add("trace gen", GENT, "--drift", ["2", "nan"], "--drift|drift")
_add("trace import", IMPORT, "--num-experts", ["-4", "0", "1000000000"])
_add("trace import", IMPORT, "--top-k", ["0", "-1"])
_add("trace import", IMPORT, "--warmup-min-rows", ["-5"])
_add("trace import", IMPORT, "--capture-min-rows", ["-1"])
_add("trace import", IMPORT, "--dominant-share", ["0", "2", "nan"])
_add("trace inspect", INSPECT, "--ranks", ["0", "-2", "1000000000"], "--ranks|ranks")
_add("trace inspect", INSPECT, "--layers", ["5-2", "a"])
_add("trace inspect", INSPECT, "--top", ["-1"])
_add("trace route", ROUTE, "--synthetic", ["0", "1000000000000"], "--synthetic|tokens")
_add("trace route", ROUTE, "--top-k", ["0", "9"])
_add("trace route", ROUTE, "--groups", ["0"])
_add("trace route", [*ROUTE, "--mode", "group"], "--groups", ["3"], "--groups|groups")
_add("trace route", ROUTE, "--bias-update", ["nan", "-1"])
_add("trace route", ROUTE, "--skew", ["inf"])
_add("trace route", ROUTE, "--bias-rounds", ["-1"])


def _inputs(d: Path) -> None:
    """Small valid inputs the base commands read."""
    from moonep_sim.routing.generators import generate_trace

    np.save(d / "ids.npy", np.array([[0, 1], [1, 2], [2, 3], [3, 0]]))
    generate_trace(d / "t.safetensors", 8, 2, 64, 1, layers=2, maxvio=1.0)


def argument_cases(Case) -> list:
    out = []
    seen: dict[str, int] = {}
    for name, base, arg, value, names in TABLE:
        argv = list(base)
        if arg in argv:
            argv[argv.index(arg) + 1] = value
        else:
            argv += [arg, value]
        key = f"args-{name.replace(' ', '-')}{arg}={value or 'empty'}"
        seen[key] = seen.get(key, 0) + 1
        if seen[key] > 1:
            key += f"-{seen[key]}"

        def make(d: Path, argv=argv) -> list[str]:
            _inputs(d)
            return list(argv)
        out.append(Case(key, "arguments", make, names))
    return out


# eplb's history file and redundant slots
EPLB = ["simulate", "--gen", GEN, "--strategy", "eplb", "--ranks", "2"]


def _eplb_case(name: str, opt: str, setup, names: str):
    def make(d: Path, opt=opt, setup=setup) -> list[str]:
        setup(d)
        return [*EPLB, "--opt", opt]
    return (name, make, names)


def _npz(d: Path, n: int) -> None:
    np.savez(d / "h.npz", **{f"a{i}": np.ones((2, 8)) for i in range(n)})


EPLB_CASES = [
    _eplb_case("history-empty-npz", "history={in}/h.npz", lambda d: _npz(d, 0), "history"),
    _eplb_case("history-two-arrays", "history={in}/h.npz", lambda d: _npz(d, 2), "history"),
    _eplb_case("history-fifo", "history={in}/h.npy", lambda d: __import__("os").mkfifo(d / "h.npy"), "history"),
    _eplb_case("history-dir", "history={in}", lambda d: None, "history"),
    _eplb_case("history-text", "history={in}/h.npy", lambda d: (d / "h.npy").write_text("1,2,3"), "history"),
    _eplb_case("history-shape", "history={in}/h.npy", lambda d: np.save(d / "h.npy", np.ones(3)), "history"),
    _eplb_case("num-redundant-1e9", "num_redundant=1000000000", lambda d: None, "num_redundant"),
    _eplb_case("num-redundant-negative", "num_redundant=-5", lambda d: None, "num_redundant"),
    _eplb_case("groups-negative", "groups=-1", lambda d: None, "groups"),
]

_argument_cases = argument_cases


def argument_cases(Case) -> list:  # noqa: F811 -- the table's cases, then eplb's
    return _argument_cases(Case) + [Case(f"args-eplb-{n}", "arguments", mk, names) for n, mk, names in EPLB_CASES]
