"""The trace reader against hostile files: every malformed header one TraceFormatError naming the
file and the field, no allocation a file cannot justify, no read that blocks."""

from __future__ import annotations

import os
import struct
import threading

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "badinput"))
from corpus import safetensors_bytes  # noqa: E402

from moonep_sim.errors import TraceFormatError
from moonep_sim.limits import MAX_NUM_EXPERTS
from moonep_sim.routing.trace import META_KEY, Trace

T, K, E = 4, 2, 8


def meta(**over):
    m = {"format_version": 1, "kind": "tokens", "num_experts": E, "top_k": K, "layer_ids": [0], "num_tokens": T}
    m.update(over)
    return m


def good_tensors():
    ids = np.array([[[0, 1], [2, 3], [4, 5], [6, 7]]], np.int16)
    w = np.full((1, T, K), 0.5, np.float32)
    return {"topk_ids": ("I16", ids), "topk_weights": ("F32", w)}


def raw_file(path, tensors=None, metadata=None, header_edit=None, data_edit=None):
    """A safetensors file built by hand (the bad-input corpus's builder), so any field can be wrong."""
    path.write_bytes(safetensors_bytes(good_tensors() if tensors is None else tensors,
                                       meta() if metadata is None else metadata, header_edit, data_edit))
    return path


def _set(d, key, value):
    d[key] = value


CASES = {  # name -> (raw_file kwargs, message pattern)
    "metadata_list": (dict(header_edit=lambda h: _set(h, "__metadata__", ["a"])),
                      r"header: __metadata__: expected an object of strings, found list"),
    "metadata_nested_dict": (dict(header_edit=lambda h: _set(h, "__metadata__", {META_KEY: {"kind": "tokens"}})),
                             r"header: __metadata__: expected an object of strings, found non-string values"),
    "tensor_not_object": (dict(header_edit=lambda h: _set(h, "topk_ids", [1, 2])),
                          r"tensor topk_ids: expected an object with dtype, shape and data_offsets, found list"),
    "no_dtype": (dict(header_edit=lambda h: h["topk_ids"].pop("dtype")),
                 r"tensor topk_ids: dtype: expected a safetensors dtype name, found None"),
    "shape_int": (dict(header_edit=lambda h: _set(h["topk_ids"], "shape", 8)),
                  r"tensor topk_ids: shape: expected a list of integers >= 0, found 8"),
    "offsets_three": (dict(header_edit=lambda h: _set(h["topk_ids"], "data_offsets", [0, 8, 16])),
                      r"tensor topk_ids: data_offsets: expected \[begin, end\]"),
    "offsets_reversed": (dict(header_edit=lambda h: _set(h["topk_ids"], "data_offsets", [16, 0])),
                         r"tensor topk_ids: data_offsets: expected \[begin, end\] with 0 <= begin <= end"),
    "offsets_bool": (dict(header_edit=lambda h: _set(h["topk_ids"], "data_offsets", [False, True])),
                     r"tensor topk_ids: data_offsets"),
    "dtype_vs_bytes": (dict(header_edit=lambda h: _set(h["topk_ids"], "dtype", "I32")),
                       r"tensor topk_ids: expected 32 bytes for dtype I32 and shape \[1, 4, 2\], found data_offsets \[0, 16\]"),
    "overlap": (dict(header_edit=lambda h: _set(h["topk_weights"], "data_offsets", [0, 32])),
                r"data_offsets: expected to begin at byte 16 \(tensors back to back\), found 0|expected 32 bytes"),
    "truncated": (dict(data_edit=lambda d: d[:-4]),
                  r"tensor topk_weights: expected 48 data bytes, file holds 44 \(truncated\)"),
    "bf16_weights": (dict(tensors={**good_tensors(), "topk_weights": ("BF16", np.zeros((1, T, K), np.uint16))}),
                     r"tensor topk_weights: expected dtype F32/F16, found BF16 \(numpy cannot read bf16"),
    "step_dtype_vs_bytes": (dict(tensors={**good_tensors(), "step": ("I32", np.zeros(T, np.int64))}),
                            r"tensor step: expected 16 bytes for dtype I32 and shape \[4\], found data_offsets \[48, 80\] \(32 bytes\)"),
    "num_experts_huge": (dict(metadata=meta(num_experts=1 << 40)),
                         rf"num_experts: expected an integer in \[1, {MAX_NUM_EXPERTS}\]"),
    "num_experts_bool": (dict(metadata=meta(num_experts=True)), r"num_experts: expected an integer"),
    "top_k_string": (dict(metadata=meta(top_k="2")), r"top_k: expected an integer in \[1, num_experts=8\], found '2'"),
    "layer_ids_strings": (dict(metadata=meta(layer_ids=["a"])), r"layer_ids: expected a non-empty list"),
    "layer_ids_bool": (dict(metadata=meta(layer_ids=[True])), r"layer_ids: expected a non-empty list"),
    "format_version_bool": (dict(metadata=meta(format_version=True)), r"format_version: expected 1, found True"),
    "import_report_list": (dict(metadata=meta(import_report=[1])), r"import_report: expected a JSON object"),
    "meta_not_object": (dict(metadata=[1, 2]), r"metadata: expected a JSON object, found list"),
    "tokens_huge": (dict(metadata=meta(num_tokens=1 << 62)), r"num_tokens: expected null or an integer in \[0, 2\^62\)"),
    "deep_json_header": (None, r"header: expected safetensors JSON, found nesting too deep to parse"),
}


