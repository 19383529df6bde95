"""``moonep-sim step --out DIR`` (issue 21, item 6): report.json, the step-time and Gantt PNGs and
one self-contained report.html (checked with the stdlib parser, and in a headless browser when one
is installed), staged and moved in whole, refused before the run when the folder is bad."""

from __future__ import annotations

import base64
import json

import pytest

from conftest import TRACES
from moonep_sim.cli import main
from test_report_takeaway import PNG, _browser, _parse

MIXTRAL = TRACES / "mixtral-8x7b_humaneval.safetensors"
GEN = ["--gen", "model=mixtral-8x7b,tokens-per-rank=32", "--ranks", "4", "--mode", "decode", "--distinct-layers", "1",
       "--strategies", "alltoall,moonep"]


@pytest.fixture(scope="module")
def step_out(tmp_path_factory):
    out = tmp_path_factory.mktemp("step") / "out"
    assert main(["step", *GEN, "--out", str(out)]) == 0
    return out


def test_step_out_writes_json_plots_and_a_self_contained_html(step_out, capsys):
    names = sorted(p.name for p in step_out.iterdir())
    assert names == ["gantt.png", "report.html", "report.json", "step_time.png"]
    assert all((step_out / n).read_bytes()[:8] == PNG for n in ("gantt.png", "step_time.png"))
    rep = json.loads((step_out / "report.json").read_text())
    assert rep["kind"] == "step" and set(rep["strategies"]) == {"alltoall", "moonep"}
    assert rep["files"]["html"].endswith("report.html") and "moonep-sim" in rep["provenance"]["versions"]
    doc = _parse(step_out / "report.html")
    assert doc.h2 == ["Verdict", "Flags", "Tables", "Plots", "How it was produced"]
    assert len(doc.imgs) == 2 and all(s.startswith("data:image/png;base64,") for s in doc.imgs)
    assert base64.b64decode(doc.imgs[1].split(",", 1)[1])[:8] == PNG
    text = " ".join(doc.text)
    v = rep["verdict"]
    assert v["winner"] in text and v["why"] in text and "stand-in-layer" in text  # verdict and flag shown
    assert "step_time_us" in text  # the step table


def test_step_out_no_plots_and_several_recorded_steps(tmp_path):
    out = tmp_path / "steps"
    assert main(["step", "--trace", str(MIXTRAL), "--ranks", "4", "--strategies", "alltoall,moonep", "--mode",
                 "decode", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["gantt.png", "report.html", "report.json", "step_time_0.png",
                                                     "step_time_1.png"]
    rep = json.loads((out / "report.json").read_text())
    assert rep["kind"] == "steps" and len(rep["steps"]) == 2 and all(s["kind"] == "step" for s in rep["steps"])
    doc = _parse(out / "report.html")
    text = " ".join(doc.text)
    assert "recorded step 0" in text and "recorded step 1" in text and len(doc.imgs) == 3
    assert all(s["verdict"]["why"] in text for s in rep["steps"])
    bare = tmp_path / "bare"
    assert main(["step", *GEN, "--out", str(bare), "--no-plots"]) == 0
    assert sorted(p.name for p in bare.iterdir()) == ["report.html", "report.json"]
    assert _parse(bare / "report.html").imgs == []


def test_step_out_bad_folder_is_refused_before_the_run(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["step", *GEN, "--out", str(f)]) == 2
    assert capsys.readouterr().err.strip() == f"moonep-sim: error: --out ({f}) must be a folder: it is a regular file"
    # the trace itself named report.json inside --out: refused, the input intact, nothing written
    d = tmp_path / "d"
    d.mkdir()
    trace = d / "report.json"
    trace.write_bytes(MIXTRAL.read_bytes())
    assert main(["step", "--trace", str(trace), "--ranks", "4", "--out", str(d)]) == 2
    err = capsys.readouterr().err
    assert "would write report.json, which must differ from the input --trace" in err and err.count("\n") == 1
    assert sorted(p.name for p in d.iterdir()) == ["report.json"] and trace.read_bytes() == MIXTRAL.read_bytes()


@pytest.mark.skipif(_browser() is None, reason="no headless browser installed (chromium, chromium-browser or "
                                               "google-chrome); the structural check above still runs")
def test_step_report_html_renders_in_a_headless_browser(step_out, tmp_path):
    import subprocess

    import matplotlib.image as mpimg
    import numpy as np

    shot = tmp_path / "shot.png"
    r = subprocess.run([_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--screenshot={shot}", "--window-size=1200,1600", (step_out / "report.html").as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rgb = mpimg.imread(shot)[..., :3]
    assert rgb.shape[:2] == (1600, 1200) and rgb.std() > 0.05  # it drew something, not one flat colour
    colourful = np.abs(rgb - rgb.mean(axis=2, keepdims=True)).max(axis=2) > 0.15
    assert colourful.mean() > 0.005  # the embedded plots' colours show, not just text
