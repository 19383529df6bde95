"""`moonep-sim compare --topology a,b,...`: the same compare on each cluster, one table
(moonep_sim.experiments.clusters, moonep_sim.report.clusters)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moonep_sim.cli import main
from moonep_sim.experiments import Scenario
from moonep_sim.experiments.clusters import (compare_clusters, native_impl, native_kernels, parse_topologies,
                                             winner_change)
from moonep_sim.errors import ConfigError
from moonep_sim.plan.kernel import FAMILIES
from moonep_sim.sim.topology import list_topologies

GEN = "gen:model=olmoe-1b-7b,maxvio=4,tokens-per-rank=32,seed=3"   # E=64: EP16 = 2 nodes of 8
CLUSTERS = ["h800-cx7", "h200-efa", "mi300x-cx7"]
STRATS = "alltoall,deepep,costaware"
BASE = ["compare", "--trace", GEN, "--ranks", "16", "--strategies", STRATS, "--no-plots"]


@pytest.fixture(scope="module")
def multi(tmp_path_factory):
    d = tmp_path_factory.mktemp("clusters")
    assert main([*BASE, "--topology", ",".join(CLUSTERS), "--out", str(d / "o"), "--json", str(d / "c.json")]) == 0
    return json.loads((d / "c.json").read_text()), d


def _single(tmp_path, topology, impl):
    out = tmp_path / f"single-{topology}.json"
    assert main([*BASE, "--topology", topology, "--opt", f"deepep.impl={impl}", "--out", str(tmp_path / topology),
                 "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_one_row_per_cluster_in_the_order_given(multi):
    doc, d = multi
    assert doc["kind"] == "clusters" and doc["topologies"] == CLUSTERS and doc["strategies"] == STRATS.split(",")
    (p,) = doc["points"]
    assert [r["topology"] for r in p["clusters"]] == CLUSTERS
    assert all(set(r["layer_time_us"]) == set(doc["strategies"]) and r["ranks"] == 16 and r["nodes"] == 2
               for r in p["clusters"])
    assert (d / "o" / "clusters.json").read_text() == (d / "c.json").read_text()  # --out holds the same document


def test_rows_equal_single_topology_compares(multi, tmp_path):
    doc, _ = multi
    reps = []
    for r in doc["points"][0]["clusters"]:
        rep = _single(tmp_path, r["topology"], r["kernels"]["deepep"]["impl"])
        reps.append(rep)
        assert r["layer_time_us"] == {n: s["sim"]["layer_time_us_mean"] for n, s in rep["strategies"].items()}
        v = rep["verdict"]
        assert (r["verdict"]["winner"], r["verdict"]["runner_up"], r["verdict"]["tie"], r["verdict"]["mechanism"],
                r["verdict"]["why"]) == (v["winner"], v["runner_up"], v["tie"], v["mechanism"], v["why"])
        assert r["verdict"]["margin"] == v["margin"] and r["verdict"]["confidence"] == v["confidence"]["level"]
    # the same routing on every cluster: the same layer, and alltoall (topology-blind) receives the same rows
    assert all(rep["routing"] == reps[0]["routing"] for rep in reps)
    assert all(rep["strategies"]["alltoall"]["rows_per_rank_mean"] == reps[0]["strategies"]["alltoall"]
               ["rows_per_rank_mean"] for rep in reps)
    assert doc["points"][0]["routing"] == reps[0]["routing"]


def test_deepep_runs_each_clusters_native_family_unless_given(multi, tmp_path):
    doc, _ = multi
    got = {r["topology"]: r["kernels"]["deepep"] for r in doc["points"][0]["clusters"]}
    assert {t: k["impl"] for t, k in got.items()} == {"h800-cx7": "deepep-v1", "h200-efa": "uccl-ep",
                                                      "mi300x-cx7": "mori"}
    assert all(k["source"] == "native" and k["reason"] == native_impl(t)[1] for t, k in got.items())
    # the non-V1 families are flagged as resting on assumed terms
    assumed = {(f["topology"], f["strategy"]) for f in doc["flags"] if f["code"] == "assumed-kernel-terms"}
    assert assumed == {("h200-efa", "deepep"), ("mi300x-cx7", "deepep")}
    out = tmp_path / "given.json"
    assert main([*BASE, "--topology", "h800-cx7,mi300x-cx7", "--opt", "deepep.impl=deepep-v2", "--out",
                 str(tmp_path / "o"), "--json", str(out)]) == 0
    g = json.loads(out.read_text())
    ks = [r["kernels"]["deepep"] for r in g["points"][0]["clusters"]]
    assert [(k["impl"], k["source"]) for k in ks] == [("deepep-v2", "given")] * 2
    # DeepEP V2 on AMD is a setting no library runs: flagged, and only there
    assert {(f["topology"], f["strategy"]) for f in g["flags"] if f["code"] == "kernel-not-native"} >= {
        ("mi300x-cx7", "deepep")}
    assert not any(f["topology"] == "h800-cx7" and f["code"] == "kernel-not-native" for f in g["flags"])


def test_the_table_prints_a_row_per_cluster_and_the_winner_line(tmp_path, capsys):
    assert main([*BASE, "--topology", "h800-cx7,h200-efa", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "does the winner change?" in out
    line = next(x for x in out.splitlines() if x.strip().startswith("generated olmoe-1b-7b"))
    assert ("the winner changes with the cluster" in line) != ("the same winner on every cluster" in line)
    assert sum(x.lstrip("│ ").startswith(("h800-cx7 (", "h200-efa (")) for x in out.splitlines()) == 2


def test_json_to_stdout(tmp_path, capsys):
    assert main([*BASE, "--topology", "h800-cx7,h200-efa", "--out", str(tmp_path / "o"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= {"kind", "topologies", "strategies", "ranks", "points", "flags", "native_kernels"}
    (p,) = doc["points"]
    assert set(p) >= {"label", "routing", "model", "clusters", "winner_change"}
    r = p["clusters"][0]
    assert set(r) >= {"topology", "preset", "gpus_per_node", "nodes", "nvlink_GBps", "nic_GBps", "tflops", "kernels",
                      "layer_time_us", "verdict", "strategies", "flags", "constants"}
    assert set(r["verdict"]) == {"winner", "runner_up", "margin", "tie", "tied_with", "mechanism", "confidence", "why"}
    assert set(p["winner_change"]) == {"winners", "changes"}
    from moonep_sim.analysis.flags import FLAG_CODES
    assert doc["flags"] and {f["code"] for f in doc["flags"]} <= set(FLAG_CODES)
    assert all(set(f) == {"code", "strategy", "text", "topology"} for f in doc["flags"])


@pytest.mark.parametrize("topos, names", [("h800-cx7,nope", ["'nope'", "entry 2 of 2"]),
                                          ("nope,h800-cx7", ["'nope'", "entry 1 of 2"]),
                                          ("h800-cx7,h800-cx7", ["h800-cx7 twice"]),
                                          ("h800-cx7,", ["none empty"])])
def test_a_bad_entry_is_one_line_and_exit_2(topos, names, tmp_path, capsys):
    assert main([*BASE, "--topology", topos, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and all(n in err for n in names)
    assert not (tmp_path / "o").exists()


def test_real_and_step_level_take_one_topology(tmp_path, capsys):
    assert main([*BASE, "--topology", "h800-cx7,h200-efa", "--real", "--out", str(tmp_path / "o")]) == 2
    assert "--real applies to one --topology only" in capsys.readouterr().err


def test_single_topology_json_switch_unchanged(tmp_path, capsys):
    assert main([*BASE, "--topology", "h800-cx7", "--out", str(tmp_path / "o"), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["kind"] == "compare" and rep["topology"]["name"] == "h800-cx7"
    assert rep["strategies"]["deepep"]["options"] == {}  # no native family substituted for one topology


def test_native_table_covers_every_preset_with_a_family_that_runs_there():
    nat = native_kernels()
    assert set(nat) == set(list_topologies()) - {"local-gloo"}
    for p, n in nat.items():
        fam, ll = FAMILIES[n.impl], FAMILIES[n.ll_impl]
        assert (fam.mode, ll.mode) == ("normal", "ll") and n.reason
        for f in (fam, ll):
            assert f.vendor == n.vendor, p
            assert n.transport in f.transports or n.transport == "none", p


def test_winner_change_names_ties_and_changes():
    def row(t, w, r, tie=False):
        return {"topology": t, "verdict": {"winner": w, "runner_up": r, "tie": tie, "tied_with": [r] if tie else []}}
    same = winner_change([row("a", "x", "y"), row("b", "x", "z")])
    assert same == {"winners": [{"call": "x", "topologies": ["a", "b"]}], "changes": False}
    ch = winner_change([row("a", "x", "y"), row("b", "x", "y", tie=True)])
    assert ch["changes"] and [w["call"] for w in ch["winners"]] == ["x", "tie of x and y"]


def test_parse_topologies_and_api_labels():
    assert parse_topologies(" a , b ") == ["a", "b"]
    with pytest.raises(ConfigError, match="twice"):
        parse_topologies("a,a")
    sc = [Scenario(routing=f"gen:model=olmoe-1b-7b,maxvio={mv},tokens-per-rank=16", cluster=16,
                   strategies=["alltoall", "deepep"]) for mv in (1, 6)]
    doc = compare_clusters(sc, ["h800-cx7", "gb200-nvl72"], labels=["maxvio 1", "maxvio 6"])
    assert [p["label"] for p in doc["points"]] == ["maxvio 1", "maxvio 6"]
    assert [r["gpus_per_node"] for r in doc["points"][0]["clusters"]] == [8, 16]  # NVL72: EP16 in one domain
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        from cluster_compare import clusters_markdown   # the results page's writer (docs/results/clusters.md)
    finally:
        sys.path.pop(0)
    md = clusters_markdown(doc, dict(date="d", commit="c", command="x", uptime="u", wall_s=1.0, cpu_s=1.0))
    assert md.count("| maxvio ") == 4 and "## Does the winner change?" in md


def test_json_out_over_a_topology_file_is_refused(tmp_path, capsys):
    from importlib import resources

    topo = tmp_path / "mine.toml"
    topo.write_text((resources.files("moonep_sim.data") / "topology-h800-cx7.toml").read_text())
    assert main([*BASE, "--topology", f"h200-efa,{topo}", "--out", str(tmp_path / "o"), "--json", str(topo)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(topo) in err
    assert not (tmp_path / "o").exists()


def test_low_latency_runs_its_native_family_and_a_listless_topology_its_default(tmp_path):
    from importlib import resources

    from moonep_sim.experiments.clusters import cluster_scenarios

    other = tmp_path / "other.toml"  # a TOML file of a name the native table does not list
    other.write_text((resources.files("moonep_sim.data") / "topology-h800-cx7.toml").read_text()
                     .replace('name = "h800-cx7"', 'name = "my-cluster"'))
    sc = Scenario(routing="gen:model=olmoe-1b-7b,tokens-per-rank=16", cluster=16,
                  strategies=["deepep", "deepep-ll"], options={"deepep": {"sms": 20}})
    got = {t: (s.options, k) for t, s, k in cluster_scenarios(sc, ["mi300x-cx7", "h100-efa", str(other)])}
    opts, k = got["mi300x-cx7"]
    assert opts == {"deepep": {"sms": 20, "impl": "mori"}, "deepep-ll": {"impl": "mori-ll"}}
    assert got["h100-efa"][0]["deepep-ll"] == {"impl": "uccl-ep-ll"}
    opts, k = got[str(other)]
    assert opts == {"deepep": {"sms": 20, "impl": "deepep-v1"}, "deepep-ll": {"impl": "deepep-v1-ll"}}
    assert k["deepep"]["source"] == "default" and "my-cluster is not in" in k["deepep"]["reason"]
