"""The bad-input corpus: hostile files and argument sets, each of which must get the promised refusal.

Every case is a command line (built in a fresh folder by :func:`Case.build`) that must end with
exit status 2, exactly one stderr line ``moonep-sim: error: ...`` that names the offending file or
argument (``Case.names``), nothing written where outputs go and no temporary file left.

Cases are generated, not listed: header mutations of a valid safetensors trace, each sent through
every command that reads a trace; record-log, histogram and numpy mutations through ``trace
import``; special files (pipes, directories, empty files); and, per command, arguments out of range.

    python tests/badinput/corpus.py            # list the cases (id and command line)
    python tests/badinput/corpus.py --count    # how many, per group

``tests/test_badinput.py`` runs them (in-process through ``moonep_sim.cli.main``, plus a few as
real subprocesses for the exit-status and one-line contract end to end).
"""

from __future__ import annotations

import io
import json
import os
import struct
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

META_KEY = "moonep_sim"
T, K, E = 4, 2, 8


@dataclass(frozen=True)
class Case:
    """One bad input. ``make(indir)`` writes the input files into ``indir`` and returns the command
    line, where ``{in}`` and ``{out}`` stand for the input and output folders; ``names``: what the
    error line must mention (a file name or an argument)."""

    id: str
    group: str
    make: Callable[[Path], list[str]]
    names: str  # a regular expression
    tags: tuple[str, ...] = field(default=())

    def build(self, indir: Path, outdir: Path) -> list[str]:
        argv = self.make(indir)
        return [a.replace("{in}", str(indir)).replace("{out}", str(outdir)) for a in argv]


# ------------------------------------------------------------------------ safetensors traces
def _meta(**over):
    m = {"format_version": 1, "kind": "tokens", "num_experts": E, "top_k": K, "layer_ids": [0], "num_tokens": T}
    m.update(over)
    return m


def _good_tensors():
    ids = np.array([[[0, 1], [2, 3], [4, 5], [6, 7]]], np.int16)
    return {"topk_ids": ("I16", ids), "topk_weights": ("F32", np.full((1, T, K), 0.5, np.float32))}


def safetensors_bytes(tensors=None, metadata=None, header_edit=None, data_edit=None, raw_header: bytes | None = None):
    """A safetensors file built by hand so that any field can be wrong."""
    tensors = _good_tensors() if tensors is None else tensors
    header, data, off = {}, b"", 0
    for name, (dt, arr) in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        data += b
        off += len(b)
    header["__metadata__"] = {META_KEY: json.dumps(_meta() if metadata is None else metadata)}
    if header_edit:
        header_edit(header)
    if data_edit:
        data = data_edit(data)
    h = json.dumps(header).encode() if raw_header is None else raw_header
    return struct.pack("<Q", len(h)) + h + data


def _set(d, key, value):
    d[key] = value
    return d


def _nested(depth: int) -> bytes:
    return ("{" + f'"__metadata__": {{"{META_KEY}": "x"}}, "deep": ' + "[" * depth + "]" * depth + "}").encode()


