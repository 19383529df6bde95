"""The Python API raises the package's errors: plausible misuse of ``Scenario``, ``GeneratorSpec``
and ``ModelSpec`` is refused at construction with a ConfigError naming the argument -- never a raw
TypeError / ValueError / AttributeError from deep inside a run, and never silently accepted
(``Scenario(layers=0)`` used to simulate every layer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from moonep_sim.errors import ConfigError, MoonEPSimError
from moonep_sim.experiments import GeneratorSpec, Scenario
from moonep_sim.models import ModelSpec

G = "gen:maxvio=1,tokens-per-rank=64"
TRACE = str(Path(__file__).resolve().parents[1] / "traces" / "mixtral-8x7b_humaneval.safetensors")

# (id, keyword arguments, what the message must name)
SCENARIO_MISUSE = [
    ("layers-0", dict(routing=TRACE, layers=0), r"^layers \(0\)"),
    ("layers-empty", dict(routing=TRACE, layers=[]), r"^layers \(\[\]\)"),
    ("layers-string", dict(routing=TRACE, layers="0,1"), r"^layers \('0,1'\)"),
    ("layers-float", dict(routing=TRACE, layers=[1.5]), r"^layers entry \(1\.5\)"),
    ("layers-negative", dict(routing=TRACE, layers=[-1]), r"^layers entry \(-1\)"),
    ("layers-bool", dict(routing=TRACE, layers=[True]), r"^layers entry \(True\)"),
    ("token_padding-2.5", dict(routing=G, token_padding=2.5), r"^token_padding \(2\.5\)"),
    ("token_padding-str", dict(routing=G, token_padding="4"), r"^token_padding \('4'\)"),
    ("token_padding-bool", dict(routing=G, token_padding=True), r"^token_padding \(True\)"),
    ("token_padding-0", dict(routing=G, token_padding=0), r"^token_padding \(0\)"),
    ("routing-None", dict(routing=None), r"^routing \(None\)"),
    ("routing-int", dict(routing=5), r"^routing \(5\)"),
    ("routing-list", dict(routing=[]), r"^routing \(\[\]\)"),
    ("routing-empty", dict(routing=""), r"^routing \(''\)"),
    ("model-empty", dict(routing=G, model=""), r"^model \(''\)"),
    ("model-int", dict(routing=G, model=5), r"^model \(5\)"),
    ("cluster-tuple-str", dict(routing=G, cluster=(8, "a")), r"^cluster gpus_per_node \('a'\)"),
    ("cluster-tuple-float", dict(routing=G, cluster=(2.5, 1)), r"^cluster ranks \(2\.5\)"),
    ("cluster-negative", dict(routing=G, cluster=-8), r"^cluster \(-8\)"),
    ("cluster-float", dict(routing=G, cluster=2.5), r"^cluster \(2\.5\)"),
    ("cluster-three", dict(routing=G, cluster=(8, 2, 1)), r"^cluster \(\(8, 2, 1\)\)"),
    ("topology-int", dict(routing=G, topology=5), r"^topology \(5\)"),
    ("topology-None", dict(routing=G, topology=None), r"^topology \(None\)"),
    ("strategies-int", dict(routing=G, strategies=5), r"^strategies \(5\)"),
    ("strategies-None", dict(routing=G, strategies=None), r"^strategies \(None\)"),
    ("strategies-entry-int", dict(routing=G, strategies=[5]), r"^strategies entry \(5\)"),
    ("options-int", dict(routing=G, options=5), r"^options \(5\)"),
    ("options-value-int", dict(routing=G, strategies="alltoall", options={"alltoall": 5}), r"^options \("),
    ("steps-float", dict(routing=TRACE, steps=5.5), r"^steps \(5\.5\)"),
    ("steps-list", dict(routing=TRACE, steps=[1]), r"^steps \(\[1\]\)"),
    ("dispatch_dtype-int", dict(routing=G, dispatch_dtype=5), r"^dispatch_dtype \(5\)"),
    ("placement-int", dict(routing=G, placement=5), r"^placement \(5\)"),
    ("redundant_experts-negative", dict(routing=G, redundant_experts=-1), r"^redundant_experts \(-1\)"),
    ("redundant_experts-float", dict(routing=G, redundant_experts=2.0), r"^redundant_experts \(2\.0\)"),
    ("redundant_experts-bool", dict(routing=G, redundant_experts=True), r"^redundant_experts \(True\)"),
    ("costs-int", dict(routing=G, costs=5), r"^costs \(5\)"),
    ("costs-dict", dict(routing=G, costs={}), r"^costs \(\{\}\)"),
]


@pytest.mark.parametrize("kw,names", [pytest.param(kw, n, id=i) for i, kw, n in SCENARIO_MISUSE])
def test_scenario_misuse_is_refused_at_construction_naming_the_argument(kw, names):
    with pytest.raises(ConfigError, match=names):
        Scenario(**kw)


def test_scenario_misuse_table_covers_every_argument():
    import dataclasses

    named = {i.split("-")[0] for i, _, _ in SCENARIO_MISUSE}
    assert {f.name for f in dataclasses.fields(Scenario)} <= named


def test_a_good_scenario_still_builds_and_replace_rechecks():
    import dataclasses

    sc = Scenario(routing=G, cluster=(2, 0), strategies=["alltoall", ("capacity", {"cf": 1.5})], layers=[0])
    assert sc.resolved.cluster.ranks == 2
    with pytest.raises(ConfigError, match=r"^layers \(\[\]\)"):
        dataclasses.replace(sc, layers=[])


GEN_MISUSE = [
    (dict(layers=float("nan")), "layers"), (dict(tokens_per_rank=float("nan")), "tokens-per-rank"),
    (dict(seed=float("inf")), "seed"), (dict(seed=-1), "seed"), (dict(experts=0), "experts"), (dict(top_k=0), "top-k"),
    (dict(layers=1.5), "layers"), (dict(maxvio=float("inf")), "maxvio"), (dict(hot=2.5, hot_share=0.5), "hot"),
    (dict(tokens_per_rank=True), "tokens-per-rank"), (dict(model=5), "model"),
]


@pytest.mark.parametrize("kw,name", GEN_MISUSE)
def test_generator_spec_misuse_names_the_key(kw, name):
    with pytest.raises(ConfigError, match=rf"generator spec {name} "):
        GeneratorSpec(**kw)


@pytest.mark.parametrize("text,name", [("layers=nan", "layers"), ("tokens-per-rank=nan", "tokens-per-rank"),
                                       ("seed=inf", "seed"), ("seed=-1", "seed"), ("experts=0", "experts"),
                                       ("top-k=0", "top-k"), ("uniform=nan", "uniform")])
def test_generator_spec_text_is_checked_like_the_fields(text, name):
    with pytest.raises(ConfigError, match=rf"generator spec {name} "):
        GeneratorSpec.parse(text)


@pytest.mark.parametrize("field,value", [("hidden", 1 << 63), ("hidden", 2.5), ("expert_ffn", True),
                                         ("shared_experts", -3), ("num_experts", float("nan")), ("layers", "4")])
def test_model_spec_fields_are_typed_and_bounded(field, value):
    kw = dict(name="m", layers=4, moe_layers=4, num_experts=8, top_k=2, shared_experts=0, hidden=64, expert_ffn=32)
    kw[field] = value
    with pytest.raises(ConfigError, match=rf"^{field} \("):
        ModelSpec(**kw)


def test_model_spec_moe_layers_above_layers_is_refused():
    with pytest.raises(ConfigError, match=r"moe_layers \(5\) must be <= layers \(2\)"):
        ModelSpec("m", 2, 5, 8, 2, 0, 64, 32)


def test_every_error_here_is_the_package_s():
    """Not one of the misuse cases escapes as a plain Python exception."""
    for i, kw, _ in SCENARIO_MISUSE:
        try:
            Scenario(**kw)
        except MoonEPSimError:
            continue
        pytest.fail(f"{i}: accepted")
