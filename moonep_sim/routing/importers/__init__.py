"""Importers: routing recorded elsewhere -> a moonep-sim trace (see ``routing/trace.py``).

Each source format is one module of this package registering itself (``registry.register``; every
module here other than ``registry``, ``common`` and ``records`` is imported, so a new format is one
new file): a
name, a sniffing function, a loader, and the sentences the docs' format table is generated from
(``formats_markdown``; the record logs' field names: ``fields_markdown``). ``detect_format`` asks
the sniffers in priority order; ``load_source`` parses without writing; ``import_trace`` writes the
trace atomically (nothing is written on error).

Formats: ``npy`` (arrays), ``vllm-routes`` and ``jsonl-records`` (record logs, see ``records.py``
for steps, dummy blocks and duplicates), ``counts-json`` (histograms).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import importlib
import pkgutil

from moonep_sim.errors import TraceFormatError
from moonep_sim.io import check_output_path, file_kind
from moonep_sim.routing.importers.common import (FIELDS, STEPS_FROM, ImportOptions, Imported, check_sizes, err,
                                                 fields_markdown, model_of)
from moonep_sim.routing.importers.registry import IMPORTERS, Importer, Sniff, by_priority, formats, formats_markdown
from moonep_sim.routing.trace import TraceMeta, write_trace

# Every module of this package other than the shared machinery is a format: importing it registers it,
# so adding a format is adding one file.
_MACHINERY = {"registry", "common", "records"}
for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _m.name not in _MACHINERY and not _m.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["FIELDS", "IMPORTERS", "ImportOptions", "Imported", "Importer", "Sniff", "STEPS_FROM",
           "detect_format", "fields_markdown", "formats", "formats_markdown", "import_trace", "load_source"]


def _is_safetensors(head: bytes, size: int) -> bool:
    """An 8-byte little-endian header length that fits the file, then a JSON object: checked before
    the pickle test, since a length whose low byte is 0x80 looks like a pickle's first bytes."""
    if len(head) < 9:
        return False
    n = int.from_bytes(head[:8], "little")
    return 2 <= n <= size - 8 and head[8:9] == b"{"


def _is_pickle(head: bytes) -> bool:
    return len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5


def detect_format(path: str | os.PathLike) -> str:
    """The importer format of ``path`` (one of ``formats()``), from its first bytes and first record."""
    p = Path(path)
    where = str(p)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise err(where, "expected a file, found none") from None
    except OSError as e:
        raise err(where, f"expected a readable file, found {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):  # before opening: a named pipe would block the read
        raise err(where, f"expected a regular file, found {file_kind(st.st_mode)}")
    try:
        with open(p, "rb") as f:
            head = f.read(4096)
    except OSError as e:
        raise err(where, f"expected a readable file, found {e.strerror}") from None
    if not head.strip():
        raise err(where, "expected routing data, found an empty file")
    if _is_safetensors(head, st.st_size):
        raise err(where, "expected routing data to import, found a safetensors file (a moonep-sim trace is "
                         "used as it is; other safetensors files are not routing logs)")
    if _is_pickle(head):
        raise err(where, "expected routing data, found a Python pickle (pickled files are never loaded; "
                         "save arrays with numpy.save or as JSON)")
    is_numpy = head.startswith(b"\x93NUMPY") or head.startswith(b"PK\x03\x04")
    if p.suffix in (".npy", ".npz") and not is_numpy:
        raise err(where, f"expected a {p.suffix} file (numpy magic bytes), found other content")
    first = None
    if not is_numpy:
        line = head.decode("utf-8", errors="replace").lstrip().split("\n", 1)[0].strip()
        try:
            first = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            first = None      # a multi-line JSON document, or not JSON
    s = Sniff(p, head, first)
    for imp in by_priority():
        if imp.sniff(s):
            return imp.name
    raise err(where, f"expected one of the formats {', '.join(formats())}, found unrecognised content "
                     f"starting {head[:24]!r}")


def load_source(src: str | os.PathLike, format: str = "auto", *, model=None, num_experts: int | None = None,
                top_k: int | None = None, warmup_min_rows: int = 64, capture_min_rows: int = 8,
                steps_from: str = "auto", dominant_share: float = 0.3, incomplete_tokens: str = "keep") -> Imported:
    """Parse ``src`` into trace metadata and tensors (nothing is written).

    format: ``auto`` or a registered format. model: a preset name, a model file or a ModelSpec (its
    E and K must agree with the file). incomplete_tokens: ``keep`` (default: a token a log records
    at only some layers keeps those layers, under a per-layer ``token_mask``) or ``drop``. Other
    options: see :class:`common.ImportOptions`.
    """
    path = Path(src)
    if format == "auto":
        format = detect_format(path)
    elif format not in IMPORTERS:
        raise TraceFormatError(f"--format ({format!r}) must be auto or one of {', '.join(formats())}")
    else:
        detect_format(path)  # existence, emptiness, pickle checks
    if steps_from not in STEPS_FROM:
        raise TraceFormatError(f"--steps-from ({steps_from!r}) must be one of {', '.join(STEPS_FROM)}")
    for name, v in (("--warmup-min-rows", warmup_min_rows), ("--capture-min-rows", capture_min_rows)):
        if not isinstance(v, int) or v < 0:
            raise TraceFormatError(f"{name} ({v!r}) must be an integer >= 0 (0 disables the detection)")
    if incomplete_tokens not in ("keep", "drop"):
        raise TraceFormatError(f"incomplete tokens ({incomplete_tokens!r}) must be keep or drop")
    if not 0 < dominant_share <= 1:
        raise TraceFormatError(f"--dominant-share ({dominant_share!r}) must be in (0, 1]")
    opts = ImportOptions(model=model, num_experts=num_experts, top_k=top_k, warmup_min_rows=warmup_min_rows,
                         capture_min_rows=capture_min_rows, steps_from=steps_from, dominant_share=dominant_share,
                         incomplete_tokens=incomplete_tokens)
    check_sizes(opts)  # --num-experts / --top-k in range before the file is parsed
    model_of(opts)     # a bad --model fails before the file is parsed
    return IMPORTERS[format].load(path, format, opts)


def import_trace(src: str | os.PathLike, out: str | os.PathLike, format: str = "auto", **kwargs) -> TraceMeta:
    """Import ``src`` and write the trace ``out`` atomically (nothing is written on error)."""
    check_output_path(out, "-o", inputs=(src,))  # before parsing: `trace import X -o X` never runs
    imp = load_source(src, format, **kwargs)
    write_trace(out, imp.meta, imp.tensors, what="-o", inputs=(src,))
    return imp.meta
