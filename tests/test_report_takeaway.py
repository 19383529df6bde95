"""Results you can take away (issue 21, item 6): ``save`` and ``plot`` on every result, short reprs
and a notebook view, one self-contained report.html (checked with the stdlib HTML parser, and in a
headless browser when one is installed), and plots that show ties, identical series and flags."""

from __future__ import annotations

import base64
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest

from conftest import TRACES
from moonep_sim.experiments import Scenario

MIXTRAL = TRACES / "mixtral-8x7b_humaneval.safetensors"
PNG = b"\x89PNG\r\n\x1a\n"


class _Doc(HTMLParser):
    """Tags, headings, image sources and text of a document; fails on unbalanced tags."""

    VOID = {"meta", "img", "br", "link", "hr", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.tags, self.imgs, self.h2, self.text, self._h = [], [], [], [], [], False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        a = dict(attrs)
        if tag == "img":
            self.imgs.append(a.get("src", ""))
        for k in ("src", "href"):
            assert not str(a.get(k, "")).startswith(("http:", "https:", "//")), "report.html fetches nothing"
        if tag not in self.VOID:
            self.stack.append(tag)
        self._h = tag == "h2"

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"unbalanced </{tag}> (open: {self.stack[-3:]})"
        self.stack.pop()
        self._h = False

    def handle_data(self, data):
        self.text.append(data)
        if self._h:
            self.h2.append(data.strip())


def _parse(path) -> _Doc:
    d = _Doc()
    d.feed(path.read_text())
    d.close()
    assert d.stack == [], f"unclosed tags {d.stack}"
    return d


@pytest.fixture(scope="module")
def compare_result():
    return Scenario(routing=str(MIXTRAL), cluster="4/2", strategies="alltoall,moonep,eplb", layers=[0, 1]).compare()


def test_compare_result_saves_json_plots_and_a_self_contained_html(compare_result, tmp_path):
    files = compare_result.save(tmp_path / "out", command="moonep-sim compare --trace t")
    for stem in ("layer_time", "rows_per_rank", "traffic"):
        assert (tmp_path / "out" / f"{stem}.png").read_bytes()[:8] == PNG
    doc = _parse(tmp_path / "out" / "report.html")
    assert doc.h2 == ["Verdict", "Flags", "Tables", "Plots", "How it was produced"]
    assert len(doc.imgs) == 3 and all(s.startswith("data:image/png;base64,") for s in doc.imgs)
    assert base64.b64decode(doc.imgs[0].split(",", 1)[1])[:8] == PNG
    text = " ".join(doc.text)
    v = compare_result.verdict
    assert v["winner"] in text and v["why"] in text and "mechanism" in text
    assert "oracle" in text and "outside-library" in text  # eplb's oracle, moonep across 2 nodes
    assert "moonep-sim compare --trace t" in text and "numpy" in text and "python" in text
    import json

    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    assert rep["verdict"] == json.loads(json.dumps(v)) and rep["files"]["html"] == files["html"]
    assert rep["provenance"]["command"] == "moonep-sim compare --trace t"


def test_plot_writes_only_what_is_asked(compare_result, tmp_path):
    out = compare_result.plot(tmp_path / "p", which=["traffic"])
    assert list(out) == ["traffic"] and out["traffic"].read_bytes()[:8] == PNG
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["traffic.png"]


def test_reprs_are_short_and_notebooks_get_html(compare_result):
    r = repr(compare_result)
    assert len(r) < 200 and "\n" not in r and r.startswith("CompareResult(kind=compare")
    assert "wins by" in r or "tie" in r
    assert "flag(s)" in r
    h = compare_result._repr_html_()
    assert h.lstrip().startswith("<!DOCTYPE html>") and "Verdict" in h


def test_every_result_kind_saves_and_plots(tmp_path):
    sc = Scenario(routing=str(MIXTRAL), cluster="4/4", strategies="alltoall,capacity", layers=[0])
    for name, res in (("plans", sc.plans()), ("simulate", sc.simulate())):
        files = res.save(tmp_path / name)
        _parse(tmp_path / name / "report.html")
        assert (tmp_path / name / "report.json").exists() and "html" in files
        assert repr(res).startswith(type(res).__name__ + "(") and len(repr(res)) < 200
    assert (tmp_path / "simulate" / "layer_time.png").read_bytes()[:8] == PNG
    assert "dropped-rows" in {f["code"] for f in sc.simulate().flags}  # capacity drops at cf=1
    assert sc.plans().plot(tmp_path / "none") == {}  # no plots of this kind, said plainly: nothing written


def test_sweep_result_saves_a_report_with_verdicts(tmp_path):
    res = Scenario(routing="gen:model=mixtral-8x7b,tokens-per-rank=64", cluster="4/2",
                   strategies=["alltoall", "moonep"]).sweep("maxvio", [0.5, 2.0])
    res.save(tmp_path / "s")
    doc = _parse(tmp_path / "s" / "report.html")
    text = " ".join(doc.text)
    assert "verdict" in text and "one-seed" in text and len(doc.imgs) == 1
    assert all(v["why"] in text for v in res.to_dict()["verdicts"])


def test_generic_html_for_a_new_result_kind(tmp_path):
    """A kind the writer does not know (a step) still gets its tables, verdict, flags and figures."""
    from moonep_sim.report.html import write_html

    png = (tmp_path / "f.png")
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    fig.savefig(png)
    plt.close(fig)
    data = {"kind": "step", "strategies": {"a": {"step_time_us": 10.0}, "b": {"step_time_us": 12.0}},
            "flags": [{"code": "stand-in-layer", "strategy": None, "text": "layer 3 stands in for 4"}],
            "verdict": {"winner": "a", "runner_up": "b", "margin": 0.2, "tie": False,
                        "confidence": {"level": "high", "basis": "over 3 steps"}, "mechanism": "planning",
                        "why": "b spends 2 us planning where a spends 0 us", "others": []}}
    write_html(data, tmp_path / "step.html", {"step": png}, prov={"command": "x", "versions": {}})
    doc = _parse(tmp_path / "step.html")
    text = " ".join(doc.text)
    assert "step_time_us" in text and "stand-in-layer" in text and "planning where a spends" in text
    assert len(doc.imgs) == 1


def _browser() -> str | None:
    return next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.skipif(_browser() is None, reason="no headless browser installed (chromium, chromium-browser or "
                                               "google-chrome); the structural check above still runs")
def test_report_html_renders_in_a_headless_browser(compare_result, tmp_path):
    compare_result.save(tmp_path / "out")
    shot = tmp_path / "shot.png"
    r = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--screenshot={shot}", "--window-size=1200,1600",
                        (tmp_path / "out" / "report.html").as_uri()], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    import matplotlib.image as mpimg

    img = mpimg.imread(shot)
    assert img.shape[0] == 1600 and img.shape[1] == 1200
    rgb = img[..., :3]
    # it drew something: not one flat colour, and the embedded plots' colours show (not just text)
    assert rgb.std() > 0.05
    colourful = np.abs(rgb - rgb.mean(axis=2, keepdims=True)).max(axis=2) > 0.15
    assert colourful.mean() > 0.01


