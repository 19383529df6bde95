"""The importer registry: one module per source format registers a name, a sniffing function and a
loader; ``detect_format`` asks each sniffer in priority order, and the docs' format table is
generated from the registrations (``formats_markdown``).

Adding a format is one new module in this package that calls :func:`register` (the package imports
every module it holds).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moonep_sim.registry import Registry


@dataclass(frozen=True)
class Sniff:
    """What a sniffer sees: the file's path, its first 4 KiB and, for text, the first JSON line
    parsed (None when it is not one JSON value)."""

    path: Path
    head: bytes
    first_record: Any


@dataclass(frozen=True)
class Importer:
    """One source format.

    name: the ``--format`` value.  summary: what the format holds (one sentence, for the docs).
    drops: what the importer drops or assumes, and why (for the docs).
    sniff: ``Sniff -> bool``, True when the file is in this format.
    load: ``(path, format name, options) -> Imported`` (see ``common.ImportOptions``).
    priority: sniffers run from the highest priority down; the first True wins.
    """

    name: str
    summary: str
    drops: str
    sniff: Callable[[Sniff], bool]
    load: Callable[..., Any]
    priority: int = 0


#: The importers by format name (the package imports every module of its own, each registering one).
IMPORTERS: Registry[Importer] = Registry("importer")


def register(importer: Importer) -> Importer:
    """Add ``importer`` to the registry (names are unique)."""
    return IMPORTERS.register(importer)


def by_priority() -> list[Importer]:
    return sorted(IMPORTERS.values(), key=lambda i: -i.priority)


def formats() -> tuple[str, ...]:
    """Registered format names, in detection order."""
    return tuple(i.name for i in by_priority())


def formats_markdown() -> str:
    """The docs' table of formats (name, what it holds, what the importer drops and why)."""
    rows = ["| format | what it holds | what the importer drops or assumes, and why |", "| --- | --- | --- |"]
    for i in by_priority():
        rows.append(f"| `{i.name}` | {i.summary} | {i.drops} |")
    return "\n".join(rows)
