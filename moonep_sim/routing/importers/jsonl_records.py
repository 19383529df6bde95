"""``jsonl-records``: one JSON object per (token, layer), e.g. ``{"problem_id", "token_idx", "layer",
"experts", "gating_probs"}`` (per-token logs written by transformers hooks and analysis scripts)."""

from __future__ import annotations

from moonep_sim.routing.importers.common import pick
from moonep_sim.routing.importers.records import load_records
from moonep_sim.routing.importers.registry import Importer, Sniff, register


def sniff(s: Sniff) -> bool:
    rec = s.first_record
    if isinstance(rec, dict):
        return pick(rec, "ids") is not None and pick(rec, "layer") is not None
    return s.path.suffix == ".jsonl" and s.head.lstrip().startswith(b"{")


register(Importer(
    name="jsonl-records",
    summary="one JSON object per (token, layer): position, layer, top-k expert ids, optionally weights, "
            "a request id and a step field (names: the field table below)",
    drops="dummy blocks (a run of `--warmup-min-rows` rows of one layer with one expert set, or a "
          "power-of-two step of one expert set: warm-up, profiling, graph capture; whatever their weights), "
          "exact repeats of a record; a token missing some layers (generation stopped, log cut mid-pass) keeps "
          "the layers it has under a per-layer token mask, with a warning (`--drop-incomplete-tokens` drops it); "
          "unknown fields are ignored and listed; absent weights become 1/K",
    sniff=sniff, load=lambda path, fmt, opts: load_records(path, fmt, opts), priority=40))
