"""The layout flags of `moonep-sim step`, `compare --level step` and `sweep --level step`: a layout
step's table and JSON state the layout; bad layouts are one line, exit 2."""

from __future__ import annotations

import json

import pytest

from moonep_sim import cli

GEN = "model=olmoe-1b-7b,maxvio=1"
STEP = ["step", "--gen", GEN, "--strategies", "alltoall", "--distinct-layers", "1"]


def _status(argv, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("extra, match", [
    (["--tp", "2", "--dp", "2", "--gpus", "8"], r"tp x cp x dp x pp \(2 x 1 x 2 x 1 = 4\) must equal the GPUs \(8\)"),
    (["--pp", "32", "--gpus", "32"], r"pp x vpp \(32 x 1 = 32\) must be <= the layers \(16"),
    (["--ep", "3", "--dp", "3"], r"ep \(3\) must divide the expert slots \(64"),
    (["--tp", "3"], r"tp \(3\) must divide the attention heads \(16"),
    (["--pp", "2", "--vpp", "2", "--global-batch-size", "3", "--dp", "1"], r"micro-batches \(3\) must be a multiple of pp \(2\)"),
    (["--pp", "3", "--pp-schedule", "dualpipe"], r"pp \(3\) must be even for dualpipe"),
    (["--zero", "4"], r"--zero: invalid choice"),
    (["--tp", "0"], r"tp \(0\) must be an integer >= 1"),
    (["--dp", "4", "--ep", "4", "--ranks", "4"], r"--ranks \(4\) is a pure-EP step's EP size"),
    (["--gpus", "8"], r"--gpus applies to a layout"),
    (["--dp", "2", "--ep", "2", "--tokens-per-rank", "64"], r"tokens per rank \(64\) is set by the layout in train"),
    (["--sequence-parallel", "--dp", "2"], r"sequence parallel needs tp >= 2"),
    (["--overlap-moe-expert-parallel-comm", "--pp", "2", "--ep", "2", "--gpus", "4"],
     r"overlap_moe_expert_parallel_comm needs the interleaved pp schedule with vpp >= 2"),
    (["--dp", "2", "--ep", "2", "--gantt", "{tmp}/g.png"], r"--gantt .* not available under a layout"),
    (["--tp", "2", "--gpus", "7"], r"--gpus \(7\) must be a multiple of tp x cp x pp \(2\) to derive --dp"),
    (["--search", "--tp", "2", "--gpus", "8"], r"--tp is chosen by --search"),
    (["--search"], r"--search needs --gpus N"),
    (["--search", "--gpus", "8"], r"--distinct-layers \(1\) does not apply to --search"),
])
def test_bad_layout_flags_are_one_line(extra, match, capsys, tmp_path):
    rc, out, err = _status(STEP + [x.replace("{tmp}", str(tmp_path)) for x in extra], capsys)
    assert rc == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, err
    import re
    assert re.search(match, lines[0]), lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("extra, match", [
    (["--compute-profile", "p.csv"], r"--compute-profile \('p.csv'\) does not apply to --search"),
    (["--optimizer-shard", "2"], r"--optimizer-shard \(2\) does not apply to --search"),
    (["--mtp-depth", "1", "--mode", "decode"], r"--mtp-depth \(1\) does not apply to --search"),
    (["--static-buffer", "alltoall=8"], r"--static-buffer \(\['alltoall=8'\]\) does not apply to --search"),
])
def test_search_refuses_step_flags_it_does_not_price(extra, match, capsys):
    """A step flag the layout search does not price is refused in one line, never silently ignored."""
    rc, _, err = _status(["step", "--gen", GEN, "--strategies", "alltoall", "--search", "--gpus", "8"] + extra, capsys)
    import re
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and re.search(match, lines[0]), err


def test_compare_and_sweep_refuse_layout_flags_at_layer_level(capsys, tmp_path):
    rc, _, err = _status(["compare", "--trace", f"gen:{GEN},tokens-per-rank=64", "--strategies", "alltoall",
                          "--ranks", "2", "--no-plots", "--out", str(tmp_path / "c"), "--tp", "2"], capsys)
    assert rc == 2 and "--tp applies to --level step only" in err


def test_step_states_the_layout(capsys, tmp_path):
    out = tmp_path / "s.json"
    rc, text, err = _status(STEP + ["--tp", "2", "--pp", "2", "--dp", "2", "--ep", "4", "--global-batch-size", "8",
                                    "--context", "1024", "--json", str(out)], capsys)
    assert rc == 0, err
    doc = json.loads(out.read_text())
    s = doc["setup"]
    assert s["layout"] == "TP2 PP2 DP2 EP4" and s["gpus"] == 8 and s["parallel"]["micro_batches"] == 4
    assert s["ep_group_ranks"] == 4 and s["tokens_per_rank"] == 512
    f = doc["strategies"]["alltoall"]
    assert f["pipeline"]["schedule"] == "1f1b" and len(f["pipeline_ranks"]) == 2
    assert "TP2 PP2 DP2 EP4" in text


def test_step_takes_the_ep_a2a_overlap(capsys, tmp_path):
    out = tmp_path / "s.json"
    rc, text, err = _status(STEP + ["--pp", "2", "--vpp", "2", "--dp", "4", "--ep", "4", "--global-batch-size", "8",
                                    "--overlap-moe-expert-parallel-comm", "--context", "512", "--json", str(out)], capsys)
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert doc["setup"]["layout"] == "PP2x2 DP4 EP4 EP-a2a-overlap"
    assert doc["setup"]["parallel"]["overlap_moe_expert_parallel_comm"] is True
    assert doc["strategies"]["alltoall"]["pipeline"]["schedule"] == "combined-1f1b"
    assert "EP-a2a-overlap" in text


def test_compare_level_step_takes_the_layout(capsys, tmp_path):
    rc, text, err = _status(["compare", "--trace", f"gen:{GEN},tokens-per-rank=64", "--strategies", "alltoall",
                             "--ranks", "8", "--no-plots", "--out", str(tmp_path / "c"), "--level", "step",
                             "--distinct-layers", "1", "--context", "512", "--pp", "2", "--ep", "4"], capsys)
    assert rc == 0, err
    doc = json.loads((tmp_path / "c" / "report.json").read_text())
    assert doc["setup"]["layout"] == "PP2 DP4 EP4"


@pytest.mark.slow
def test_sweep_level_step_takes_the_layout(capsys, tmp_path):
    rc, _, err = _status(["sweep", "--model", "olmoe-1b-7b", "--over", "maxvio", "--values", "1,4", "--strategies",
                          "alltoall", "--ranks", "8", "--tokens-per-rank", "256", "--level", "step", "--pp", "2",
                          "--ep", "4", "--context", "1024", "--distinct-layers", "1", "--out", str(tmp_path / "s"),
                          "--json"], capsys)
    assert rc == 0, err
    rep = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert rep["step"]["parallel"]["pp"] == 2 and rep["step"]["parallel"]["dp"] == 4
    assert len(rep["strategies"]["alltoall"]["step_time_us"]) == 2


@pytest.mark.slow
def test_deepseek_v3_pretraining_layout_fits_in_80_gb_through_step(capsys, tmp_path):
    """DeepSeek-V3's published pretraining layout (PP16 DualPipe x DP128 x EP64, ZeRO-1, no TP, fp8
    GEMMs, bf16 Adam moments: 8 B/param, RMSNorm, MLA up-projections and the SwiGLU output
    recomputed; one 4096-token sequence per micro-batch, 15360 sequences per batch) through
    `moonep-sim step`: the layout step's memory is the layout account's (memory_for_layout) over the
    step's Plans; on routing as balanced as its auxiliary-loss-free training keeps it (maxvio 0.2,
    ASSUMED), the busiest rank fits the 79.6 GiB an 80 GB card reports."""
    from moonep_sim.models import get_model
    from moonep_sim.step import MemoryOptions, step_shape
    from moonep_sim.step.memory import memory_for_layout
    from moonep_sim.step.parallel import Parallel

    out = tmp_path / "ds.json"
    rc, _, err = _status(["step", "--gen", "model=deepseek-v3,maxvio=0.2", "--strategies", "deepep",
                          "--distinct-layers", "1", "--pp", "16", "--pp-schedule", "dualpipe", "--dp", "128",
                          "--ep", "64", "--zero", "1", "--global-batch-size", "15360", "--context", "4096",
                          "--gemm-dtype", "fp8", "--optimizer-bytes-per-param", "8",
                          "--recompute", "selective:layernorm,mla_up_proj,moe_act", "--json", str(out)], capsys)
    assert rc == 0, err
    doc = json.loads(out.read_text())
    f = doc["strategies"]["deepep"]
    GiB = 2**30
    assert not f["oom"] and f["peak_memory_bytes"] < 79.6 * GiB
    assert len(f["memory_per_pp_rank"]) == 16 and f["pipeline"]["schedule"] == "dualpipe"
    # one account: the balanced stand-in of the same layout and options is the floor of the step's
    m = get_model("deepseek-v3")
    par = Parallel(pp=16, dp=128, ep=64, zero=1, pp_schedule="dualpipe", global_batch_size=15360).check(2048, m)
    opts = MemoryOptions(gemm_dtype="fp8", optimizer_bytes_per_param=8, recompute="selective",
                         recompute_modules=("layernorm", "mla_up_proj", "moe_act"))
    bal = memory_for_layout(m, step_shape(m, "train", 4096, 4096), par, [], opts)
    assert bal["peak_bytes"] <= f["peak_memory_bytes"] < 1.1 * bal["peak_bytes"]
    for k in ("weights", "gradients", "optimizer"):   # the stage's static parts do not depend on the routing
        assert f["memory"]["stages"][0]["parts"][k] == pytest.approx(bal["stages"][0]["parts"][k])
    assert "fp8" in f["memory"]["assumptions"] and "layernorm, mla_up_proj, moe_act" in f["memory"]["assumptions"]
    # bf16 GEMMs, 12-byte Adam and nothing recomputed: out of memory, and the step names the smallest change that fits
    rc, text, err = _status(["step", "--gen", "model=deepseek-v3,maxvio=0.2", "--strategies", "deepep",
                             "--distinct-layers", "1", "--pp", "16", "--pp-schedule", "dualpipe", "--dp", "128",
                             "--ep", "64", "--global-batch-size", "15360", "--context", "4096",
                             "--json", str(out)], capsys)
    f = json.loads(out.read_text())["strategies"]["deepep"]
    assert rc == 0 and f["oom"] and f["fit"] and "recompute" in f["fit"]["change"]


@pytest.mark.parametrize("value, match", [("partial", r"--recompute \('partial'\) must be none, selective, full"),
                                          ("full:layernorm", r"modules must follow selective"),
                                          ("selective:attn", r"modules must follow selective: and be among")])
def test_bad_recompute_is_one_line(value, match, capsys):
    rc, _, err = _status(STEP + ["--recompute", value], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    import re
    assert re.search(match, err), err