TRACE_MUTATIONS: dict[str, Callable[[], bytes]] = {
    "empty_file": lambda: b"",
    "seven_bytes": lambda: b"\x01" * 7,
    "length_beyond_file": lambda: struct.pack("<Q", 1 << 40) + b"{}",
    "length_0x80_prefix": lambda: struct.pack("<Q", 0x0280) + b"{" + b" " * 0x27E + b"}",
    "header_not_json": lambda: struct.pack("<Q", 5) + b"\xff\xfe{{{",
    "header_list": lambda: safetensors_bytes(raw_header=b"[1, 2, 3]"),
    "header_deeply_nested": lambda: safetensors_bytes(raw_header=_nested(100000)),
    "metadata_list": lambda: safetensors_bytes(header_edit=lambda h: _set(h, "__metadata__", ["a"])),
    "metadata_dict_value": lambda: safetensors_bytes(header_edit=lambda h: _set(h, "__metadata__", {META_KEY: {"kind": 1}})),
    "metadata_missing": lambda: safetensors_bytes(header_edit=lambda h: _set(h, "__metadata__", {})),
    "metadata_invalid_json": lambda: safetensors_bytes(header_edit=lambda h: _set(h, "__metadata__", {META_KEY: "{"})),
    "metadata_deep_json": lambda: safetensors_bytes(header_edit=lambda h: _set(
        h, "__metadata__", {META_KEY: "[" * 100000 + "]" * 100000})),
    "metadata_missing_keys": lambda: safetensors_bytes(metadata={"kind": "tokens"}),
    "tensor_not_object": lambda: safetensors_bytes(header_edit=lambda h: _set(h, "topk_ids", [1, 2])),
    "tensor_no_dtype": lambda: safetensors_bytes(header_edit=lambda h: h["topk_ids"].pop("dtype") and h),
    "tensor_unknown_dtype": lambda: safetensors_bytes(header_edit=lambda h: _set(h["topk_ids"], "dtype", "Q9")),
    "shape_int": lambda: safetensors_bytes(header_edit=lambda h: _set(h["topk_ids"], "shape", 8)),
    "shape_negative": lambda: safetensors_bytes(header_edit=lambda h: _set(h["topk_ids"], "shape", [1, -4, 2])),
    "shape_strings": lambda: safetensors_bytes(header_edit=lambda h: _set(h["topk_ids"], "shape", ["1", "4", "2"])),
    "offsets_missing": lambda: safetensors_bytes(header_edit=lambda h: h["topk_ids"].pop("data_offsets") and h),
    "offsets_three": lambda: safetensors_bytes(header_edit=lambda h: _set(h["topk_ids"], "data_offsets", [0, 8, 16])),
    "offsets_reversed": lambda: safetensors_bytes(header_edit=lambda h: _set(h["topk_ids"], "data_offsets", [16, 0])),
    "offsets_negative": lambda: safetensors_bytes(header_edit=lambda h: _set(h["topk_ids"], "data_offsets", [-16, 0])),
    "offsets_floats": lambda: safetensors_bytes(header_edit=lambda h: _set(h["topk_ids"], "data_offsets", [0.0, 16.0])),
    "offsets_overlap": lambda: safetensors_bytes(header_edit=lambda h: _set(h["topk_weights"], "data_offsets", [0, 32])),
    "offsets_gap": lambda: safetensors_bytes(header_edit=lambda h: _set(h["topk_weights"], "data_offsets", [24, 56]),
                                             data_edit=lambda d: d + b"\0" * 8),
    "dtype_size_mismatch": lambda: safetensors_bytes(header_edit=lambda h: _set(h["topk_ids"], "dtype", "I32")),
    "truncated_data": lambda: safetensors_bytes(data_edit=lambda d: d[:-4]),
    "bf16_weights": lambda: safetensors_bytes(tensors={**_good_tensors(), "topk_weights": ("BF16", np.zeros((1, T, K), np.uint16))}),
    "float_ids": lambda: safetensors_bytes(tensors={**_good_tensors(), "topk_ids": ("F32", np.zeros((1, T, K), np.float32))}),
    "unknown_tensor": lambda: safetensors_bytes(tensors={**_good_tensors(), "extra": ("F32", np.zeros(2, np.float32))}),
    "missing_weights": lambda: safetensors_bytes(tensors={"topk_ids": _good_tensors()["topk_ids"]}),
    "shape_vs_metadata": lambda: safetensors_bytes(metadata=_meta(num_tokens=5)),
    "step_dtype_mismatch": lambda: safetensors_bytes(tensors={**_good_tensors(), "step": ("I32", np.zeros(T, np.int64))}),
    "step_decreasing": lambda: safetensors_bytes(tensors={**_good_tensors(), "step": ("I64", np.array([0, 2, 1, 3]))}),
    "step_negative": lambda: safetensors_bytes(tensors={**_good_tensors(), "step": ("I64", np.array([-1, 0, 0, 1]))}),
    "weights_negative": lambda: safetensors_bytes(tensors={**_good_tensors(), "topk_weights": (
        "F32", np.array([[[0.5, 0.5], [0.5, -0.5], [0.5, 0.5], [0.5, 0.5]]], np.float32))}),
    "weights_nan": lambda: safetensors_bytes(tensors={**_good_tensors(), "topk_weights": (
        "F32", np.array([[[0.5, np.nan], [0.5, 0.5], [0.5, 0.5], [0.5, 0.5]]], np.float32))}),
    "ids_out_of_range": lambda: safetensors_bytes(tensors={**_good_tensors(), "topk_ids": (
        "I16", np.array([[[0, 1], [2, 9], [4, 5], [6, 7]]], np.int16))}),
    "ids_negative": lambda: safetensors_bytes(tensors={**_good_tensors(), "topk_ids": (
        "I16", np.array([[[0, 1], [2, 3], [-1, 5], [6, 7]]], np.int16))}),
    "ids_duplicate": lambda: safetensors_bytes(tensors={**_good_tensors(), "topk_ids": (
        "I16", np.array([[[0, 1], [3, 3], [4, 5], [6, 7]]], np.int16))}),
    "num_experts_2e40": lambda: safetensors_bytes(metadata=_meta(num_experts=1 << 40)),
    "num_experts_bool": lambda: safetensors_bytes(metadata=_meta(num_experts=True)),
    "num_experts_zero": lambda: safetensors_bytes(metadata=_meta(num_experts=0)),
    "num_experts_float": lambda: safetensors_bytes(metadata=_meta(num_experts=8.0)),
    "top_k_string": lambda: safetensors_bytes(metadata=_meta(top_k="2")),
    "top_k_above_experts": lambda: safetensors_bytes(metadata=_meta(top_k=9)),
    "layer_ids_strings": lambda: safetensors_bytes(metadata=_meta(layer_ids=["a"])),
    "layer_ids_empty": lambda: safetensors_bytes(metadata=_meta(layer_ids=[])),
    "layer_ids_bools": lambda: safetensors_bytes(metadata=_meta(layer_ids=[True])),
    "layer_ids_huge": lambda: safetensors_bytes(metadata=_meta(layer_ids=[1 << 62])),
    "num_tokens_negative": lambda: safetensors_bytes(metadata=_meta(num_tokens=-4)),
    "num_tokens_2e62": lambda: safetensors_bytes(metadata=_meta(num_tokens=1 << 62)),
    "kind_unknown": lambda: safetensors_bytes(metadata=_meta(kind="rows")),
    "format_version_2": lambda: safetensors_bytes(metadata=_meta(format_version=2)),
    "format_version_bool": lambda: safetensors_bytes(metadata=_meta(format_version=True)),
    "import_report_list": lambda: safetensors_bytes(metadata=_meta(import_report=[])),
    "source_number": lambda: safetensors_bytes(metadata=_meta(source=5)),
    "model_number": lambda: safetensors_bytes(metadata=_meta(model=7)),
    "model_unknown": lambda: safetensors_bytes(metadata=_meta(model="no-such-model")),
    "counts_negative": lambda: safetensors_bytes(metadata=_meta(kind="counts", num_tokens=None),
                                                 tensors={"counts": ("I64", np.array([[3, -1, 0, 0, 0, 0, 0, 0]]))}),
}

