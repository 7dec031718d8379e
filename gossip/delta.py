"""Deltas between two encodings of one node's snapshot.

A new version of a snapshot usually moves a few dozen figures and keeps its shape (the
same GPUs, models and endpoints). A delta lists only the leaves that changed, so a peer
holding the previous version receives ~half the bytes of the full snapshot.

The delta works on the msgpack structure, not on LoadSnapshot's fields: both encodings
are walked depth first into a shape (maps with their keys, arrays with their lengths)
and a list of leaves. When the shapes are equal the delta is the msgpack array
[index, value, index, value, ...] of the leaves that differ, indices increasing. Applying
it rebuilds the structure and re-encodes it; msgpack encodes each value in its shortest
form, so the result is byte for byte the owner's encoding, which the CRC32 carried with
the delta confirms. A shape change (a GPU or model added) makes no delta: the full
snapshot travels.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgpack

Shape = Any  # None for a leaf, ("m", keys, children) or ("a", children)
Flat = tuple[Shape, tuple[Any, ...]]


class DeltaError(ValueError):
    """The delta does not apply to this base."""


def _walk(obj: Any, leaves: list[Any]) -> Shape:
    if isinstance(obj, dict):
        return ("m", tuple(obj), tuple(_walk(v, leaves) for v in obj.values()))
    if isinstance(obj, list):
        return ("a", tuple(_walk(v, leaves) for v in obj))
    leaves.append(obj)
    return None


def _build(shape: Shape, leaves: Any) -> Any:
    if shape is None:
        return next(leaves)
    if shape[0] == "m":
        return {k: _build(s, leaves) for k, s in zip(shape[1], shape[2])}
    return [_build(s, leaves) for s in shape[1]]


def flatten(data: bytes) -> Flat:
    """The shape and leaves of an encoding; DeltaError when it is not msgpack."""
    try:
        obj = msgpack.unpackb(data, raw=False)
    except (ValueError, TypeError) as e:
        raise DeltaError(f"base is not msgpack: {e}") from None
    leaves: list[Any] = []
    return _walk(obj, leaves), tuple(leaves)


def diff(base: Flat, new: Flat) -> bytes | None:
    """The changes that turn base into new, or None when their shapes differ."""
    if base[0] != new[0]:
        return None
    changes: list[Any] = []
    for i, (a, b) in enumerate(zip(base[1], new[1])):
        # 1 == 1.0 == True in Python, but not on the wire.
        if type(a) is not type(b) or a != b:
            changes += (i, b)
    return msgpack.packb(changes, use_bin_type=True)


def apply(base: Flat, changes: bytes, crc: int) -> bytes:
    """The encoding that `changes` makes of `base`, checked against `crc`."""
    try:
        raw = msgpack.unpackb(changes, raw=False)
    except (ValueError, TypeError) as e:
        raise DeltaError(f"changes are not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) % 2:
        raise DeltaError("changes are not [index, value] pairs")
    leaves = list(base[1])
    last = -1
    for i in range(0, len(raw), 2):
        index, value = raw[i], raw[i + 1]
        if type(index) is not int or not last < index < len(leaves):
            raise DeltaError(f"index {index!r} out of order or range")
        if isinstance(value, (list, dict)):
            raise DeltaError("a change must be a single value")
        leaves[index] = value
        last = index
    result = msgpack.packb(_build(base[0], iter(leaves)), use_bin_type=True)
    if zlib.crc32(result) != crc:
        raise DeltaError("result does not match the owner's CRC")
    return result
