"""Deltas between two encodings of one node's snapshot.

A new version of a snapshot usually moves a few dozen figures and keeps its shape (the
same GPUs, models and endpoints). A delta carries only the leaves that changed, so a peer
holding the previous version receives a fraction of the full snapshot's bytes.

The delta works on the msgpack structure, not on LoadSnapshot's fields: both encodings
are walked depth first into a shape (maps with their keys, arrays with their lengths)
and a list of leaves. When the shapes are equal the delta is

    bitmap   ceil(leaves / 8) bytes; bit i (byte i // 8, least significant bit first)
             set when leaf i changed; the bits past the last leaf are 0
    values   one msgpack object per set bit, in leaf order, back to back: when the old
             and the new leaf are both integers, the new one less the old one; otherwise
             the new leaf in a one-element array

Both halves are sized for what a version moves: every leaf of a snapshot is an integer
(snapshot.py quantizes each figure to a small integer code), a version changes a third of
them by a few codes, so a change costs its bit and about one byte, where an index and an
absolute value cost two to nine (the version and the timestamp move by 1 and by a few
thousand, and take nine bytes each written out). The receiver knows the number of leaves
from its base, so the bitmap needs no length.

Applying a delta rebuilds the structure and re-encodes it; msgpack encodes each value in
its shortest form, so the result is byte for byte the owner's encoding, which the CRC32
carried with the delta confirms. A shape change (a GPU or model added) makes no delta:
the full snapshot travels.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from itertools import islice
from typing import Any

import msgpack

# None for a leaf, ("m", keys, children), ("a", children), or ("l", n): an array of n
# leaves (every record of a snapshot), rebuilt by one slice of the leaves instead of a
# step per leaf.
Shape = Any
Flat = tuple[Shape, tuple[Any, ...]]

_SCALARS = (type(None), bool, int, float, str, bytes)
# The positions of the set bits of each byte value, least significant first.
_BITS = tuple(tuple(j for j in range(8) if b >> j & 1) for b in range(256))


class DeltaError(ValueError):
    """The delta does not apply to this base."""


def _walk(obj: Any, leaves: list[Any]) -> Shape:
    if isinstance(obj, dict):
        return ("m", tuple(obj), tuple(_walk(v, leaves) for v in obj.values()))
    if isinstance(obj, list):
        if not any(isinstance(v, (dict, list)) for v in obj):
            leaves.extend(obj)
            return ("l", len(obj))
        return ("a", tuple(_walk(v, leaves) for v in obj))
    leaves.append(obj)
    return None


def _build(shape: Shape, leaves: Iterator[Any]) -> Any:
    if shape is None:
        return next(leaves)
    if shape[0] == "l":
        return list(islice(leaves, shape[1]))
    if shape[0] == "m":
        return {k: _build(s, leaves) for k, s in zip(shape[1], shape[2])}
    return [_build(s, leaves) for s in shape[1]]


def _is_int(value: object) -> bool:
    return type(value) is int


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
    bitmap = bytearray((len(base[1]) + 7) // 8)
    packer = msgpack.Packer(use_bin_type=True)
    values: list[bytes] = []
    for i, (a, b) in enumerate(zip(base[1], new[1])):
        # 1 == 1.0 == True in Python, but not on the wire.
        if type(a) is type(b) and a == b:
            continue
        bitmap[i >> 3] |= 1 << (i & 7)
        values.append(packer.pack(b - a if _is_int(a) and _is_int(b) else [b]))
    return bytes(bitmap) + b"".join(values)


def _changed(bitmap: bytes, leaves: int) -> list[int]:
    changed = [i << 3 | j for i, byte in enumerate(bitmap) if byte for j in _BITS[byte]]
    if leaves % 8 and bitmap[-1] >> (leaves % 8):
        raise DeltaError("bitmap marks leaves past the last one")
    return changed


def apply(base: Flat, changes: bytes, crc: int) -> tuple[bytes, Flat]:
    """The encoding that `changes` makes of `base`, checked against `crc`, and its flat
    form (the base of the next delta, spared a flatten())."""
    leaves = list(base[1])
    size = (len(leaves) + 7) // 8
    if len(changes) < size:
        raise DeltaError(f"{len(changes)} bytes, the bitmap alone takes {size}")
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(changes), 1))
    unpacker.feed(changes[size:])
    try:
        changed = _changed(changes[:size], len(leaves))
        # Every value in one C call; one per changed leaf is checked below. Read one by
        # one, they took half of an apply (a third of the leaves change each version).
        values = list(islice(unpacker, len(changed)))
        if len(values) < len(changed):
            raise DeltaError(f"{len(changed)} leaves marked, {len(values)} values")
        if unpacker.tell() != len(changes) - size:
            raise DeltaError("bytes left after the last change")
        for i, value in zip(changed, values):
            if type(value) is int:
                if type(leaves[i]) is not int:
                    raise DeltaError(f"leaf {i}: a difference for a leaf that is not an integer")
                leaves[i] += value
            elif type(value) is list and len(value) == 1 and isinstance(value[0], _SCALARS):
                leaves[i] = value[0]
            else:
                raise DeltaError(f"leaf {i}: neither a difference nor a one-element array")
        result: bytes = msgpack.packb(_build(base[0], iter(leaves)), use_bin_type=True)
    except DeltaError:
        raise
    except (msgpack.UnpackException, ValueError, OverflowError) as e:
        raise DeltaError(f"changes are malformed: {e}") from None
    if zlib.crc32(result) != crc:
        raise DeltaError("result does not match the owner's CRC")
    return result, (base[0], tuple(leaves))
