"""How `traces/qwen1.5-moe-a2.7b_layer0_vllm_routes_sample.jsonl` was cut from its public source.

Source (no licence file; attribution in traces/SOURCES.md travels with every copy):
    weiran0129/vLLM-MoE-Logger @ 43d608127447b9e1bd2ec87e503f934d6f95e195 : Logs/moe_layer0.jsonl
    (a vLLM 0.11.2 route log of Qwen/Qwen1.5-MoE-A2.7B-Chat, 60 experts, top-4, layer 0 only, GSM8K
    prompts; 2498010 characters, ASCII, so character offsets are byte offsets).

The file opens with its meta line and a long dummy (profiling) block: every row picks experts
[43, 5, 7, 58] with the same NON-uniform weights, token_idx 0, 1, 2, ...; real traffic follows
(req_id "r1" throughout, token_idx restarting at 0 for each forward pass of 11-16 rows). The sample is
two contiguous slices of it:

    HEAD = text[: text.rindex("\\n", 0, 16000) + 1]    # meta line + dummy rows token_idx 0..80 (81 rows)
    TAIL = text[text.index("\\n", 2450010) + 1 :]      # from the first whole line after offset 2450010 to EOF:
                                                       # 246 real rows (a pass cut at token_idx 2, then 17 whole passes)

HEAD keeps 81 dummy rows of a block thousands of rows long: still above `trace import`'s default
`--warmup-min-rows 64`, so the sample exercises the importer's identical-run detection (with
`--warmup-min-rows 82` or more, or 0, the 81 rows are kept, and they dominate the load).

Usage (from the repository root, with a copy of the source file):
    python traces/cut_qwen15_sample.py moe_layer0.jsonl          # writes the sample next to this script
    python traces/cut_qwen15_sample.py moe_layer0.jsonl --check  # only compares with the shipped sample
The shipped trace is then made with
    python -m moonep_sim trace import traces/qwen1.5-moe-a2.7b_layer0_vllm_routes_sample.jsonl \\
        -o traces/qwen1.5-moe-a2.7b_layer0.safetensors --model qwen1.5-moe-a2.7b
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SOURCE_CHARS = 2498010       # length of the source file at the commit above
HEAD_END_BEFORE = 16000      # the head ends at the last line break before this offset
TAIL_START_AFTER = 2450010   # the tail starts at the first line break after this offset
SAMPLE = Path(__file__).resolve().parent / "qwen1.5-moe-a2.7b_layer0_vllm_routes_sample.jsonl"


def cut(text: str) -> str:
    if len(text) != SOURCE_CHARS:
        raise SystemExit(f"moonep-sim: error: source length ({len(text)} characters) must be {SOURCE_CHARS}: "
                         "not the file at commit 43d60812")
    head = text[: text.rindex("\n", 0, HEAD_END_BEFORE) + 1]
    tail = text[text.index("\n", TAIL_START_AFTER) + 1:]
    return head + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", type=Path, help="a copy of Logs/moe_layer0.jsonl at the commit above")
    ap.add_argument("--check", action="store_true", help="compare with the shipped sample, write nothing")
    a = ap.parse_args(argv)
    sample = cut(a.source.read_text(encoding="ascii"))
    if a.check:
        same = SAMPLE.read_text(encoding="ascii") == sample
        print(f"{SAMPLE.name}: {'identical to' if same else 'DIFFERS from'} the cut of {a.source}")
        return 0 if same else 1
    SAMPLE.write_text(sample, encoding="ascii")
    print(f"{SAMPLE.name}: {len(sample)} characters, {sample.count(chr(10))} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
