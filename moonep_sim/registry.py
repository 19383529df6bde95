"""Named records of one kind, each registered by the module that defines it, looked up by name.

The one pattern behind every extension point that grows: strategies (``moonep_sim.strategies``),
routing importers (``moonep_sim.routing.importers``), attention kinds
(``moonep_sim.step.attention``) and overlap schedules (``moonep_sim.step.schedules``). A
registry knows its package and the modules that register into it (its *module list*: the one
line a new record adds); it imports them the first time it is asked for a name, so registering
costs nothing until the records are used, and a module may import the registry it registers into
without a circle.

Adding a record of a kind: one new module in the registry's package that calls
``REGISTRY.register(record)`` (a record has a ``name``; a class works as a decorator target), and
its module name in the module list.
"""

from __future__ import annotations

import importlib
from typing import Generic, Iterator, Sequence, TypeVar

from moonep_sim.errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """Records by name, in registration order.

    what: what a record is, for errors (``"overlap"``, ``"attention kind"``).
    package / modules: the modules (``package.module``) that register the built-in records,
        imported on the first lookup.
    replace: whether registering a name again replaces the record (True: a test or notebook may
        re-run a module) or is refused with a one-line :class:`ConfigError` (False).
    """

    def __init__(self, what: str, package: str = "", modules: Sequence[str] = (), replace: bool = False) -> None:
        self.what = what
        self.package = package
        self.modules = tuple(modules)
        self.replace = replace
        self._records: dict[str, T] = {}
        self._loaded = not self.modules

    def register(self, record: T) -> T:
        """Add ``record`` under ``record.name``; returns it (so it serves as a class decorator)."""
        name = getattr(record, "name", None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{self.what} record ({record!r}) must have a non-empty string name")
        if name in self._records and not self.replace:
            raise ConfigError(f"{self.what} ({name!r}) must be registered once")
        self._records[name] = record
        return record

    def load(self) -> None:
        """Import the module list (once): what registers the built-in records."""
        if self._loaded:
            return
        self._loaded = True
        try:
            for mod in self.modules:
                importlib.import_module(f"{self.package}.{mod}")
        except BaseException:
            self._loaded = False  # asked again, the modules are imported again (and fail again, loudly)
            raise

    def get(self, name: str) -> T:
        """The record called ``name``; a one-line :class:`ConfigError` naming the choices otherwise."""
        self.load()
        if not isinstance(name, str) or name not in self._records:
            raise ConfigError(f"{self.what} ({name!r}) must be one of {', '.join(self._records)}")
        return self._records[name]

    def names(self) -> tuple[str, ...]:
        self.load()
        return tuple(self._records)

    def items(self) -> list[tuple[str, T]]:
        self.load()
        return list(self._records.items())

    def values(self) -> list[T]:
        self.load()
        return list(self._records.values())

    def copy(self) -> "Registry[T]":
        """A registry with the same records (loaded), to register into without touching this one."""
        self.load()
        out: Registry[T] = Registry(self.what, self.package, (), self.replace)
        out._records = dict(self._records)
        return out

    def __contains__(self, name: object) -> bool:
        self.load()
        return name in self._records

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        self.load()
        return len(self._records)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._records) or 'not loaded'})"


__all__ = ["Registry"]
