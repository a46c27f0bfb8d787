"""Classes by name, for what a flag picks (a model, a task, a loss, an image source). A built-in entry is one
line, ``declare(name, "module:Class")``, in a light registration module: its name is known without importing
the class's module (``--help`` lists it without torch), and the module is imported on first use. A class from
outside registers itself with ``register`` (a decorator)."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping


class Registry(Mapping):
    """A mapping of names to classes, in the order they were declared or registered.

    Args:
        kind: what the entries are ("model", "task", ...), for the messages.
        check: called with (name, cls) when a class is registered or first imported; raises ValueError for a
            class that does not fit (e.g. a model without ``modalities``).
    """

    def __init__(self, kind: str, check: Callable[[str, type], None] | None = None):
        self.kind = kind
        self._check = check
        self._entries: dict[str, type | str] = {}  # a class, or the "module:Class" that defines it

    def declare(self, name: str, target: str) -> None:
        """Add ``name`` as the class ``target`` ("package.module:Class"), imported on first use.

        Raises:
            ValueError: the name is taken, or ``target`` is not "module:Class".
        """
        if name in self._entries:
            raise ValueError(f"{self.kind} '{name}' is already registered")
        if target.count(":") != 1:
            raise ValueError(f"{self.kind} '{name}': expected 'module:Class', got '{target}'")
        self._entries[name] = target

    def register(self, name: str) -> Callable[[type], type]:
        """Class decorator: add the class under ``name``.

        Raises:
            ValueError: the name is taken by another class, or ``check`` refuses the class.
        """

        def add(cls: type) -> type:
            if self._check is not None:
                self._check(name, cls)
            if name in self._entries and self[name] is not cls:
                raise ValueError(f"{self.kind} '{name}' is already registered ({self[name].__qualname__})")
            self._entries[name] = cls
            return cls

        return add

    def __getitem__(self, name: str) -> type:
        entry = self._entries[name]
        if isinstance(entry, str):
            module, attr = entry.split(":")
            cls = getattr(importlib.import_module(module), attr)
            if self._check is not None:
                self._check(name, cls)
            self._entries[name] = entry = cls
        return entry

    def __delitem__(self, name: str) -> None:
        """Remove an entry (what a test registered for itself)."""
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def pick(self, name: str) -> type:
        """The class registered as ``name``.

        Raises:
            ValueError: no such name ("unknown model 'x'; choose from ...").
        """
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} '{name}'; choose from {', '.join(self._entries)}")
        return self[name]
