"""How the real-record samples in this folder were cut from their public sources (the tests read
these samples only, never a folder outside the repository).

Sources (no licence files; the attribution in traces/SOURCES.md travels with every copy):

- ``mixtral-8x7b_humaneval_routing.jsonl`` (Mario928/speculative-moe @ 216e26eb86ee09fa46bb0e8c000be7e9758e10b6 :
  routing_data_collected/humaneval_2_routing.jsonl; 10779 records, ordered by problem, then layer,
  then token) -> ``mixtral-8x7b_humaneval_routing_sample.jsonl``: every record whose token_idx < 8
  (tokens 0-7 of both HumanEval problems, all 32 layers) plus every record of the 5 tokens the
  generation left without all 32 layers (problem 0 tokens 81-82, problem 1 tokens 252-254: 123
  records), in the source's order: 635 records.
- ``olmoe-1b-7b_layer0_vllm_routes.jsonl`` (KaxitPandya/cerebras-assesment2 @ 7c3cceb3fad3cc714c106ccca03fdb3599fe74a9 :
  moe_routes.jsonl; a meta line, a dummy block of 2048 identical rows, 4471 real rows) ->
  ``olmoe-1b-7b_layer0_vllm_routes_sample.jsonl``: the meta line, the first 100 rows of the dummy
  block (above ``trace import``'s default ``--warmup-min-rows 64``) and the first 300 real rows.
- ``switch-base-128_expert_counts.json`` (cyanmishra92/specMoE @ d921338e : routing_data/expert_statistics_3d.json;
  16 KB): copied whole.

Usage (a folder holding the three source files):
    python traces/cut_real_samples.py SOURCE_DIR            # writes the samples next to this script
    python traces/cut_real_samples.py SOURCE_DIR --check    # only compares with the shipped samples
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MIXTRAL_TOKENS = 8
OLMOE_DUMMY, OLMOE_REAL = 100, 300


def cut(src: Path) -> dict[str, bytes]:
    lines = (src / "mixtral-8x7b_humaneval_routing.jsonl").read_bytes().splitlines(keepends=True)
    recs = [json.loads(ln) for ln in lines]
    per_token: dict[tuple, int] = {}
    for r in recs:
        per_token[(r["problem_id"], r["token_idx"])] = per_token.get((r["problem_id"], r["token_idx"]), 0) + 1
    keep = [ln for ln, r in zip(lines, recs)
            if r["token_idx"] < MIXTRAL_TOKENS or per_token[(r["problem_id"], r["token_idx"])] != 32]
    olmoe = (src / "olmoe-1b-7b_layer0_vllm_routes.jsonl").read_bytes().splitlines(keepends=True)
    real_start = 1 + 2048
    return {"mixtral-8x7b_humaneval_routing_sample.jsonl": b"".join(keep),
            "olmoe-1b-7b_layer0_vllm_routes_sample.jsonl": b"".join(
                olmoe[:1 + OLMOE_DUMMY] + olmoe[real_start:real_start + OLMOE_REAL]),
            "switch-base-128_expert_counts.json": (src / "switch-base-128_expert_counts.json").read_bytes()}


def main(argv: list[str]) -> int:
    out = cut(Path(argv[0]))
    if "--check" in argv:
        same = all((HERE / name).read_bytes() == data for name, data in out.items())
        print("the shipped samples match" if same else "the shipped samples DIFFER")
        return 0 if same else 1
    for name, data in out.items():
        (HERE / name).write_bytes(data)
        print(f"wrote {HERE / name} ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