# commands that read a trace, each with what it needs around it; the trace is {in}/t.safetensors
TRACE_READERS: dict[str, list[str]] = {
    "inspect": ["trace", "inspect", "{in}/t.safetensors", "--json"],
    "simulate": ["simulate", "--trace", "{in}/t.safetensors", "--strategy", "alltoall", "--ranks", "2", "--json"],
    "plan": ["plan", "--trace", "{in}/t.safetensors", "--strategy", "alltoall", "--ranks", "2", "--json"],
    "compare": ["compare", "--trace", "{in}/t.safetensors", "--strategies", "alltoall", "--ranks", "2",
                "--no-plots", "--json", "--out", "{out}/cmp"],
    "route": ["trace", "route", "{in}/t.safetensors", "-o", "{out}/r.safetensors"],
}
# every mutation goes through inspect (but those inspect rightly shows); a spread through every other reader
INSPECT_ACCEPTS = ("model_unknown",)  # inspect reports the model's name, it need not know the model
OTHER_READER_MUTATIONS = ("model_unknown", "header_deeply_nested", "metadata_list", "offsets_reversed", "bf16_weights",
                          "num_experts_2e40", "step_decreasing", "weights_negative", "length_0x80_prefix",
                          "dtype_size_mismatch", "shape_int")


