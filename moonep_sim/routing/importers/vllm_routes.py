"""``vllm-routes``: a vLLM-hook route log: an optional first line ``{"type": "meta", "num_experts",
"top_k", "layers_logged", "model_id", ...}`` then ``{"type": "route", "req_id", "token_idx",
"layer", "topk_ids", "topk_weights"}`` rows (positions often restart every forward pass and the
request id is often constant: the hook sees a batch)."""

from __future__ import annotations

from moonep_sim.routing.importers.records import load_records
from moonep_sim.routing.importers.registry import Importer, Sniff, register


def sniff(s: Sniff) -> bool:
    rec = s.first_record
    return isinstance(rec, dict) and (rec.get("type") in ("meta", "route") or "topk_ids" in rec)


register(Importer(
    name="vllm-routes",
    summary="a route log: optional `{\"type\": \"meta\"}` first line (num_experts, top_k, layers_logged, "
            "model_id), then `{\"type\": \"route\"}` rows; records of other types are skipped",
    drops="as `jsonl-records`; the meta line's num_experts, top_k and layers_logged must agree with the "
          "records (an error otherwise)",
    sniff=sniff, load=lambda path, fmt, opts: load_records(path, fmt, opts), priority=50))
