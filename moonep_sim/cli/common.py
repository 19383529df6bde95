"""Helpers shared by subcommands: JSON output, option parsing, a rich console."""

from __future__ import annotations

import json
import sys
from typing import Any

from moonep_sim.errors import ConfigError
from moonep_sim.io import to_jsonable


def print_json(obj: Any) -> None:
    json.dump(to_jsonable(obj), sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def parse_kv(items: list[str] | None, what: str = "--opt") -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``."""
    out: dict[str, str] = {}
    for it in items or []:
        if "=" not in it:
            raise ConfigError(f"{what} ({it!r}) must look like key=value")
        k, v = it.split("=", 1)
        out[k.strip().replace("-", "_")] = v.strip()
    return out


def parse_int_list(text: str | None, what: str) -> list[int] | None:
    """``"0,2,5-7"`` -> ``[0, 2, 5, 6, 7]``; None stays None."""
    if text is None:
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part[1:]:
                a, b = part.split("-", 1) if not part.startswith("-") else (part, part)
                out.extend(range(int(a), int(b) + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise ConfigError(f"{what} ({text!r}) must be a list of integers like 0,2,5-7") from None
    return out


def console():
    from rich.console import Console
    return Console()