def _trace_case(mutation: str, reader: str) -> Case:
    def make(d: Path, mutation=mutation, reader=reader) -> list[str]:
        (d / "t.safetensors").write_bytes(TRACE_MUTATIONS[mutation]())
        return list(TRACE_READERS[reader])
    return Case(f"trace-{reader}-{mutation}", "trace reader", make, "t.safetensors")


# ------------------------------------------------------------------------ importer sources
def _jsonl(records: list) -> bytes:
    return ("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n").encode()


def _rec(tok=0, layer=0, experts=(0, 1), probs=(0.5, 0.5), **over):
    r = {"problem_id": 0, "token_idx": tok, "layer": layer, "experts": list(experts), "gating_probs": list(probs)}
    r.update(over)
    return r


def _good_records(n=4):
    return [_rec(t, 0, (t % 4, (t + 1) % 4)) for t in range(n)]


def _meta_rec(**over):
    m = {"type": "meta", "num_experts": 4, "top_k": 2, "layers_logged": [0]}
    m.update(over)
    return m


def _route(tok=0, layer=0, ids=(0, 1), w=(0.5, 0.5)):
    return {"type": "route", "req_id": 0, "token_idx": tok, "layer": layer, "topk_ids": list(ids), "topk_weights": list(w)}


def _npy_bytes(arr) -> bytes:
    b = io.BytesIO()
    np.save(b, arr, allow_pickle=False)
    return b.getvalue()