def _write_deep(path):  # written raw: json.dumps would recurse itself
    h = ('{"deep": ' + "[" * 100000 + "]" * 100000 + "}").encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_header_one_line(tmp_path, name):
    kwargs, pattern = CASES[name]
    path = tmp_path / f"{name}.safetensors"
    if name == "deep_json_header":
        _write_deep(path)
    else:
        raw_file(path, **kwargs)
    with pytest.raises(TraceFormatError, match=pattern) as ei:
        tr = Trace(path)
        tr.layer(0)
    msg = str(ei.value)
    assert "\n" not in msg and msg.startswith(str(path))


def test_good_hand_built_file_reads(tmp_path):
    tr = Trace(raw_file(tmp_path / "ok.safetensors"))
    assert tr.layer(0).topk_ids_TK.tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_negative_weights_refused(tmp_path):
    t = good_tensors()
    w = t["topk_weights"][1].copy()
    w[0, 2, 1] = -0.25
    tr = Trace(raw_file(tmp_path / "neg.safetensors", tensors={**t, "topk_weights": ("F32", w)}))
    with pytest.raises(TraceFormatError, match=r"token 2: topk_weights: expected finite values >= 0"):
        tr.layer(0)


def test_decreasing_step_refused_when_opened(tmp_path):
    with pytest.raises(TraceFormatError, match=r"token 2: step: expected non-decreasing steps, found 0 after 1"):
        Trace(raw_file(tmp_path / "step.safetensors",
                       tensors={**good_tensors(), "step": ("I64", np.array([0, 1, 0, 2], np.int64))}))
    tr = Trace(raw_file(tmp_path / "ok.safetensors",
                        tensors={**good_tensors(), "step": ("I64", np.array([0, 0, 1, 3], np.int64))}))
    assert tr.steps().tolist() == [0, 0, 1, 3]


def test_inspect_refuses_negative_weights_and_decreasing_steps(tmp_path, capsys):
    from moonep_sim.cli import main

    t = good_tensors()
    w = t["topk_weights"][1].copy()
    w[0, 1, 0] = -1.0
    for path in (raw_file(tmp_path / "neg.safetensors", tensors={**t, "topk_weights": ("F32", w)}),
                 raw_file(tmp_path / "step.safetensors",
                          tensors={**t, "step": ("I64", np.array([3, 2, 2, 2], np.int64))})):
        assert main(["trace", "inspect", str(path), "--json"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and str(path) in err[0], err


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_non_regular_file_refused_without_blocking(tmp_path, kind):
    path = tmp_path / "x.safetensors"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    word = "a named pipe" if kind == "fifo" else "a directory"
    errs = []

    def read():
        try:
            Trace(path)
        except TraceFormatError as e:
            errs.append(str(e))

    th = threading.Thread(target=read, daemon=True)
    th.start()
    th.join(timeout=20)  # a bound on a hang, not synchronisation: the refusal needs no I/O
    assert not th.is_alive(), "reading a named pipe blocked"
    assert errs == [f"{path}: expected a regular file (a safetensors trace), found {word}"]
