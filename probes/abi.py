"""What user space needs to know about loadmesh.h, taken from loadmesh.h itself.

Constants come from its `#define LM_* <number>` lines. Struct layouts come from the ctypes
that BCC generates for each map's key and value after compiling the header; codec() turns
such a ctypes type into a struct.Struct so thousands of map entries decode at C speed
instead of through ctypes attribute access.
"""

from __future__ import annotations

import ctypes
import re
import struct
from dataclasses import dataclass
from functools import cache
from pathlib import Path

HEADER = Path(__file__).with_name("loadmesh.h")

_DEFINE = re.compile(r"^#define\s+(LM_\w+)\s+(\d+)\b", re.MULTILINE)


@cache
def constants() -> dict[str, int]:
    """Every `#define LM_NAME number` of loadmesh.h."""
    return {name: int(value) for name, value in _DEFINE.findall(HEADER.read_text())}


def const(name: str) -> int:
    return constants()[name]


@cache
def names(prefix: str, count: str) -> tuple[str, ...]:
    """Names of an enumeration of loadmesh.h in index order, from its `prefix`NAME defines
    and its size define: names("LM_ERR_", "LM_ERR_COUNT")[0] == "fp_full"."""
    consts = constants()
    out = [""] * consts[count]
    for name, value in consts.items():
        if name.startswith(prefix) and name != count:
            out[value] = name.removeprefix(prefix).lower()
    if "" in out:
        raise ValueError(f"loadmesh.h: {prefix}* indexes are not 0..{count}-1")
    return tuple(out)


def error_names() -> tuple[str, ...]:
    """The `errors` counters: LM_ERR_FP_FULL -> "fp_full"."""
    return names("LM_ERR_", "LM_ERR_COUNT")


def endpoint_names() -> tuple[str, ...]:
    """Endpoint classes: LM_EP_CHAT -> "chat"."""
    return names("LM_EP_", "LM_EP_COUNT")


def outcome_names() -> tuple[str, ...]:
    """How requests end: LM_OUT_ABORTED -> "aborted"."""
    return names("LM_OUT_", "LM_OUT_COUNT")


_SCALARS = {1: "B", 2: "H", 4: "I", 8: "Q"}


@dataclass(frozen=True)
class Codec:
    """struct.Struct for a C layout plus the dotted name of each unpacked item."""

    struct: struct.Struct
    fields: tuple[str, ...]

    def index(self, name: str) -> int:
        return self.fields.index(name)


def codec(ctype: type) -> Codec:
    """Little-endian struct for a BCC-generated ctypes Structure (nested structs flattened,
    byte and char arrays as bytes, padding made explicit)."""
    fmt: list[str] = ["<"]
    names: list[str] = []
    end = _flatten(ctype, "", 0, fmt, names)
    if end < ctypes.sizeof(ctype):
        fmt.append(f"{ctypes.sizeof(ctype) - end}x")
    return Codec(struct.Struct("".join(fmt)), tuple(names))


def _flatten(ctype: type, prefix: str, base: int, fmt: list[str], names: list[str]) -> int:
    """Appends the items of ctype at offset base; returns the offset after the last one."""
    pos = base
    if issubclass(ctype, ctypes.Structure):
        for fname, ftype, *_ in ctype._fields_:
            off = base + getattr(ctype, fname).offset
            if off > pos:
                fmt.append(f"{off - pos}x")
            pos = _flatten(ftype, f"{prefix}{fname}.", off, fmt, names)
        return pos
    name = prefix.rstrip(".")
    size = ctypes.sizeof(ctype)
    if issubclass(ctype, ctypes.Array):
        elem = ctype._type_
        if ctypes.sizeof(elem) == 1:
            fmt.append(f"{ctype._length_}s")
            names.append(name)
            return base + size
        for i in range(ctype._length_):
            pos = _flatten(elem, f"{name}.{i}.", base + i * ctypes.sizeof(elem), fmt, names)
        return pos
    if size not in _SCALARS:
        raise TypeError(f"{name}: no struct code for a {size}-byte {ctype.__name__}")
    fmt.append(_SCALARS[size])
    names.append(name)
    return base + size

