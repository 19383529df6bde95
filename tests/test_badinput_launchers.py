"""The HF launcher (launch/train_hf.py) and the replay launcher (launch/replay.py) refuse bad input
before any rank starts: one line naming the file or the flag, exit 2, no output written, no input
overwritten (through a symlink or a hard link too); a rank lost after start-up is named by the
phase it was in, not as lost while starting."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
MOE = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 4, "max_position_embeddings": 128, "intermediate_size": 16, "num_local_experts": 8,
       "num_experts_per_tok": 2}


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_launch_{name}", REPO / "launch" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cfg(d: Path, name: str = "config.json", **over) -> Path:
    doc = {**MOE, **over}
    (d / name).write_text(json.dumps({k: v for k, v in doc.items() if v is not None}))
    return d / name


def _link(d: Path, target: Path, how: str) -> Path:
    if how == "same":
        return target
    dest = d / f"link-{how}.json"
    (os.symlink if how == "symlink" else os.link)(target, dest)
    return dest


HF_CASES = {  # name -> (make(d) -> argv, what the line must name)
    "dense-config": (lambda d: ["--model", str(_cfg(d, model_type="llama", num_local_experts=None,
                                                    num_experts_per_tok=None)), "--nproc", "2"], r"config\.json.*experts"),
    "heads-0": (lambda d: ["--model", str(_cfg(d, num_attention_heads=0)), "--nproc", "2"],
                r"config\.json.*num_attention_heads \(0\)"),
    "kv-heads-not-dividing": (lambda d: ["--model", str(_cfg(d, num_key_value_heads=3)), "--nproc", "2"],
                              r"config\.json.*num_key_value_heads"),
    "heads-not-dividing-hidden": (lambda d: ["--model", str(_cfg(d, num_attention_heads=5, num_key_value_heads=5)),
                                             "--nproc", "2"], r"config\.json.*num_attention_heads \(5\)"),
    "unknown-model-type": (lambda d: ["--model", str(_cfg(d, model_type="no-such-arch")), "--nproc", "2"],
                           r"config\.json.*model_type"),
    "not-json": (lambda d: ((d / "config.json").write_text("{model_type"), ["--model", str(d / "config.json"),
                                                                              "--nproc", "2"])[1], r"config\.json"),
    "config-fifo": (lambda d: (os.mkfifo(d / "config.json"), ["--model", str(d / "config.json"), "--nproc", "2"])[1],
                    r"config\.json.*named pipe"),
    "checkpoint-without-config": (lambda d: ((d / "ck").mkdir(), ["--model", str(d / "ck"), "--nproc", "2"])[1],
                                  r"ck.*config\.json"),
    "vocab-huge": (lambda d: ["--model", str(_cfg(d, vocab_size=1 << 40)), "--nproc", "2"], r"config\.json.*vocab_size"),
    "beyond-memory": (lambda d: ["--model", str(_cfg(d, hidden_size=1 << 19, intermediate_size=1 << 19)), "--nproc",
                                 "2"], r"config\.json.*memory"),
    "nproc-not-dividing-experts": (lambda d: ["--model", str(_cfg(d)), "--nproc", "3"], r"--nproc \(3\).*experts \(8\)"),
    "nproc-beyond-experts": (lambda d: ["--model", "tiny-mixtral", "--nproc", "16"], r"--nproc \(16\).*experts \(8\)"),
    "gpus-per-node-not-dividing": (lambda d: ["--model", "tiny-mixtral", "--nproc", "4", "--gpus-per-node", "3"],
                                   r"--gpus-per-node \(3\)"),
    "timeout-inf": (lambda d: ["--model", "tiny-mixtral", "--nproc", "2", "--timeout", "inf"], r"--timeout \(inf\)"),
    "json-equal-record": (lambda d: ["--model", "tiny-mixtral", "--nproc", "2", "--json", str(d / "x"), "--record",
                                     str(d / "x")], r"--record.*--json"),
    **{f"json-onto-config-{how}": (lambda d, how=how: ["--model", str(_cfg(d)), "--nproc", "2", "--json",
                                                       str(_link(d, d / "config.json", how))], r"--json.*--model")
       for how in ("same", "symlink", "hardlink")},
    **{f"record-onto-checkpoint-config-{how}": (
        lambda d, how=how: ((d / "ck").mkdir(), _cfg(d / "ck"),
                            ["--model", str(d / "ck"), "--nproc", "2", "--record",
                             str(_link(d, d / "ck" / "config.json", how))])[2], r"--record.*--model")
       for how in ("same", "symlink", "hardlink")},
}


def _contents(d: Path) -> dict[str, bytes]:
    """Every regular file's bytes (links and pipes not followed or opened)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in d.rglob("*") if p.is_file() and not p.is_symlink()}


