"""Generated routing pinned bit for bit: a few whole layers of the step's shapes (Kimi-K3 EP64 training,
262,144 tokens x top-16 of 896 at maxvio 2, layers whose maxvio calibration lands at once and
layers it refines over 5-6 draws; DeepSeek-V3 EP32 decode, 1024 x top-8 of 256 in 8 groups keep 4)
and of each sampler's other paths (the grouped fast path, rows sent to their exact remainder, a
drifting multi-block trace, the race with and without logits), each as a SHA-256 of its ids,
weights and logits. The digests were taken from the generator before its compiled kernels: a
speed change that moves one draw fails here.

The draws rest on numpy's float64 ``exp`` (popularity, the race's weights) and float32 ``log``
(the race's scores); the digests are those of numpy 2 on x86-64."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from moonep_sim.routing.generators import generate

PINNED = [
    ("k3-layer0", (896, 16, 262144, 0), {'maxvio': 2.0}, [1], "5d949fc5ab16469214e9cb07ee4f2dec9276cf87461c660d837b73c40cf2976e"),
    ("k3-layer8", (896, 16, 262144, 8), {'maxvio': 2.0}, [5], "eee224287310364ed12c9fe0fa8e309589c862583485cf246b79c463a4339126"),
    ("k3-layer9", (896, 16, 262144, 9), {'maxvio': 2.0}, [6], "5e347952b878a7e249e698a647346976908bd3ab75f3febaaaabbadd59938a2f"),
    ("v3-decode-layer0", (256, 8, 1024, 0), {'maxvio': 1.0, 'groups': 8, 'topk_groups': 4}, [1], "467258343b1cb2268c4d1f4ff87267c82ab5ad8220f8c0a3cd0465037193266f"),
    ("v3-decode-layer1", (256, 8, 1024, 1), {'maxvio': 1.0, 'groups': 8, 'topk_groups': 4}, [2], "6c5e11e38abc8b0e54adc08e15263d2464c027748ce6f77993a97aaea08c8ccd"),
    ("v3-decode-layer2", (256, 8, 1024, 2), {'maxvio': 1.0, 'groups': 8, 'topk_groups': 4}, [8], "ebefd8c271161261ccc34283d781d173e1fd9b15a7954094b7cfc600ca953e8c"),
    ("v3-decode-layer3", (256, 8, 1024, 3), {'maxvio': 1.0, 'groups': 8, 'topk_groups': 4}, [3], "259d0bc9203f206db093109457816111134aeecc961f1084a5a57057e6d1cdc4"),
    ("v3-decode-layer4", (256, 8, 1024, 4), {'maxvio': 1.0, 'groups': 8, 'topk_groups': 4}, [5], "4fd5ecf40e0d43cd2a409aaa2b5716fc4315e1611cbcdf015fb1ebafe0fba940"),
    ("v3-train-grouped", (256, 8, 32768, 1), {'maxvio': 1.0, 'groups': 8, 'topk_groups': 4}, [6], "526e2b32e1bd9f90e6da8cce7b750faf81a4b7487fc87fc00d59796fa82405ca"),
    ("heavy-remainder", (64, 8, 100000, 2), {'sigma': 2.5}, [None], "5911b76fe9960263e266bc5cd748d0bec2478a2c0ffb9e86e36d3d843661b036"),
    ("drift-blocks", (64, 8, 100000, 3), {'maxvio': 4.0, 'layers': 2, 'steps': 2, 'drift': 0.3}, [1, 1, 1, 1], "72566ef402769af722b7412fc06811aabf58db7c796cfa1546804c0dbf468a29"),
    ("race", (64, 6, 2000, 4), {'maxvio': 0.8}, [5], "f0083053f1284e9aabf2afa84dc0d2e60ba4d358ae8ff2f52d194521c22f9a4b"),
    ("race-logits", (64, 6, 2000, 5), {'maxvio': 0.8, 'with_logits': True}, [5], "0150ee02a3d2b52c489b941bc8011c4e011bf32364259c8824c68499e97f4f3f"),
]


@pytest.mark.parametrize("name,args,kw,samples,digest", PINNED, ids=[p[0] for p in PINNED])
def test_generated_routing_is_the_pinned_one(name, args, kw, samples, digest):
    g = generate(*args, **kw)
    h = hashlib.sha256()
    for a in (g.topk_ids_LTK, g.topk_weights_LTK, g.router_logits_LTE):
        if a is not None:
            h.update(np.ascontiguousarray(a).tobytes())
    assert g.topk_ids_LTK.dtype == np.int64 and g.topk_weights_LTK.dtype == np.float32
    assert g.topk_ids_LTK.shape == (kw.get("layers", 1), args[2] * kw.get("steps", 1), args[1])
    assert [b.get("calibration_samples") for b in g.report["blocks"]] == samples
    assert h.hexdigest() == digest
