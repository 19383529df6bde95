"""Helpers shared by subcommands: JSON output, option parsing, the shared flags (progress:
:func:`moonep_sim.progress.tracker`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Iterable, Mapping, Sequence

from moonep_sim.errors import ConfigError
from moonep_sim.io import to_jsonable

def print_json(obj: Any) -> None:
    """``obj`` as strict JSON on stdout (no ``NaN``/``Infinity``: :func:`moonep_sim.io.dumps_strict`)."""
    from moonep_sim.io import dumps_strict

    sys.stdout.write(dumps_strict(obj, indent=2, sort_keys=False) + "\n")


# -- the output rule: no output over an input -------------------------------------------------------
#: Argument names (argparse ``dest``) that name input files, with the flag a message shows.
INPUT_ARGS: dict[str, str] = {
    "trace": "--trace", "src": "SRC", "file": "FILE", "model": "--model", "topology": "--topology",
    "base_topology": "--base-topology", "compute_profile": "--compute-profile", "calibration": "--calibration",
    "bias_file": "--bias-file", "traces_dir": "--traces-dir", "config": "--config", "history": "--history",
}


def flag_of(dest: str, out_flag: str = "--out") -> str:
    """The flag a message names for the argparse ``dest`` (``out`` is ``-o`` or ``--out`` per command)."""
    return out_flag if dest == "out" else "--" + dest.replace("_", "-")


def output_rule(args, files: Iterable[str] = (), folders: Mapping[str, Sequence[str]] | None = None,
                inputs: Mapping[str, Any] | None = None, out_flag: str = "--out",
                also: Mapping[str, Any] | None = None) -> None:
    """The one output rule (docs/failures.md), called by every command that writes before any work:

        output_rule(args, files=("timeline",), folders={"out": ("report.json", "*.png")})

    files: the ``dest`` names of output-file arguments (a value that is not a string, such as a
    ``--json`` switch, is not a path); folders: ``dest`` of each output-folder argument -> the names
    (or glob patterns) of the files the command writes inside. Every input is compared with them
    by device and inode (links followed): the arguments of :data:`INPUT_ARGS` found on ``args``, every
    ``--opt`` value that names an existing file (eplb's ``history=``), and ``inputs`` (flag -> path).
    ``also``: further output files the command derives (flag words -> path). Refused with one line
    naming both; see :func:`moonep_sim.io.check_outputs`."""
    from moonep_sim.io import check_outputs

    ins: dict[str, Any] = {}
    for dest, flag in INPUT_ARGS.items():
        v = getattr(args, dest, None)
        if isinstance(v, (str, os.PathLike)) and not str(v).startswith("gen:"):
            ins[flag] = v
    for o in getattr(args, "opt", None) or []:
        if isinstance(o, str) and "=" in o:
            k, v = o.split("=", 1)
            if v.strip() and os.path.exists(v.strip()):
                ins[f"--opt {k.strip()}"] = v.strip()
    ins.update(inputs or {})
    outs = {flag_of(d, out_flag): getattr(args, d, None) for d in files}
    outs.update(also or {})
    outs = {k: v for k, v in outs.items() if isinstance(v, (str, os.PathLike)) and str(v) != "-"}  # '-': stdout
    fold = {flag_of(d, out_flag): (getattr(args, d, None), tuple(names)) for d, names in (folders or {}).items()}
    check_outputs(outs, ins, {k: v for k, v in fold.items() if isinstance(v[0], (str, os.PathLike))})


def check_int(value: int | None, flag: str, lo: int, hi: int, meaning: str = "") -> None:
    """Refuse an explicitly given integer argument outside [lo, hi] (None: not given, the default applies)."""
    if value is not None and not lo <= value <= hi:
        raise ConfigError(f"{flag} ({value}) must be in [{lo}, {hi}]" + (f": {meaning}" if meaning else ""))


def check_cluster_args(args, gpus_min: int = 1) -> None:
    """--ranks and --gpus-per-node as given (0 is not "the default": leave the flag out for that)."""
    from moonep_sim.limits import MAX_RANKS

    check_int(getattr(args, "ranks", None), "--ranks", 1, MAX_RANKS, "EP ranks")
    check_int(getattr(args, "gpus_per_node", None), "--gpus-per-node", gpus_min, MAX_RANKS,
              "GPUs per node" + (" (0: all ranks in one node)" if gpus_min == 0 else ""))


# -- shared flags: one spelling, one meaning, everywhere ----------------------------------------------
def add_dispatch_dtype(p, default: str = "bf16") -> None:
    """``--dispatch-dtype bf16|fp8`` (``--dtype`` and ``bfloat16`` still accepted)."""
    p.add_argument("--dispatch-dtype", "--dtype", dest="dispatch_dtype", default=default, type=_sim_dtype,
                   choices=("bf16", "fp8"), help=f"dispatched row dtype (default {default}; bfloat16 = bf16; "
                                                 "--dtype is an older spelling)")


def add_redundant_experts(p) -> None:
    """``--redundant-experts N``: E + N expert slots, the EP size dividing them."""
    p.add_argument("--redundant-experts", type=int, default=0, metavar="N",
                   help="N redundant expert slots (serving: E + N slots over the ranks, which must divide them, e.g. "
                        "256 + 32 over 72 or 144; eplb places the replicas from load; default 0)")


def _sim_dtype(text: str) -> str:
    """argparse's type for ``--dispatch-dtype``: a refusal is its own message, not argparse's "invalid
    _sim_dtype value"."""
    from argparse import ArgumentTypeError

    from moonep_sim.errors import ConfigError
    from moonep_sim.experiments.spec import normalise_dtype

    try:
        return normalise_dtype(text)
    except ConfigError as e:
        raise ArgumentTypeError(str(e)) from None


def add_strategies(p, default: str) -> None:
    p.add_argument("--strategies", default=default,
                   help=f"comma-separated strategies (default {default}; `moonep-sim strategies` lists them "
                        "with their options)")
    p.add_argument("--opt", action="append", default=[], metavar="STRATEGY.KEY=VALUE",
                   help="a strategy option, e.g. capacity.cf=1.25 (repeatable)")


def add_output_flags(p, *, out_default: str | None = None, out_help: str = "write the report (report.json, plots, "
                     "report.html) under DIR", plots: bool = True, json_help: str = "the JSON result") -> None:
    """The output flags every costing command shares (simulate, compare, sweep, step, serve):

    - ``--json [FILE]``: the JSON result on stdout instead of the table, or written to FILE (the
      table still printed);
    - ``--out DIR``: the report folder;
    - ``--no-plots``: the report without its PNG plots;
    - ``--quiet``: no progress display (the result is unchanged).

    ``--json -`` (stdout), the older spelling of a bare ``--json``, still works for one release
    with a deprecation line on stderr. Read them back with :func:`json_target`."""
    p.add_argument("--json", nargs="?", const=None, default=None, metavar="FILE", action=_JsonAction,
                   help=f"{json_help}: on stdout (instead of the table), or written to FILE")
    p.add_argument("--out", default=out_default, metavar="DIR",
                   help=out_help + (f" (default {out_default})" if out_default else ""))
    if plots:
        p.add_argument("--no-plots", action="store_true", help="with --out: skip the PNG plots")
    p.add_argument("--quiet", "-q", action="store_true",
                   help="no progress display (the table, the JSON and the files are unchanged)")


class _JsonAction(argparse.Action):
    """``--json [FILE]``: a bare flag is ``"-"`` (stdout); ``--json -`` says it is deprecated."""

    def __call__(self, parser, namespace, values, option_string=None):
        if values == "-":
            print("moonep-sim: deprecated: --json - is now a bare --json (stdout); '-' stops working in the next "
                  "release", file=sys.stderr, flush=True)
        setattr(namespace, self.dest, "-" if values is None else values)


def json_target(args) -> str | None:
    """Where ``--json`` goes: None (not given), ``"-"`` (stdout) or a file path."""
    v = getattr(args, "json", None)
    if v is None or v is False:
        return None
    return "-" if v is True else str(v)


def emit_json(args, doc: Any, lenient: bool = False, stdout_indent: int = 1) -> bool:
    """``doc`` as strict JSON where ``--json`` says (written atomically to a file, or on stdout
    indented by ``stdout_indent``); True when it went to stdout (the table is then left out).
    ``lenient``: a NaN becomes null (:func:`moonep_sim.io.to_jsonable`) instead of refusing."""
    from moonep_sim.io import dumps_strict, write_text_atomic

    dest = json_target(args)
    if dest is None:
        return False

    def text(indent: int) -> str:
        return json.dumps(to_jsonable(doc, lenient=True), indent=indent) if lenient else dumps_strict(doc, indent=indent)

    if dest == "-":
        sys.stdout.write(text(stdout_indent) + "\n")
        return True
    write_text_atomic(dest, text(1), what="--json")
    return False


def add_layers(p, default_text: str = "all of the trace") -> None:
    p.add_argument("--layers", default=None, help=f"layer ids, e.g. 0,5-7 (default: {default_text})")


def add_steps(p) -> None:
    p.add_argument("--steps", default=None, metavar="SEL",
                   help="steps of the trace, each costed as its own batch and aggregated over steps (token-weighted "
                        "mean, median, p90, worst): N, A-B, A-, a comma list (default: every step); merged or "
                        "merged:SEL costs them as one concatenated batch (with a warning)")


def print_warnings(warnings) -> None:
    """Each of a result's warnings as one line on stderr (stdout stays the table or the JSON)."""
    for w in warnings or ():
        print(f"moonep-sim: warning: {w}", file=sys.stderr, flush=True)


def steps_footer(rep: dict) -> list[str]:
    """Lines on the per-step aggregates of a compare report (none for a single batch)."""
    st = rep.get("steps") or {}
    n = len(st.get("costed_step_ids") or [])
    if n <= 1:
        return []
    rows = rep["strategies"]
    agg = {k: v["steps_aggregate"]["layer_time_us"] for k, v in rows.items()}
    order = sorted(agg, key=lambda k: (bool(rows[k]["dropped"]), agg[k]["token_weighted_mean"]))
    out = [f"per step ({n} steps of {sum(st['costed_tokens'])} tokens, each its own batch): layer time us "
           "token-weighted mean / median / p90 / worst (step)"]
    for k in order:
        a = agg[k]
        out.append(f"  {k}: {a['token_weighted_mean']:,.1f} / {a['median']:,.1f} / {a['p90']:,.1f} / "
                   f"{a['worst']:,.1f} (step {a['worst_step']}); fastest in {st['wins'].get(k, 0)} of {n} steps")
    out.append(f"fastest by the token-weighted mean over steps: {order[0]}" +
               (" (strategies that dropped rows are listed after the dropless ones)" if rows[order[0]]["dropped"] else ""))
    return out


def console():
    from rich.console import Console
    return Console()
