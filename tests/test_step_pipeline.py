"""The step pipeline's generated layers: built without re-validation, equal to the checked path."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moonep_sim.errors import ConfigError
from moonep_sim.experiments import GeneratorSpec, Scenario
from moonep_sim.experiments.step import GeneratedLayer
from moonep_sim.plan import GlobalRouting
from moonep_sim.step.run import ROUTING_FIELDS, trusted_routing


def test_trusted_routing_sets_every_field_of_global_routing():
    assert ROUTING_FIELDS == tuple(f.name for f in dataclasses.fields(GlobalRouting))


# the race (V3's groups, Mixtral's few experts) and the Plackett-Luce fast path (K3: T x E > 4M)
@pytest.mark.parametrize("model,maxvio,tokens", [("deepseek-v3", 1.5, 257), ("mixtral-8x7b", 0.5, 257),
                                                 ("kimi-k3", 2.0, 700)])
def test_a_generated_layer_equals_the_checked_routing(model, maxvio, tokens):
    sc = Scenario(routing=GeneratorSpec(model=model, maxvio=maxvio, tokens_per_rank=tokens, layers=3), cluster="8/4",
                  strategies=["alltoall"])
    src = sc.resolved.source
    fast = GeneratedLayer(src, 2, 8)()
    checked = src.global_routing(2, 8)
    for name in ROUTING_FIELDS:
        a, b = getattr(fast, name), getattr(checked, name)
        if isinstance(a, np.ndarray):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        else:
            assert a == b, name
    assert fast.tokens_per_rank_R.tolist() == [tokens] * 8


def test_trusted_routing_refuses_arrays_it_would_have_to_convert():
    ids = np.zeros((4, 2), np.int32)
    ids[:, 1] = 1
    with pytest.raises(ConfigError, match="must be int64"):
        trusted_routing(ids, np.ones((4, 2), np.float32), 4, 2)
    with pytest.raises(ConfigError, match="same shape"):
        trusted_routing(ids.astype(np.int64), np.ones((4, 3), np.float32), 4, 2)
