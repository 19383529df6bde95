"""Number formats of weights, KV caches and saved activations: bytes per element, scales included.

A deployment stores its weights in one format (``--weight-dtype``), runs its GEMMs in another
(``--gemm-dtype``: the peak the GEMMs run at) and keeps its KV cache in a third (``--kv-dtype``).
Memory and the memory-bound decode GEMMs are priced by the *stored* bytes, so a format's bytes per
element count its block scales:

- ``fp32`` 4, ``bf16`` / ``fp16`` 2: no scales.
- ``fp8``: e4m3 with one fp32 scale per 128 x 128 block of a weight (DeepSeek-V3's FP8 checkpoints:
  ``weight_block_size [128, 128]``): 1 + 4 / 16384 bytes per element. As an activation or a KV
  cache: one fp32 scale per 128 elements of a row (DeepSeek-V3's 1 x 128 tiles; DeepEP's fp8
  dispatch rows): 1 + 4 / 128.
- ``mxfp4``: OCP microscaling fp4 (e2m1), one e8m0 (1 byte) scale per 32 elements: 0.5 + 1 / 32.
- ``nvfp4`` (``fp4``): NVIDIA's fp4 (e2m1), one e4m3 (1 byte) scale per 16 elements (+ one fp32 per
  tensor, negligible): 0.5 + 1 / 16.

A format a GPU lacks is refused in one line (:func:`check_supported`): fp8 needs the topology's FP8
peak (``gpu_tflops_fp8 > 0``), the fp4 formats its FP4 peak (``gpu_tflops_fp4 > 0``: Blackwell-class
GPUs; Hopper has no FP4 tensor cores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moonep_sim.errors import require


@dataclass(frozen=True)
class DType:
    """One number format: ``bits`` per element, ``scale_bytes`` per scale, one scale per
    ``block`` elements as a weight and per ``row_block`` elements as an activation / cache row
    (0 = no scales); ``needs``: the GPU peak it needs (``""``, ``"fp8"`` or ``"fp4"``)."""

    name: str
    bits: int
    scale_bytes: float = 0.0
    block: int = 0
    row_block: int = 0
    needs: str = ""

    @property
    def weight_bytes(self) -> float:
        """Bytes per stored weight element, its block scales included."""
        return self.bits / 8 + (self.scale_bytes / self.block if self.block else 0.0)

    @property
    def row_bytes(self) -> float:
        """Bytes per element of an activation or cache row, its per-row-block scales included."""
        return self.bits / 8 + (self.scale_bytes / self.row_block if self.row_block else 0.0)


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("fp32", 32),
    DType("bf16", 16),
    DType("fp16", 16),
    DType("fp8", 8, 4.0, 128 * 128, 128, "fp8"),
    DType("mxfp4", 4, 1.0, 32, 32, "fp4"),
    DType("nvfp4", 4, 1.0, 16, 16, "fp4"),
)}
#: ``fp4`` names NVIDIA's format.
ALIASES = {"fp4": "nvfp4"}
WEIGHT_DTYPES = ("bf16", "fp16", "fp32", "fp8", "mxfp4", "nvfp4", "fp4")
KV_DTYPES = ("bf16", "fp16", "fp8", "mxfp4", "nvfp4", "fp4")


def get_dtype(name: str, what: str = "dtype", choices: tuple[str, ...] = WEIGHT_DTYPES) -> DType:
    """The format called ``name`` (one-line error naming the choices otherwise)."""
    require(isinstance(name, str) and name in choices, f"{what} ({name!r}) must be one of {', '.join(choices)}")
    return DTYPES[ALIASES.get(name, name)]


def check_supported(d: DType, topology: Any, what: str = "dtype") -> DType:
    """``d`` if the topology's GPU runs it, else one line naming the GPU peak it lacks."""
    if d.needs == "fp8":
        require(float(getattr(topology, "gpu_tflops_fp8", 0) or 0) > 0,
                f"{what} ({d.name}) needs FP8 support: topology {topology.name} gives no FP8 peak (gpu tflops_fp8)")
    elif d.needs == "fp4":
        require(float(getattr(topology, "gpu_tflops_fp4", 0) or 0) > 0,
                f"{what} ({d.name}) needs FP4 support: topology {topology.name}'s GPU has no FP4 tensor cores "
                "(gpu tflops_fp4 is 0; Blackwell-class GPUs have them, Hopper does not)")
    return d


__all__ = ["ALIASES", "DTYPES", "DType", "KV_DTYPES", "WEIGHT_DTYPES", "check_supported", "get_dtype"]
