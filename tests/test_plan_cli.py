"""``moonep-sim plan``: JSON summary, rich table, model/row sizes, and one-line errors (exit 2)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import random_routing
from moonep_sim.cli import main
from moonep_sim.routing.trace import META_KEY, TraceMeta, write_trace
from moonep_sim.strategies import available


def _trace(path, T=96, K=2, E=8, model="mixtral-8x7b", layers=(0, 1), logits=False, seed=0):
    ids, w = zip(*(random_routing(T, K, E, seed=seed + i, skew=1.0) for i in range(len(layers))))
    tensors = {"topk_ids": np.stack(ids), "topk_weights": np.stack(w)}
    if logits:
        tensors["router_logits"] = np.random.default_rng(seed).normal(size=(len(layers), T, E)).astype(np.float32)
    write_trace(path, TraceMeta("tokens", E, K, list(layers), T, model=model), tensors)
    return str(path)


def _json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(available()))
def test_every_strategy_through_the_cli(tmp_path, capsys, name):
    t = _trace(tmp_path / "t.safetensors", E=16, K=4, model=None)
    s = _json(capsys, ["plan", "--trace", t, "--strategy", name, "--ranks", "8", "--gpus-per-node", "4",
                       "--layer", "1", "--token-padding", "4"])
    assert s["strategy"] == name and s["ranks"] == 8 and s["invariant_violations"] == []
    for k in ("recv_rows_per_rank", "dropped", "padded", "weight_copies", "plan_seconds"):
        assert k in s
    assert set(s["bytes"]) >= {"dispatch", "combine", "prefetch", "grad_reduce", "intra_node", "inter_node"}
    assert sum(s["recv_rows_per_rank"]) == 96 * 4 - s["dropped"]


def test_row_bytes_follow_the_model(tmp_path, capsys):
    t = _trace(tmp_path / "t.safetensors")
    base = ["plan", "--trace", t, "--strategy", "alltoall", "--ranks", "4", "--gpus-per-node", "2"]
    bf16 = _json(capsys, base)
    fp8 = _json(capsys, base + ["--dispatch-dtype", "fp8"])
    assert bf16["model"] == "mixtral-8x7b"
    rows = bf16["bytes"]["dispatch"] // (4096 * 2)  # remote rows, mixtral's 4096-wide bf16 rows
    assert rows > 0 and bf16["bytes"]["dispatch"] == rows * 8192
    assert fp8["bytes"]["dispatch"] == rows * (4096 + 4096 // 128 * 4)
    assert fp8["bytes"]["combine"] == bf16["bytes"]["combine"] == rows * 8192
    plain = _json(capsys, ["plan", "--trace", _trace(tmp_path / "u.safetensors", model=None), "--strategy",
                           "alltoall", "--ranks", "4"])
    assert plain["model"] == "custom"  # default shape: hidden 1024, 2048-byte bf16 rows
    assert plain["bytes"]["dispatch"] % 2048 == 0 and plain["bytes"]["dispatch"] > 0


def test_table_output(tmp_path, capsys):
    t = _trace(tmp_path / "t.safetensors")
    assert main(["plan", "--trace", t, "--strategy", "capacity", "--ranks", "4", "--opt", "cf=0.5"]) == 0
    out = capsys.readouterr().out
    assert "plan: capacity" in out and "dropped entries" in out and "cf=0.5" in out


def test_deepep_reroutes_from_logits_and_eplb_reads_history(tmp_path, capsys):
    t = _trace(tmp_path / "t.safetensors", T=64, K=4, E=16, model=None, logits=True)
    s = _json(capsys, ["plan", "--trace", t, "--strategy", "deepep", "--ranks", "8", "--gpus-per-node", "2",
                       "--opt", "max_nodes=2"])
    assert s["options"]["max_nodes_per_token"] <= 2 and s["invariant_violations"] == []
    np.save(tmp_path / "h.npy", np.arange(16, dtype=np.int64)[None].repeat(3, 0))
    s = _json(capsys, ["plan", "--trace", t, "--strategy", "eplb", "--ranks", "8", "--gpus-per-node", "2",
                       "--opt", f"history={tmp_path / 'h.npy'}", "--placement", "round-robin"])
    # no placement in force given: the new one is taken as in place, nothing is charged
    assert s["options"]["load_source"] == "history[3]" and s["migrations"] == 0
    np.save(tmp_path / "prev.npy", np.arange(16 + 8, dtype=np.int64) % 16)  # 3 slots per rank
    s = _json(capsys, ["plan", "--trace", t, "--strategy", "eplb", "--ranks", "8", "--gpus-per-node", "2",
                       "--opt", f"history={tmp_path / 'h.npy'}", "--opt", f"previous={tmp_path / 'prev.npy'}"])
    assert s["migrations"] > 0 and s["bytes"]["migrate"] > 0


def _bad_ids_trace(path, ids, E, K):
    """A trace whose metadata is fine but whose ids break the routing rules (write_trace refuses those)."""
    from safetensors.numpy import save_file
    meta = TraceMeta("tokens", E, K, [0], ids.shape[0], model=None)
    save_file({"topk_ids": ids[None].astype(np.int32), "topk_weights": np.ones((1,) + ids.shape, np.float32)},
              str(path), metadata={META_KEY: meta.to_json()})
    return str(path)


@pytest.mark.parametrize("make, extra, match", [
    (lambda p: _trace(p), ["--ranks", "8", "--gpus-per-node", "3"],
     r"--ranks \(8\) must be divisible by --gpus-per-node \(3\)"),
    (lambda p: _trace(p), ["--ranks", "3"], r"--ranks \(3\) must divide the routing's expert count \(E=8\)"),
    (lambda p: _trace(p), ["--ranks", "4", "--strategy", "capacity", "--opt", "cf=0"], r"cf \(0\) must be in \(0, 1024\]"),
    (lambda p: _trace(p), ["--ranks", "4", "--strategy", "nope"], r"strategy \('nope'\) must be one of"),
    (lambda p: _trace(p), ["--ranks", "4", "--opt", "colour=red"], r"option \('colour'\) must be one of"),
    (lambda p: _trace(p), ["--ranks", "4", "--layer", "7"], r"layers entry \(7\) must be one of the trace's layer ids"),
    (lambda p: _trace(p), ["--ranks", "4", "--model", "kimi-k3"], r"model \(kimi-k3: E=896, K=16\) must match the trace"),
    (lambda p: _bad_ids_trace(p, np.array([[0, 9], [1, 2]]), 8, 2), ["--ranks", "4"],
     r"token 0: topk_ids: expected ids in \[0, 8\), found \[0, 9\]"),
    (lambda p: _bad_ids_trace(p, np.array([[0, 1, 2]]), 2, 3), ["--ranks", "2"],
     r"top_k: expected an integer in \[1, num_experts=2\]"),
    (lambda p: str(p) + ".missing", ["--ranks", "4"], r"no such file"),
])
def test_bad_input_one_line_exit_2(tmp_path, capsys, make, extra, match):
    t = make(tmp_path / "t.safetensors")
    argv = ["plan", "--trace", t, "--strategy", "alltoall"] + extra
    if "--strategy" in extra:
        argv = ["plan", "--trace", t] + extra
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moonep-sim: error: ") and "\n" not in err
    import re
    assert re.search(match, err), err


def test_plan_topology_sets_the_rates_a_copy_pricing_planner_uses(tmp_path, capsys):
    t = _trace(tmp_path / "t.safetensors", E=16, K=4, model=None)
    argv = ["plan", "--trace", t, "--strategy", "costaware", "--ranks", "8", "--gpus-per-node", "4"]
    default = _json(capsys, argv)
    b200 = _json(capsys, argv + ["--topology", "b200"])
    assert default["options"]["rates"] == "h800-cx7" and b200["options"]["rates"] == "b200"
    assert b200["options"]["estimate_no_copy_us"] < default["options"]["estimate_no_copy_us"]  # faster links
    assert main(argv + ["--topology", "nope"]) == 2
    assert "topology ('nope') must be a preset" in capsys.readouterr().err


def test_commands_run_without_numpy_huge_page_advice(capsys):
    """The CLI turns numpy's huge-page advice off for its process (``moonep_sim.memory``): fresh
    huge pages made a plan's first run spend most of its time in the kernel."""
    import numpy as np

    from moonep_sim.cli import main

    ma = np._core.multiarray
    before = ma._get_madvise_hugepage()
    try:
        ma._set_madvise_hugepage(True)
        assert main(["strategies"]) == 0
        assert ma._get_madvise_hugepage() is False
    finally:
        ma._set_madvise_hugepage(before)
    capsys.readouterr()


_REFILL = """
import resource, sys
import numpy as np
from moonep_sim.memory import prefer_small_pages, reuse_freed_memory
prefer_small_pages()  # 4 KiB pages, as the CLI: one fault per page
took = reuse_freed_memory() if sys.argv[1] == "reuse" else False
a = np.ones(1 << 24)  # 128 MiB, more than glibc maps apart by default
del a
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
b = np.ones(1 << 24)
print(int(took), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def test_reuse_freed_memory_refills_freed_pages():
    """With ``reuse_freed_memory`` (what the CLI applies: ``moonep_sim.memory``) a freed large array's
    pages serve the next one of its size: refilling 128 MiB takes (almost) no fresh page faults,
    where glibc's default maps it fresh (32,768 faults of 4 KiB pages). In fresh processes: the
    setting lasts for the process."""
    import subprocess
    import sys

    def refill(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", _REFILL, mode], capture_output=True, text=True, timeout=120,
                             check=True).stdout.split()
        return int(out[0]), int(out[1])

    took, faults = refill("reuse")
    if not took:
        pytest.skip("the C library is not glibc: reuse_freed_memory changes nothing here")
    assert faults < 1000
    assert refill("default")[1] > 16000