def test_plots_mark_identical_series_ties_and_flags(monkeypatch, tmp_path):
    from moonep_sim.report import plots

    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, dest: figs.append(fig) or dest)
    sw = {"over": "nic_bandwidth_GBps", "values": [25.0, 50.0], "model": {"name": "m"}, "topology": {"name": "t"},
          "cluster": {"ranks": 8}, "lower_bound_us": [1, 1],
          "flags": [{"code": "oracle", "strategy": "c", "text": "t"}],
          "verdicts": [{"winner": "a", "tie": True}, None],
          "strategies": {"a": {"layer_time_us": [5.0, 4.0], "ratio_to_lower_bound": [5, 4]},
                         "b": {"layer_time_us": [5.0, 4.0], "ratio_to_lower_bound": [5, 4]},
                         "c": {"layer_time_us": [7.0, 6.0], "ratio_to_lower_bound": [7, 6]}}}
    plots.sweep_lines(sw, tmp_path / "s.png")
    labels = [t.get_text() for t in figs[-1].axes[0].get_legend().get_texts()]
    assert labels[:2] == ["a = b", "c*"]  # one line for the two identical series; c flagged
    assert any(t.get_text() == "tie" for t in figs[-1].axes[0].texts)
    assert any("flagged: c: oracle" in t.get_text() for t in figs[-1].texts)
    # traffic panels whose peaks differ by orders of magnitude get their own colour scales
    rep = {"routing": {"label": "r"}, "strategies": {
        "big": {"dispatch_bytes_RR": (np.ones((4, 4)) * 2**30).tolist()},
        "small": {"dispatch_bytes_RR": (np.ones((4, 4)) * 2**20).tolist()}}}
    plots.traffic_heatmaps(rep, tmp_path / "t.png")
    ims = [a.images[0] for a in figs[-1].axes if a.images]
    assert [im.get_clim()[1] for im in ims] == [1024.0, 1.0]


def test_step_result_carries_verdict_flags_and_saves(tmp_path):
    res = Scenario(routing="gen:model=mixtral-8x7b,tokens-per-rank=32", cluster="4/2",
                   strategies="alltoall,eplb").step("decode", distinct_layers=1)
    d = res.to_dict()
    assert d["kind"] == "step" and d["verdict"]["winner"] in ("alltoall", "eplb")
    assert d["verdict"]["mechanism"] in ("exposed communication", "compute", "memory", None)
    codes = {(f["code"], f["strategy"]) for f in d["flags"]}
    assert ("oracle", "eplb") in codes and ("stand-in-layer", None) in codes  # layers reuse layer 0's routing
    files = res.save(tmp_path / "step")
    assert (tmp_path / "step" / "step_time.png").read_bytes()[:8] == PNG
    doc = _parse(tmp_path / "step" / "report.html")
    assert len(doc.imgs) == 1 and d["verdict"]["why"] in " ".join(doc.text) and "html" in files


def test_winner_map_html_and_heatmap_show_ties(tmp_path, monkeypatch):
    from moonep_sim.analysis.winner import winner_map
    from moonep_sim.report import plots
    from moonep_sim.report.html import write_html
    from moonep_sim.report.winner import winner_heatmap

    def sw(times):
        return {"over": "maxvio", "values": [0.2, 20.0], "model": {"name": "m"}, "topology": {"name": "t"},
                "strategies": {n: {"layer_time_us": ts, "dropped": [0, 0]} for n, ts in times.items()}}
    m = winner_map([(128.0, sw({"x": [10.0, 30.0], "y": [10.0, 20.0]}))], "tokens-per-rank")
    write_html(m, tmp_path / "w.html", {"winner": winner_heatmap(m, tmp_path / "w.png")})
    text = " ".join(_parse(tmp_path / "w.html").text)
    assert "x = y (tie)" in text and "y +50.0%" in text
    figs = []
    monkeypatch.setattr(plots, "_save", lambda fig, dest: figs.append(fig) or dest)
    winner_heatmap(m, tmp_path / "w2.png")
    ax = figs[-1].axes[0]
    assert any(t.get_text().startswith("x = y\n(tie)") for t in ax.texts)
    assert "tie" in [t.get_text() for t in ax.get_legend().get_texts()]