def _names(d: Path) -> set[str]:
    return {str(p.relative_to(d)) for p in d.rglob("*")}


@pytest.fixture(scope="module")
def train_hf():
    return _script("train_hf")


@pytest.mark.parametrize("name", sorted(HF_CASES))
def test_train_hf_refuses_before_any_rank_starts(name, train_hf, tmp_path, capsys, monkeypatch):
    import moonep_sim.gloo.launcher as launcher

    make, names = HF_CASES[name]
    argv = make(tmp_path)
    before, names_before = _contents(tmp_path), _names(tmp_path)

    def no_ranks(*a, **k):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(launcher, "run_rank_program", no_ranks)
    assert train_hf.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moonep-sim: error: "), err
    import re
    assert re.search(names, err[0]), err[0]
    assert _contents(tmp_path) == before and _names(tmp_path) == names_before


REPLAY_CASES = {
    "nproc-not-dividing-experts": (["--nproc", "3"], r"--nproc \(3\).*divisible"),
    "unknown-strategy": (["--nproc", "2", "--strategy", "nope"], "strategy"),
    "layer-not-in-trace": (["--nproc", "2", "--layers", "9"], r"layer \(9\)"),
    "gpus-per-node-not-dividing": (["--nproc", "4", "--gpus-per-node", "3"], r"--gpus-per-node \(3\)"),
    "steps-beyond-trace": (["--nproc", "2", "--steps", "7"], r"--steps \(7\)"),
    "unknown-option": (["--nproc", "2", "--opt", "cf=2"], r"option \('cf'\)"),
    "json-onto-trace": (["--nproc", "2", "--json", "{trace}"], r"--json.*destroy|--json.*input"),
    "spec-fifo": (["--nproc", "2", "--spec", "{fifo}"], r"--spec.*named pipe"),
    "json-onto-spec": (["--nproc", "2", "--spec", "{spec}", "--json", "{spec}"], r"--json.*--spec"),
}


@pytest.mark.parametrize("name", sorted(REPLAY_CASES))
def test_replay_refuses_before_any_rank_starts(name, tmp_path, capsys, monkeypatch):
    import re

    import moonep_sim.gloo.launcher as launcher
    from moonep_sim.experiments.ranks import replay_rank
    from moonep_sim.routing.generators import generate_trace

    generate_trace(tmp_path / "t.safetensors", 8, 2, 64, 1, layers=1, maxvio=1.0)
    extra, names = REPLAY_CASES[name]
    os.mkfifo(tmp_path / "spec.json")
    argv = ["--trace", str(tmp_path / "t.safetensors"),
            *[a.replace("{trace}", str(tmp_path / "t.safetensors")).replace("{fifo}", str(tmp_path / "spec.json"))
              .replace("{spec}", str(tmp_path / "s.json")) for a in extra]]
    (tmp_path / "s.json").write_text(json.dumps({"moonep_sim_replay_spec": 1, "trace": str(tmp_path / "t.safetensors"),
                                                 "strategies": [["alltoall", {}]]}))
    before = _contents(tmp_path)

    def no_ranks(*a, **k):
        raise AssertionError("a rank was started")
    monkeypatch.setattr(launcher, "run_rank_program", no_ranks)
    assert replay_rank.launch(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(names, err[0]), err
    assert _contents(tmp_path) == before


@pytest.mark.slow  # two gloo ranks of the HF launcher
def test_a_rank_killed_in_training_is_named_by_its_phase(tmp_path):
    """Rank 1 is killed (SIGKILL) at the start of the timed steps, after the group is up: the line
    names the training step it was lost in and the silent rank, not a rank lost while starting."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MOONEP_SIM_FAULT": "1:training:SIGKILL"}
    p = subprocess.run([sys.executable, str(REPO / "launch" / "train_hf.py"), "--model", "tiny-mixtral", "--nproc",
                        "2", "--steps", "2", "--timeout", "20"], capture_output=True, text=True, env=env, timeout=600,
                       stdin=subprocess.DEVNULL)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 1 and len(lines) == 1, p.stderr
    assert "starting" not in lines[0] and "step 0" in lines[0] and "silent peer rank 1" in lines[0], lines[0]
