"""Sweep points in worker processes and on a Dask cluster: the same report as a serial run."""

from __future__ import annotations

import pytest

from moonep_sim.experiments import Scenario
from moonep_sim.experiments.parallel import run_points

TIMING = ("plan_seconds", "sim_seconds")


def _square(x):
    return x * x


def _without_timings(rep):
    rep = dict(rep)
    rep.pop("seconds", None)
    rep["strategies"] = {n: {k: v for k, v in s.items() if k not in TIMING} for n, s in rep["strategies"].items()}
    return rep


def _scenario():
    return Scenario(routing="gen:model=olmoe-1b-7b,tokens-per-rank=64", cluster="16/8", strategies="alltoall,moonep")


def test_run_points_keeps_item_order_and_reports_progress():
    seen = []
    out = run_points(_square, [3, 1, 2, 5], jobs=2, progress=lambda label, done, total: seen.append((done, total)))
    assert out == [9, 1, 4, 25]
    assert seen[-1] == (4, 4) and sorted(d for d, _ in seen)[-4:] == [1, 2, 3, 4]
    assert run_points(_square, [3, 1], jobs=1) == [9, 1]


def test_run_points_refuses_zero_jobs():
    with pytest.raises(Exception, match=r"--jobs \(0\) must be >= 1"):
        run_points(_square, [1, 2], jobs=0)


def test_sweep_in_worker_processes_matches_serial():
    values = [0.5, 1.0, 3.0]
    serial = _scenario().sweep(over="maxvio", values=values, jobs=1).to_dict()
    parallel = _scenario().sweep(over="maxvio", values=values, jobs=2).to_dict()
    assert _without_timings(parallel) == _without_timings(serial)
    assert len(parallel["strategies"]["moonep"]["sim_seconds"]) == 3


@pytest.mark.parametrize("over, values", [("ep", [8.0, 16.0]), ("nic_bandwidth_GBps", [25.0, 50.0])])
def test_staged_sweep_over_ep_and_a_topology_constant_matches_serial(over, values):
    # worker processes run routing per value, then one task per (value, strategy)
    serial = _scenario().sweep(over=over, values=values, jobs=1).to_dict()
    parallel = _scenario().sweep(over=over, values=values, jobs=2).to_dict()
    assert _without_timings(parallel) == _without_timings(serial)
    assert [p["value"] for p in parallel["points"]] == values


def test_sweep_on_a_local_dask_cluster_matches_serial():
    distributed = pytest.importorskip("distributed", reason="the cluster extra (Dask distributed) is not installed")
    values = [0.5, 3.0]
    serial = _scenario().sweep(over="maxvio", values=values, jobs=1).to_dict()
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as lc:
        remote = _scenario().sweep(over="maxvio", values=values, cluster=lc.scheduler_address).to_dict()
    assert _without_timings(remote) == _without_timings(serial)


def test_cluster_address_unreachable_is_one_clear_error():
    pytest.importorskip("distributed", reason="the cluster extra (Dask distributed) is not installed")
    with pytest.raises(Exception, match=r"--cluster \(tcp://127.0.0.1:9\) must be a reachable Dask scheduler"):
        run_points(_square, [1], cluster="tcp://127.0.0.1:9")


def test_sweep_cli_takes_jobs(tmp_path, capsys):
    from moonep_sim.cli import main

    rc = main(["sweep", "--model", "olmoe-1b-7b", "--over", "maxvio", "--values", "0.5,3", "--ranks", "16",
               "--tokens-per-rank", "64", "--strategies", "alltoall", "--jobs", "2", "--out", str(tmp_path / "s"),
               "--json"])
    assert rc == 0
    assert (tmp_path / "s" / "sweep.json").exists()
    rc = main(["sweep", "--model", "olmoe-1b-7b", "--over", "maxvio", "--values", "0.5", "--jobs", "0",
               "--out", str(tmp_path / "t")])
    assert rc == 2
    assert "--jobs (0) must be >= 1" in capsys.readouterr().err


def _compare_without_timings(rep):
    rep = dict(rep)
    rep.pop("seconds", None)
    out = {}
    for n, s in rep["strategies"].items():
        s = {k: v for k, v in s.items() if k not in ("plan_seconds", "layers")}
        out[n] = s
    layers = {n: [{k: v for k, v in e.items() if k != "plan"} | {"plan": {k: v for k, v in e["plan"].items()
                                                                           if k != "plan_seconds"}}
                  for e in s["layers"]] for n, s in rep["strategies"].items()}
    for n in layers:
        for e in layers[n]:
            e["sim"] = {k: v for k, v in e["sim"].items() if k not in ("sim_wall_seconds", "sim_stats")}
    rep["strategies"] = out
    rep["layers"] = layers
    return rep


def test_compare_in_worker_processes_matches_serial():
    sc = Scenario(routing="gen:model=olmoe-1b-7b,tokens-per-rank=64,layers=2", cluster="16/8",
                  strategies="alltoall,moonep,eplb")
    serial = sc.compare(jobs=1).to_dict()
    parallel = sc.compare(jobs=2).to_dict()
    assert _compare_without_timings(parallel) == _compare_without_timings(serial)
