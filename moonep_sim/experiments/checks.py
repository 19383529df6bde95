"""Argument checks of the Python API, at construction: each argument's type and range, refused with
one line naming the argument (:class:`~moonep_sim.errors.ConfigError`), never a raw TypeError,
ValueError or AttributeError from deep inside a run.

:func:`check_scenario_args` is what ``Scenario(...)`` runs when it is built (the values that need
files or the registry -- a trace's layer ids, a strategy's options -- are checked when it resolves);
:func:`check_axis_value` is the one check every swept or ``--by`` value goes through, the same as
the flag it stands for (``--tokens-per-rank``, ``--ranks``, ``--maxvio``, a topology constant).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from moonep_sim.errors import ConfigError, is_int, require
from moonep_sim.limits import MAX_LAYERS, MAX_RANKS, MAX_TOKEN_PADDING, MAX_TOKENS_PER_RANK


def _is_path(v: Any) -> bool:
    return isinstance(v, (str, os.PathLike))


def check_scenario_args(sc) -> None:
    """Every :class:`~moonep_sim.experiments.Scenario` argument checked for type and range."""
    from moonep_sim.experiments.routing import GeneratorSpec
    from moonep_sim.models import ModelSpec
    from moonep_sim.plan import ClusterShape, GlobalRouting, RowCosts
    from moonep_sim.sim.topology import Topology

    r = sc.routing
    require(_is_path(r) and str(r) != "" or isinstance(r, (GeneratorSpec, GlobalRouting)),
            f"routing ({r!r}) must be a trace path, a generator spec ('gen:KEY=VALUE,...' or a GeneratorSpec) "
            "or a GlobalRouting")
    m = sc.model
    require(m is None or (_is_path(m) and str(m) != "") or isinstance(m, (ModelSpec, Mapping)),
            f"model ({m!r}) must be None (the routing's), a preset name, a model file, a mapping of fields or a "
            "ModelSpec")
    _check_cluster(sc.cluster, ClusterShape)
    t = sc.topology
    require((_is_path(t) and str(t) != "") or isinstance(t, Topology),
            f"topology ({t!r}) must be a preset name, a .toml file or a Topology")
    _check_strategies(sc.strategies)
    o = sc.options
    require(isinstance(o, Mapping) and all(isinstance(k, str) and isinstance(v, Mapping) for k, v in o.items()),
            f"options ({o!r}) must map a strategy name to a mapping of its options, e.g. {{'capacity': {{'cf': 1.25}}}}")
    lay = sc.layers
    if lay is not None:
        require(isinstance(lay, Sequence) and not isinstance(lay, (str, bytes)),
                f"layers ({lay!r}) must be a list of layer ids, e.g. [0, 1] (None: every layer)")
        require(len(lay) >= 1, "layers ([]) must name at least one layer id (None: every layer)")
        require(len(lay) <= MAX_LAYERS, f"layers ({len(lay)} ids) must name at most {MAX_LAYERS}")
        for i in lay:
            require(is_int(i) and i >= 0, f"layers entry ({i!r}) must be a layer id, an integer >= 0")
    s = sc.steps
    require(s is None or isinstance(s, str),
            f"steps ({s!r}) must be a step selection string: 'all', 'N', 'A-B', 'A-' or a comma list such as '0,2,5-7'")
    require(isinstance(sc.dispatch_dtype, str), f"dispatch_dtype ({sc.dispatch_dtype!r}) must be 'bf16' or 'fp8'")
    p = sc.token_padding
    require(is_int(p), f"token_padding ({p!r}) must be an integer in [1, {MAX_TOKEN_PADDING}]")
    require(1 <= p <= MAX_TOKEN_PADDING, f"token_padding ({p}) must be in [1, {MAX_TOKEN_PADDING}]")
    require(isinstance(sc.placement, str), f"placement ({sc.placement!r}) must be 'home' or 'round-robin'")
    n = sc.redundant_experts
    require(is_int(n) and n >= 0, f"redundant_experts ({n!r}) must be an integer >= 0 (extra expert slots)")
    require(sc.costs is None or isinstance(sc.costs, RowCosts),
            f"costs ({sc.costs!r}) must be None (the model's) or a RowCosts")


def _check_cluster(c: Any, ClusterShape) -> None:
    if c is None or isinstance(c, (str, ClusterShape)):
        return
    what = ("must be R, 'R/G', (R, G) or a ClusterShape: R EP ranks (0: the default), G GPUs per node "
            "(0: the topology's)")
    if is_int(c):
        require(1 <= c <= MAX_RANKS, f"cluster ({c}) {what}, R at most {MAX_RANKS}")
        return
    require(isinstance(c, (tuple, list)) and len(c) == 2, f"cluster ({c!r}) {what}")
    R, G = c
    require(is_int(R) and 0 <= R <= MAX_RANKS, f"cluster ranks ({R!r}) must be an integer in [0, {MAX_RANKS}] "
                                                "(0: the default)")
    require(is_int(G) and 0 <= G <= MAX_RANKS, f"cluster gpus_per_node ({G!r}) must be an integer in [0, {MAX_RANKS}] "
                                                "(0: the topology's)")


def _check_strategies(s: Any) -> None:
    what = "must be 'a,b', a list of names or a list of (name, options) pairs"
    if isinstance(s, str):
        return
    require(isinstance(s, Sequence), f"strategies ({s!r}) {what}")
    for it in s:
        ok = isinstance(it, str) or (isinstance(it, (tuple, list)) and len(it) == 2 and isinstance(it[0], str)
                                     and isinstance(it[1], Mapping))
        require(ok, f"strategies entry ({it!r}) {what}")


# ------------------------------------------------------------------------------ swept values
def check_axis_value(axis: str, v: Any, topo=None, flag: str = "--values") -> None:
    """One value of a sweep axis (``--over X --values``, ``--by X --by-values``), checked as the flag
    it stands for: type, finiteness, integer-ness and range; a topology constant as its field in
    the topology file (an integer field takes integers only: ``gpus_per_node 1.5`` is refused, not
    truncated). One line naming ``flag``, the axis and the value."""
    where = f"{flag} value ({v!r}) of {axis}"
    require(isinstance(v, (int, float)) and not isinstance(v, bool), f"{where} must be a number")
    require(math.isfinite(v), f"{where} must be finite")
    if axis in ("tokens-per-rank", "tokens_per_rank"):
        require(v == int(v) and 1 <= v <= MAX_TOKENS_PER_RANK,
                f"{where} must be an integer in [1, {MAX_TOKENS_PER_RANK}], as --tokens-per-rank")
    elif axis in ("ep", "ranks"):
        require(v == int(v) and 1 <= v <= MAX_RANKS, f"{where} must be an integer in [1, {MAX_RANKS}], as --ranks")
    elif axis == "maxvio":
        require(v > 0, f"{where} must be > 0, as --maxvio")
    elif topo is not None and hasattr(topo, axis):
        from moonep_sim.sim.topology import MAX_CONSTANT

        cur = getattr(topo, axis)
        require(abs(v) <= MAX_CONSTANT, f"{where} must be at most {MAX_CONSTANT:g} in magnitude, as in a topology file")
        if isinstance(cur, int) and not isinstance(cur, bool):
            require(v == int(v), f"{where} must be an integer: the topology's {axis} is one")


def check_axis_values(axis: str, values: Sequence[Any], topo=None, flag: str = "--values") -> None:
    """:func:`check_axis_value` of each value; at least one value."""
    if not values:
        raise ConfigError(f"{flag} must hold at least one value")
    for v in values:
        check_axis_value(axis, v, topo, flag)


# ------------------------------------------------------------------------------ cluster addresses
_HOST_RE = r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
CLUSTER_SCHEMES = ("tcp", "tls")


def check_cluster_address(address: Any, what: str = "--cluster") -> str:
    """A Dask scheduler address, checked before Dask sees it: ``[tcp://|tls://]HOST:PORT`` with HOST a
    host name, an IPv4 address or a bracketed IPv6 address and PORT in [1, 65535]. ``inproc://``
    (inside one process), ``ucx://`` (needs UCX) and anything else are refused in one line naming
    ``what``. Returns the address."""
    import ipaddress
    import re

    form = "must look like tcp://HOST:PORT (e.g. tcp://10.0.0.5:8786)"
    require(isinstance(address, str) and address.strip() != "", f"{what} ({address!r}) {form}")
    text = address.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "tcp", text
    require(scheme in CLUSTER_SCHEMES, f"{what} ({text!r}) {form}: scheme {scheme}:// is not one of "
                                       f"{', '.join(s + '://' for s in CLUSTER_SCHEMES)}")
    if rest.startswith("["):
        host, close, port = rest[1:].partition("]")
        require(bool(close) and port.startswith(":"), f"{what} ({text!r}) {form}: an IPv6 host is [ADDR]:PORT")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"{what} ({text!r}) {form}: {host!r} is not an IPv6 address") from None
        port = port[1:]
    else:
        host, colon, port = rest.rpartition(":")
        require(bool(colon) and host != "", f"{what} ({text!r}) {form}: HOST:PORT needs both")
        require(re.fullmatch(_HOST_RE, host) is not None and len(host) <= 253,
                f"{what} ({text!r}) {form}: {host!r} is not a host name or an IPv4 address")
    require(port.isdigit() and 1 <= int(port) <= 65535, f"{what} ({text!r}) {form}: port ({port!r}) must be in [1, 65535]")
    return text
