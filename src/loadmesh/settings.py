"""Settings: the fields of a configuration dataclass that an operator may set.

A setting is defined once, on the dataclass of the code that uses it, with its default, its
doc and its check; the agent's TOML schema (daemon/config.py) is derived from those fields.
A field made with `setting` or `section` is a key of the file; any other field of the same
dataclass is internal tuning, set only in code. The checks run whenever the dataclass is
made (check_settings from __post_init__), so the simulator and the tests get the same
checks as a file does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import field
from typing import Any

Check = Callable[[Any], str | None]


class SettingError(ValueError):
    """One setting's value is wrong; `name` is the field, `problem` says why."""

    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"{name}: {problem}")
        self.name = name
        self.problem = problem


def setting(default: Any, check: Check | None = None, doc: str = "") -> Any:
    """A field the operator may set, with its default, check and one-line doc."""
    meta = {"check": check, "doc": doc}
    if isinstance(default, (tuple, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def section(cls: type, doc: str) -> Any:
    """A field holding a table of settings (`[section]` in the file)."""
    return field(default_factory=cls, metadata={"check": None, "doc": doc})


def settings_of(cls: type) -> Iterator[dataclasses.Field[Any]]:
    """The fields of a dataclass that are keys of the file, in definition order."""
    return (f for f in dataclasses.fields(cls) if "doc" in f.metadata)


def check_settings(instance: Any) -> None:
    """Raise SettingError for the first setting whose check fails."""
    for f in settings_of(type(instance)):
        check = f.metadata["check"]
        problem = check(getattr(instance, f.name)) if check else None
        if problem:
            raise SettingError(f.name, problem)


def between(low: int, high: int) -> Check:
    return lambda v: None if low <= v <= high else f"must be {low}..{high}, got {v}"


def in_range(low: float, high: float) -> Check:
    return lambda v: None if low <= v <= high else f"must be {low:g}..{high:g}, got {v:g}"