def _npy_header_only(shape, dtype="<i8") -> bytes:
    """A .npy whose header promises ``shape`` but holds 16 bytes of data."""
    hdr = repr({"descr": dtype, "fortran_order": False, "shape": tuple(shape)}).encode()
    hdr += b" " * (64 - (10 + len(hdr) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr + b"\0" * 16


def _npz(members: dict[str, bytes], compress=True) -> bytes:
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return b.getvalue()


def _bomb() -> bytes:
    """An .npz whose member inflates to 2 GiB of zeros from a few MiB (a decompression bomb)."""
    n = 1 << 28  # int64 elements: 2 GiB
    hdr = repr({"descr": "<i8", "fortran_order": False, "shape": (n // 2, 2)}).encode()
    hdr += b" " * (64 - (10 + len(hdr) + 1) % 64) + b"\n"
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", zipfile.ZIP_DEFLATED) as z:
        with z.open("topk_ids.npy", "w", force_zip64=True) as f:
            f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(hdr)) + hdr)
            chunk = b"\0" * (1 << 24)
            for _ in range((n * 8) // len(chunk)):
                f.write(chunk)
    return b.getvalue()


def _pickle_bytes() -> bytes:
    import pickle
    return pickle.dumps({"topk_ids": [[0, 1]]})


SOURCES: dict[str, tuple[str, Callable[[], bytes], list[str]]] = {
    # name -> (file name, content, extra args)
    # record logs
    "jsonl_truncated_line": ("r.jsonl", lambda: _jsonl(_good_records())[:-10], []),
    "jsonl_not_objects": ("r.jsonl", lambda: _jsonl([[1, 2], [3, 4]]), []),
    "jsonl_missing_layer": ("r.jsonl", lambda: _jsonl([{"token_idx": 0, "experts": [0, 1]}]), []),
    "jsonl_ids_not_list": ("r.jsonl", lambda: _jsonl([{**_rec(), "experts": 5}]), []),
    "jsonl_ids_strings": ("r.jsonl", lambda: _jsonl([_rec(experts=["0", "1"])]), []),
    "jsonl_ids_bools": ("r.jsonl", lambda: _jsonl([_rec(experts=[True, False])] + _good_records()), []),
    "jsonl_ids_floats": ("r.jsonl", lambda: _jsonl([_rec(experts=[0.0, 1.5])]), []),
    "jsonl_ids_huge": ("r.jsonl", lambda: _jsonl([_rec(experts=[0, (1 << 31) - 2])]), []),
    "jsonl_ids_2e70": ("r.jsonl", lambda: _jsonl([_rec(experts=[0, 1 << 70])]), []),
    "jsonl_ids_negative": ("r.jsonl", lambda: _jsonl([_rec(experts=[-1, 1])]), ["--num-experts", "4"]),
    "jsonl_ids_out_of_range": ("r.jsonl", lambda: _jsonl([_rec(experts=[0, 9])]), ["--num-experts", "4"]),
    "jsonl_ids_duplicate": ("r.jsonl", lambda: _jsonl([_rec(experts=[1, 1])]), []),
    "jsonl_topk_varies": ("r.jsonl", lambda: _jsonl([_rec(), _rec(1, experts=[0, 1, 2], probs=[.3, .3, .4])]), []),
    "jsonl_token_string": ("r.jsonl", lambda: _jsonl([_rec(tok="a")]), []),
    "jsonl_token_negative": ("r.jsonl", lambda: _jsonl([_rec(tok=-3)]), []),
    "jsonl_token_bool": ("r.jsonl", lambda: _jsonl([_rec(tok=True)]), []),
    "jsonl_token_2e64": ("r.jsonl", lambda: _jsonl([_rec(tok=1 << 64)]), []),
    "jsonl_layer_huge": ("r.jsonl", lambda: _jsonl([_rec(layer=1 << 40), _rec(tok=1, layer=0)]), []),
    "jsonl_layer_float": ("r.jsonl", lambda: _jsonl([_rec(layer=0.5)]), []),
    "jsonl_weights_nan": ("r.jsonl", lambda: '{"problem_id": 0, "token_idx": 0, "layer": 0, "experts": [0, 1], '
                                              '"gating_probs": [NaN, 0.5]}\n'.encode(), []),
    "jsonl_weights_negative": ("r.jsonl", lambda: _jsonl([_rec(probs=[-0.5, 0.5])]), []),
    "jsonl_weights_strings": ("r.jsonl", lambda: _jsonl([_rec(probs=["a", "b"])]), []),
    "jsonl_weights_short": ("r.jsonl", lambda: _jsonl([_rec(probs=[1.0])]), []),
    "jsonl_weights_nested": ("r.jsonl", lambda: _jsonl([_rec(probs=[[0.5], [0.5]])]), []),
    "jsonl_deep_nesting": ("r.jsonl", lambda: b'{"token_idx": 0, "layer": 0, "experts": ' + b"[" * 100000
                           + b"]" * 100000 + b"}\n", []),
    "jsonl_conflicting_duplicate": ("r.jsonl", lambda: _jsonl([_rec(), _rec(experts=(2, 3))]),
                                    ["--steps-from", "none"]),
    "jsonl_only_dummy": ("r.jsonl", lambda: _jsonl([_rec(t) for t in range(80)]), []),
    "jsonl_binary": ("r.jsonl", lambda: b"\x00\x01\x02\xff" * 50, []),
    # vLLM route logs with a meta line
    "vllm_meta_topk_string": ("v.jsonl", lambda: _jsonl([_meta_rec(top_k="2"), _route()]), []),
    "vllm_meta_topk_mismatch": ("v.jsonl", lambda: _jsonl([_meta_rec(top_k=3), _route()]), []),
    "vllm_meta_experts_string": ("v.jsonl", lambda: _jsonl([_meta_rec(num_experts="4"), _route()]), []),
    "vllm_meta_experts_2e40": ("v.jsonl", lambda: _jsonl([_meta_rec(num_experts=1 << 40), _route()]), []),
    "vllm_meta_experts_negative": ("v.jsonl", lambda: _jsonl([_meta_rec(num_experts=-4), _route()]), []),
    "vllm_meta_layers_strings": ("v.jsonl", lambda: _jsonl([_meta_rec(layers_logged=["a"]), _route()]), []),
    "vllm_meta_layers_not_list": ("v.jsonl", lambda: _jsonl([_meta_rec(layers_logged=5), _route()]), []),
    "vllm_meta_layers_mismatch": ("v.jsonl", lambda: _jsonl([_meta_rec(layers_logged=[1]), _route()]), []),
    "vllm_meta_twice": ("v.jsonl", lambda: _jsonl([_meta_rec(), _route(), _meta_rec()]), []),
    "vllm_ids_bool": ("v.jsonl", lambda: _jsonl([_meta_rec(), _route(ids=[False, True])]), []),
    # count histograms
    "counts_top_k_string": ("c.json", lambda: json.dumps({"top_k": "1", "counts": [[1, 2, 3]]}).encode(), []),
    "counts_layers_strings": ("c.json", lambda: json.dumps({"layers": ["a"], "counts": [[1, 2, 3]]}).encode(), []),
    "counts_layers_not_list": ("c.json", lambda: json.dumps({"layers": 3, "counts": [[1, 2, 3]]}).encode(), []),
    "counts_analysis_not_dict": ("c.json", lambda: json.dumps({"counts": [[1, 2, 3]], "layer_analysis": {"0": 5}}).encode(), []),
    "counts_analysis_list": ("c.json", lambda: json.dumps({"counts": [[1, 2, 3]], "layer_analysis": [1]}).encode(), []),
    "counts_negative": ("c.json", lambda: json.dumps({"counts": [[1, -2, 3]]}).encode(), []),
    "counts_float": ("c.json", lambda: json.dumps({"counts": [[1, 2.5, 3]]}).encode(), []),
    "counts_bool": ("c.json", lambda: json.dumps({"counts": [[1, True, 3]]}).encode(), []),
    "counts_string": ("c.json", lambda: json.dumps({"counts": [["1", 2, 3]]}).encode(), []),
    "counts_layer_key": ("c.json", lambda: json.dumps({"expert_usage_by_layer": {"x": [1, 2]}}).encode(), []),
    "counts_expert_key": ("c.json", lambda: json.dumps({"expert_usage_by_layer": {"0": {"a": 1}}}).encode(), []),
    "counts_expert_huge": ("c.json", lambda: json.dumps({"expert_usage_by_layer": {"0": {str(1 << 40): 1}}}).encode(), []),
    "counts_num_experts_string": ("c.json", lambda: json.dumps({"num_experts": "3", "counts": [[1, 2, 3]]}).encode(), []),
    "counts_empty_layers": ("c.json", lambda: json.dumps({"counts": []}).encode(), []),
    "counts_body_number": ("c.json", lambda: json.dumps({"counts": 5}).encode(), []),
    "counts_top_level_number": ("c.json", lambda: b"5", []),
    "counts_deep_nesting": ("c.json", lambda: b"[" * 100000 + b"]" * 100000, []),
    "counts_invalid_json": ("c.json", lambda: b'{"counts": [[1, 2, 3]', []),
    # numpy arrays
    "npy_float_ids": ("a.npy", lambda: _npy_bytes(np.zeros((4, 2))), []),
    "npy_id_2e31": ("a.npy", lambda: _npy_bytes(np.array([[0, (1 << 31) - 2]])), []),
    "npy_negative_ids": ("a.npy", lambda: _npy_bytes(np.array([[0, -1]])), ["--num-experts", "4"]),
    "npy_duplicate_ids": ("a.npy", lambda: _npy_bytes(np.array([[1, 1]])), []),
    "npy_bad_shape": ("a.npy", lambda: _npy_bytes(np.zeros((2, 2, 2, 2), np.int64)), []),
    "npy_zero_width": ("a.npy", lambda: _npy_bytes(np.zeros((4, 0), np.int64)), []),
    "npy_header_promises_2e40": ("a.npy", lambda: _npy_header_only((1 << 40, 2)), []),
    "npy_truncated": ("a.npy", lambda: _npy_bytes(np.zeros((100, 2), np.int64))[:200], []),
    "npy_object_pickle": ("a.npy", lambda: _npy_bytes(np.array([[0, 1]])).replace(b"'<i8'", b"'|O' "), []),
    "npy_extension_not_numpy": ("a.npy", lambda: b"hello world\n", []),
    "npz_member_not_npy": ("a.npz", lambda: _npz({"topk_ids": b"not numpy at all"}), []),
    "npz_member_text": ("a.npz", lambda: _npz({"notes.txt": b"hello", "topk_ids.npy": _npy_bytes(np.array([[0, 1]]))}), []),
    "npz_no_topk_ids": ("a.npz", lambda: _npz({"a.npy": _npy_bytes(np.zeros(2, np.int64)),
                                                "b.npy": _npy_bytes(np.zeros(2, np.int64))}), []),
    "npz_empty": ("a.npz", lambda: _npz({}), []),
    "npz_bomb": ("a.npz", _bomb, []),
    "npz_negative_weights": ("a.npz", lambda: _npz({"topk_ids.npy": _npy_bytes(np.array([[0, 1], [1, 2]])),
                                                     "topk_weights.npy": _npy_bytes(np.array([[0.5, -0.5], [0.5, 0.5]]))}), []),
    "npz_weights_shape": ("a.npz", lambda: _npz({"topk_ids.npy": _npy_bytes(np.array([[0, 1], [1, 2]])),
                                                  "topk_weights.npy": _npy_bytes(np.ones(3))}), []),
    "npz_weights_int": ("a.npz", lambda: _npz({"topk_ids.npy": _npy_bytes(np.array([[0, 1], [1, 2]])),
                                                "topk_weights.npy": _npy_bytes(np.ones((2, 2), np.int64))}), []),
    "npz_step_decreasing": ("a.npz", lambda: _npz({"topk_ids.npy": _npy_bytes(np.array([[0, 1], [1, 2]])),
                                                    "step.npy": _npy_bytes(np.array([1, 0]))}), []),
    "npz_layer_ids_float": ("a.npz", lambda: _npz({"topk_ids.npy": _npy_bytes(np.array([[0, 1], [1, 2]])),
                                                    "layer_ids.npy": _npy_bytes(np.array([0.5]))}), []),
    "npz_truncated": ("a.npz", lambda: _npz({"topk_ids.npy": _npy_bytes(np.arange(400).reshape(200, 2))})[:120], []),
    # not routing data at all
    "pickle_file": ("p.pkl", _pickle_bytes, []),
    "safetensors_0x80_length": ("s.safetensors", lambda: struct.pack("<Q", 0x0280) + b"{" + b" " * 0x27E + b"}", []),
    "binary_garbage": ("g.bin", lambda: bytes(range(256)) * 4, []),
    "empty_file": ("e.jsonl", lambda: b"", []),
    "whitespace_file": ("w.jsonl", lambda: b"   \n\n  ", []),
    "utf16_text": ("u.jsonl", lambda: json.dumps(_rec()).encode("utf-16"), []),
}


def _source_case(name: str) -> Case:
    fname, content, extra = SOURCES[name]

    def make(d: Path, fname=fname, content=content, extra=extra) -> list[str]:
        (d / fname).write_bytes(content())
        return ["trace", "import", f"{{in}}/{fname}", "-o", "{out}/t.safetensors", *extra]
    return Case(f"import-{name}", "importer", make, fname, ("big",) if name == "npz_bomb" else ())


def _special_cases() -> list[Case]:
    """Paths that are not regular files, through every command that reads one."""
    out = []
    readers = {"import": ["trace", "import", "{in}/x", "-o", "{out}/t.safetensors"],
               "inspect": ["trace", "inspect", "{in}/x"],
               "simulate": ["simulate", "--trace", "{in}/x", "--strategy", "alltoall", "--ranks", "2"],
               "plan": ["plan", "--trace", "{in}/x", "--strategy", "alltoall", "--ranks", "2"]}
    makers = {"fifo": lambda p: os.mkfifo(p), "dir": lambda p: p.mkdir(), "missing": lambda p: None,
              "symlink_loop": lambda p: p.symlink_to(p)}
    for kind, mk in makers.items():
        for reader, argv in readers.items():
            def make(d: Path, mk=mk, argv=argv) -> list[str]:
                mk(d / "x")
                return list(argv)
            out.append(Case(f"special-{reader}-{kind}", "special files", make, "x"))
    return out


def _output_cases() -> list[Case]:
    """Outputs that cannot be written: refused before any work, naming the argument."""
    def src(d: Path) -> None:
        np.save(d / "ids.npy", np.array([[0, 1], [1, 2], [2, 3]]))

    cases = {
        "import_onto_source": (lambda d: (src(d), ["trace", "import", "{in}/ids.npy", "-o", "{in}/ids.npy",
                                                   "--num-experts", "4"])[1], "-o"),
        "import_out_is_dir": (lambda d: (src(d), ["trace", "import", "{in}/ids.npy", "-o", "{out}"])[1], "-o"),
        "import_out_missing_parent": (lambda d: (src(d), ["trace", "import", "{in}/ids.npy", "-o",
                                                          "{out}/no/such/t.safetensors"])[1], "-o"),
        "gen_out_is_dir": (lambda d: ["trace", "gen", "--num-experts", "8", "--top-k", "2", "--tokens", "64",
                                      "--seed", "1", "--uniform", "-o", "{out}"], "-o"),
        "simulate_timeline_dir": (lambda d: ["simulate", "--gen", "maxvio=1", "--strategy", "alltoall", "--ranks", "2",
                                             "--timeline", "{out}"], "--timeline"),
        "simulate_timeline_missing_parent": (lambda d: ["simulate", "--gen", "maxvio=1", "--strategy", "alltoall",
                                                        "--ranks", "2", "--timeline", "{out}/a/b.json"], "--timeline"),
        "compare_out_is_file": (lambda d: ((d / "f").write_text("x"), ["compare", "--trace", "gen:maxvio=1",
                                                                       "--strategies", "alltoall", "--out",
                                                                       "{in}/f"])[1], "--out"),
        "sweep_out_is_file": (lambda d: ((d / "f").write_text("x"), ["sweep", "--model", "mixtral-8x7b", "--over",
                                                                     "maxvio", "--values", "1", "--strategies",
                                                                     "alltoall", "--out", "{in}/f"])[1], "--out"),
    }
    return [Case(f"output-{k}", "outputs", mk, names) for k, (mk, names) in cases.items()]


def cases() -> list[Case]:
    out = [_trace_case(m, "inspect") for m in TRACE_MUTATIONS if m not in INSPECT_ACCEPTS]
    out += [_trace_case(m, r) for r in TRACE_READERS if r != "inspect" for m in OTHER_READER_MUTATIONS]
    out += [_source_case(n) for n in SOURCES]
    out += _special_cases()
    out += _output_cases()
    try:
        from args_cases import argument_cases  # noqa: the per-command argument ranges (same folder)
    except ImportError:
        argument_cases = None
    if argument_cases is not None:
        out += argument_cases(Case)
    from output_cases import output_cases  # noqa: output over input, every command and output flag
    out += output_cases(Case)
    from hostile_cases import hostile_cases  # noqa: model files, HF configs, topology values, sweeps, ...
    out += hostile_cases(Case)
    from surface_cases import surface_cases  # noqa: layer-stack fields, step options, newer surfaces
    out += surface_cases(Case)
    ids = [c.id for c in out]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise ValueError(f"case ids must be unique: {sorted(dupes)}")
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    all_cases = cases()
    if "--count" in sys.argv:
        from collections import Counter
        for g, n in Counter(c.group for c in all_cases).items():
            print(f"{g}: {n}")
        print(f"total: {len(all_cases)}")
    else:
        import tempfile
        for c in all_cases:
            with tempfile.TemporaryDirectory() as tmp:
                indir, outdir = Path(tmp) / "in", Path(tmp) / "out"
                indir.mkdir()
                outdir.mkdir()
                argv = c.build(indir, outdir)
            print(f"{c.id:55s} moonep-sim {' '.join(argv).replace(tmp, '$TMP')}")
