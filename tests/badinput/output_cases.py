"""Output over input, for every command and every output flag (part of the bad-input corpus).

Generated as (command, output flag) x (input flag of that command) x (how the output reaches the
input: the same path, a symlink to it, a hard link to it). For an output folder, each file the
command writes inside is placed there as the input. Every case must be refused before any work,
in one line naming the output flag and the input flag, with the input unchanged."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
TOPO = REPO / "moonep_sim" / "data" / "topology-h800-cx7.toml"
MODEL = {"num_experts": 8, "top_k": 2, "hidden": 64, "expert_ffn": 32}


def _inputs(d: Path) -> dict[str, Path]:
    """The inputs, by file name, written into ``d``."""
    from moonep_sim.routing.generators import generate_trace

    generate_trace(d / "t.safetensors", 8, 2, 64, 1, layers=1, maxvio=1.0)
    (d / "m.json").write_text(json.dumps(MODEL))
    shutil.copy(TOPO, d / "b.toml")
    np.save(d / "ids.npy", np.array([[0, 1], [1, 2], [2, 3]]))
    np.save(d / "bias.npy", np.zeros(8))
    (d / "ops.csv").write_text("op,shape,time_us\n")
    return {}


SIM = ["simulate", "--trace", "T", "--strategy", "alltoall", "--ranks", "2", "--topology", "B", "--model", "M"]
SERVE = ["serve", "--trace", "T", "--topology", "B", "--model", "M", "--worker", "dp=2,ep=2", "--no-cache"]
# command -> (argv with T/M/B/I/S placeholders for inputs, {input flag: placeholder}, output flags)
FILE_OUTPUTS: dict[str, tuple[list[str], dict[str, str], list[str]]] = {
    "simulate": (SIM, {"--trace": "T", "--topology": "B", "--model": "M"}, ["--timeline", "--json"]),
    "step": (["step", "--trace", "T", "--topology", "B", "--model", "M", "--compute-profile", "P"],
             {"--trace": "T", "--topology": "B", "--model": "M", "--compute-profile": "P"}, ["--json", "--timeline", "--gantt"]),
    "trace-gen": (["trace", "gen", "--model", "M", "--tokens", "64", "--seed", "1", "--uniform"], {"--model": "M"}, ["-o"]),
    "trace-import": (["trace", "import", "I", "--model", "M"], {"SRC": "I", "--model": "M"}, ["-o"]),
    "trace-route": (["trace", "route", "T", "--mode", "bias", "--bias-file", "S"], {"SRC": "T", "--bias-file": "S"}, ["-o"]),
    "testbed-run": (["testbed", "run", "--trace", "T", "--base-topology", "B"], {"--trace": "T", "--base-topology": "B"},
                    ["--json", "--topology-out"]),
    "compare": (["compare", "--trace", "T", "--strategies", "alltoall", "--ranks", "2", "--topology", "B", "--model", "M",
                 "--no-plots"], {"--trace": "T", "--topology": "B", "--model": "M"}, ["--json"]),
    "sweep": (["sweep", "--model", "M", "--over", "maxvio", "--values", "1", "--strategies", "alltoall", "--topology", "B",
               "--no-plots"], {"--model": "M", "--topology": "B"}, ["--json"]),
    "testbed-probe": (["testbed", "probe", "--base-topology", "B"], {"--base-topology": "B"}, ["--topology-out"]),
    "testbed-agree": (["testbed", "agree", "--base-topology", "B"], {"--base-topology": "B"},
                          ["--json", "--markdown"]),
    "serve": (SERVE, {"--trace": "T", "--topology": "B", "--model": "M"}, ["--json"]),
}
FILES = {"T": "t.safetensors", "M": "m.json", "B": "b.toml", "I": "ids.npy", "S": "bias.npy", "P": "ops.csv"}

# command -> (argv, {input flag: placeholder}, the files --out holds)
FOLDER_OUTPUTS: dict[str, tuple[list[str], dict[str, str], tuple[str, ...]]] = {
    "compare": (["compare", "--trace", "T", "--strategies", "alltoall", "--ranks", "2", "--topology", "B", "--model", "M"],
                {"--trace": "T", "--topology": "B", "--model": "M"},
                ("report.json", "layer_time.png", "rows_per_rank.png", "traffic.png")),
    "sweep": (["sweep", "--model", "M", "--over", "maxvio", "--values", "1", "--strategies", "alltoall", "--topology", "B"],
              {"--model": "M", "--topology": "B"},
              ("sweep.json", "sweep.png", "winner.png", "winner.md", "winner.json")),
    "simulate": (SIM, {"--trace": "T", "--topology": "B", "--model": "M"}, ("report.json", "report.html", "layer_time.png")),
    "step": (["step", "--trace", "T", "--topology", "B", "--model", "M", "--compute-profile", "P"],
             {"--trace": "T", "--topology": "B", "--model": "M", "--compute-profile": "P"},
             ("report.json", "report.html", "step_time.png", "gantt.png")),
    "serve": (SERVE, {"--trace": "T", "--topology": "B", "--model": "M"},
              ("report.json", "report.html", "latency_cdf.png", "pareto.png")),
    "demo": (["demo", "--fast", "--topology", "B"], {"--topology": "B"},
             ("report.json", "layer_time.png", "rows_per_rank.png", "traffic.png")),
}

LINKS = {"same": None, "symlink": os.symlink, "hardlink": os.link}


def _fill(argv: list[str], d: Path, override: dict[str, str] | None = None) -> list[str]:
    over = override or {}
    return [over.get(a, str(d / FILES[a])) if a in FILES else a for a in argv]


def output_cases(Case) -> list:
    out = []
    for cmd, (argv, ins, flags) in FILE_OUTPUTS.items():
        for flag in flags:
            for iflag, ph in ins.items():
                for how, link in LINKS.items():
                    def make(d: Path, argv=argv, flag=flag, ph=ph, link=link) -> list[str]:
                        _inputs(d)
                        target = d / FILES[ph]
                        dest = target
                        if link is not None:
                            dest = d / f"link-{FILES[ph]}"
                            link(target, dest)
                        return [*_fill(argv, d), flag, str(dest)]
                    names = f"{flag}.*{iflag}|{iflag}.*{flag}"
                    out.append(Case(f"over-input-{cmd}{flag}-onto{iflag}-{how}", "output over input", make, names))
    for cmd, (argv, ins, held) in FOLDER_OUTPUTS.items():
        for iflag, ph in ins.items():
            for name in held:
                for how in ("same", "symlink"):
                    def make(d: Path, argv=argv, ph=ph, name=name, how=how) -> list[str]:
                        _inputs(d)
                        folder = d / "o"
                        folder.mkdir()
                        inside = folder / name
                        if how == "same":  # the input itself lies where the command writes
                            shutil.move(d / FILES[ph], inside)
                            return [*_fill(argv, d, {ph: str(inside)}), "--out", str(folder)]
                        os.symlink(d / FILES[ph], inside)  # a link in the folder leads to an input
                        return [*_fill(argv, d), "--out", str(folder)]
                    out.append(Case(f"over-input-{cmd}--out-{name}-is{iflag}-{how}", "output over input", make,
                                    f"--out.*{name}.*{iflag}"))
    # a folder given as an input (validate's --traces-dir) that is also the output folder
    for name in ("fidelity.json", "fidelity.png"):
        def make(d: Path, name=name) -> list[str]:
            _inputs(d)
            (d / "tr").mkdir()
            shutil.copy(d / "t.safetensors", d / "tr" / name)
            return ["validate", "--quick", "--traces-dir", str(d / "tr"), "--out", str(d / "tr")]
        out.append(Case(f"over-input-validate--out-{name}-in--traces-dir", "output over input", make,
                        f"--out.*{name}.*--traces-dir"))
    # two outputs of one command onto one file
    out.append(Case("over-output-testbed-run-json-is-topology-out", "output over input",
                    lambda d: (_inputs(d), ["testbed", "run", "--trace", str(d / "t.safetensors"), "--json",
                                            "{out}/x.json", "--topology-out", "{out}/x.json"])[1],
                    "--topology-out.*--json"))
    return out
