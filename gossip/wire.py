"""Datagram framing: header, authentication tag, and the four message bodies.

    offset  size
    0       1    magic "L"
    1       1    protocol version (6)
    2       1    kind: 1 gossip, 2 sync, 3 pull, 4 content, 5 cookie, 6 ping, 7 ack, 8 ping-req
    3       1    flags: 0x01 signed (a tag ends the datagram), 0x02 reply wanted (gossip,
                 sync), 0x04 nack (ack), 0x08 you are suspected (ping), 0x10 wants
                 (gossip)
    4       6    sender: the sender's node key (see node_key), big-endian
    10      6    seq: the low 48 bits of the microseconds of the sender's wall clock,
                 strictly increasing per sender; the receiver reads them against its own
                 clock (unserial_seq: exact within 4.4 years either way)
    16      4    token: the sender's cookie for the receiver's address (to echo back)
    20      4    echo: the last token the receiver gave the sender for this address (0: none)
    24      ...  body
    end-16  16   HMAC-SHA256 of everything before it, truncated (only when signed)

The tag covers seq, token and echo: a signed datagram cannot be replayed outside the
receiver's replay window, and its echo proves, to the receiver only, that the sender
receives at the address it came from (gossip/cookies.py).

Bodies:

- gossip and sync: announcements (an empty body: none). A u16 count of full ones, the
  full ones, then short ones to the body's end. A full announcement, 14 bytes: node key
  u48, the low 32 bits of the version (read by serial-number arithmetic, RFC 1982,
  against the version the receiver holds: exact while the two are within 2**31
  changes), and a u32 whose top two bits are the node's status as the sender holds it
  (0 alive, 1 suspect, 2 suspect by the sender's own failed probe, 3 dead) and whose
  low 30 bits are its incarnation:
  seconds of the owner's wall clock since INCARNATION_EPOCH when it started or last
  refuted a suspicion of itself, strictly increasing. Suspicions and deaths are about an
  incarnation, and only the owner makes a greater one. A short announcement, 8 bytes (a
  u64): node key << 16 | the version's low 16 bits, "a newer version of this node",
  nothing about its liveness; exact while the receiver is within 2**15 changes of it,
  which a live node's announcements always keep it (a node further behind has missed a
  day of them, and a sync's full announcements carry it on). Rounds send a version of a
  node alive under an incarnation spread before as short, liveness news as full (see
  broadcasts.py); syncs are all full. Gossip carries the sender's recent news; sync
  carries its whole table (chunked).
- ping: probe seq u32. ack: probe seq u32, then the probed node's own announcement, full
  (14 bytes, as in gossip; the answer to a ping-req carries the target's); a nack (flag
  0x04) has the seq only.
  ping-req: probe seq u32, target node key u64 ("ping it for me").
- pull: wants, in the layout of announcements: a u16 count of full wants, the full ones
  (16 bytes: node key u64, the version the sender holds, 0 for none), then short ones to
  the body's end (8 bytes: node key << 16 | the low 16 bits of the version held, read by
  the answerer against the version it holds). A want goes short when the asker holds a
  version within 2**14 changes of the one announced to it, full otherwise.
- gossip with flag 0x10 (wants): the body starts with a u16 length and that many bytes
  of wants as in a pull, and the announcements follow. A push-pull reply carries the
  replier's pulls of what the contact just announced, so they cost no datagram of their
  own.
- cookie: no body. "I did not act on your datagram: your address is not proven yet;
  here is a token, send again echoing it." Never larger than what it answers.
- content: a msgpack array of records:
  full   a msgpack array [0, flags, incarnation, gossip host, gossip port, encoded LoadSnapshot]
  delta  msgpack bin: flags u8, node key u48, the version's low 32 bits (read against the
         version the receiver holds), back u8 (the base version is version - back, back
         >= 1), incarnation u32, crc32 of the result u32 (20 bytes), then the changes
         (gossip/delta.py's encoding) to the bin's end
  where flags 0x01 marks an urgent version. A delta costs 22 bytes around its changes,
  where a msgpack array of the same fields took 34.

Everything is checked before use; any violation raises WireError with a short reason
that the protocol counts as a drop.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import IntEnum

import msgpack

from loadmesh.gossip.keyring import TAG_BYTES, Keyring

MAGIC = 0x4C  # "L"
# 3: snapshot format 2 (quantized figures) and deltas as bitmap and differences; agents
# of protocol 2 read neither, so the two refuse each other's datagrams (bad_version).
# 4: SWIM probes (ping, ack, ping-req) and a status in each announcement, where protocol
# 3 sent beats to every peer, in the field that now holds status and incarnation.
# 5: short announcements (a version's news in 8 bytes) after the full ones.
# 6: short wants, wants in push-pull replies, binary delta records; a 24-byte header (6-byte
# sender key and seq, 1-byte magic) and the ack's announcement as gossip's.
PROTOCOL_VERSION = 6
# magic, version, kind, flags, sender (high 16 bits, low 32), seq (the same), token, echo
HEADER = struct.Struct("!BBBBHIHIII")
KIND_AT, FLAGS_AT = 2, 3  # where kind and flags sit in the header
# key (high 16 bits, low 32), version's low 32 bits, status and incarnation
ENTRY = struct.Struct("!HIII")
SHORT = struct.Struct("!Q")
ENTRIES_HEAD = struct.Struct("!H")  # how many full announcements come first
SHORT_BITS = 16
# What a queued announcement's last field holds when it goes short (broadcasts.py).
VERSION_ONLY = -1
KEY_BITS = 48
SERIAL_BITS = 32
_SERIAL_MASK = (1 << SERIAL_BITS) - 1
WANT = struct.Struct("!QQ")
# A want goes short while the version held is this close to the one announced: the
# answerer, holding the announced version or a few past it, reads it exactly.
SHORT_WANT_SPAN = 1 << 14
WANTS_HEAD = struct.Struct("!H")  # gossip with FLAG_WANTS: the length of its wants
# flags, key (high 16 bits, low 32), version's low 32 bits, back, incarnation, crc32
DELTA = struct.Struct("!BHIIBII")
MAX_BACK = 255
PING = struct.Struct("!I")
PING_REQ = struct.Struct("!IQ")
ACK = struct.Struct("!IHIII")  # probe seq, then a full announcement
FLAG_SIGNED = 0x01
FLAG_REPLY = 0x02
FLAG_NACK = 0x04
FLAG_SUSPECTED = 0x08
FLAG_WANTS = 0x10
RECORD_URGENT = 0x01
# An announcement's last field: status << 30 | incarnation.
STATUS_SHIFT = 30
INCARNATION_MAX = (1 << STATUS_SHIFT) - 1
# Incarnations count seconds from here: 2**30 s last until 2059. Seconds of the clock,
# like versions its milliseconds, so that a restarted node starts above its previous
# incarnations and one beyond the receiver's clock (plus the skew) is refused as forged.
INCARNATION_EPOCH_MS = 1_735_689_600_000  # 2025-01-01T00:00:00Z
STATUS_ALIVE, STATUS_SUSPECT, STATUS_ACCUSED, STATUS_DEAD = range(4)
MAX_U64 = 2**64 - 1
MAX_U32 = 2**32 - 1
# A snapshot near its largest (8,390 bytes with every field at its bound) cannot fit a 1400-byte datagram; it travels alone
# in a datagram up to this size and relies on IP fragmentation. Nothing else may be larger
# than max_datagram.
MAX_SINGLE_RECORD_DATAGRAM = 8192 + 256
_MAX_HOST_BYTES = 253


class Kind(IntEnum):
    GOSSIP = 1
    SYNC = 2
    PULL = 3
    CONTENT = 4
    COOKIE = 5
    PING = 6
    ACK = 7
    PING_REQ = 8


class WireError(ValueError):
    """Input to drop; `reason` names the counter it goes to."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def node_key(node_id: str) -> int:
    """The 48-bit name of a node on the wire (BLAKE2b of its id).

    Announcements name nodes by key so that each costs 8 or 14 bytes whatever the length
    of the id. Two ids of one mesh collide with probability about N**2 / 2**49 (2e-9 at 1000
    nodes, 3e-8 at the table's bound of 4096); a collision is detected and counted when
    the second one's full record arrives (drop_key_collision), and logged by the agent.
    """
    return int.from_bytes(hashlib.blake2b(node_id.encode(), digest_size=KEY_BITS // 8).digest(), "big")


def _serial_reader(bits: int) -> Callable[[int, int], int]:
    """RFC 1982's serial-number arithmetic on `bits` low bits: the value whose low bits
    are `serial` nearest to `near`."""
    mask, half, span = (1 << bits) - 1, 1 << (bits - 1), 1 << bits

    def read(serial: int, near: int) -> int:
        d = (serial - near) & mask
        return near + d if d < half else near - (span - d)
    return read


# The version whose low 32 bits are `serial` nearest to `near` (the version held). Versions
# move by one a change, so an announcement and the version its receiver holds are never
# 2**31 changes apart.
unserial = _serial_reader(SERIAL_BITS)
# The same for a short announcement's low 16 bits.
unserial_short = _serial_reader(SHORT_BITS)
# A header's seq, its sender's clock in microseconds, read against the receiver's clock.
SEQ_BITS = 48
unserial_seq = _serial_reader(SEQ_BITS)


@dataclass(frozen=True, slots=True)
class Datagram:
    kind: Kind
    flags: int
    sender: int
    seq: int  # its low 48 bits (unserial_seq)
    token: int
    echo: int
    body: bytes


@dataclass(frozen=True, slots=True)
class FullRecord:
    flags: int
    incarnation: int
    addr: tuple[str, int]
    content: bytes


@dataclass(frozen=True, slots=True)
class DeltaRecord:
    """A delta as it came: its version as low bits, for the receiver to read against the
    version it holds (unserial), and its base `back` versions before that."""

    flags: int
    key: int
    serial: int
    back: int
    incarnation: int
    crc: int
    changes: bytes


Record = FullRecord | DeltaRecord


def seal(kind: Kind, sender: int, body: bytes, keyring: Keyring | None, flags: int = 0, *,
         seq: int = 0, token: int = 0, echo: int = 0) -> bytes:
    flags = flags & ~FLAG_SIGNED if keyring is None else flags | FLAG_SIGNED
    data = HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, flags, sender >> 32, sender & _SERIAL_MASK,
                       seq >> 32 & 0xFFFF, seq & _SERIAL_MASK, token, echo) + body
    return data if keyring is None else data + keyring.sign(data)


def open_datagram(data: bytes, keyring: Keyring | None, max_datagram: int) -> Datagram:
    """The checked datagram in `data`, or WireError.

    With a keyring, only datagrams signed by one of its keys pass. Without one, the mesh
    is open: a tag is stripped unchecked, so a node without the key still hears a keyed
    mesh (it cannot be heard by it).
    """
    size = len(data)
    if size > MAX_SINGLE_RECORD_DATAGRAM:
        raise WireError("oversized", f"{size} bytes")
    if size < HEADER.size:
        raise WireError("truncated", f"{size} bytes")
    magic, version, kind, flags, sender_hi, sender_lo, seq_hi, seq_lo, token, echo = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise WireError("bad_magic")
    if version != PROTOCOL_VERSION:
        raise WireError("bad_version", f"protocol {version}")
    try:
        kind = Kind(kind)
    except ValueError:
        raise WireError("bad_kind", f"kind {kind}") from None
    end = size
    if flags & FLAG_SIGNED:
        if size < HEADER.size + TAG_BYTES:
            raise WireError("truncated", "no room for the tag")
        end = size - TAG_BYTES
        if keyring is not None and not keyring.verify(data[:end], data[end:]):
            raise WireError("bad_signature")
    elif keyring is not None:
        raise WireError("unsigned")
    if size > max_datagram and kind is not Kind.CONTENT:
        raise WireError("oversized", f"{size} bytes of kind {kind.name}")
    body_size = end - HEADER.size
    if kind is Kind.COOKIE and body_size:
        raise WireError("malformed", "a cookie has no body")
    if kind in _FIXED_BODY and body_size not in _FIXED_BODY[kind]:
        raise WireError("malformed", f"{kind.name} body of {body_size} bytes")
    return Datagram(kind, flags, sender_hi << 32 | sender_lo, seq_hi << 32 | seq_lo, token, echo,
                    bytes(data[HEADER.size:end]))


_FIXED_BODY = {Kind.PING: (PING.size,), Kind.PING_REQ: (PING_REQ.size,),
               Kind.ACK: (PING.size, ACK.size)}


# --- probes -------------------------------------------------------------------------------

def pack_ping(seq: int) -> bytes:
    return PING.pack(seq)


def unpack_ping(body: bytes) -> int:
    return PING.unpack(body)[0]


def pack_ping_req(seq: int, target: int) -> bytes:
    return PING_REQ.pack(seq, target)


def unpack_ping_req(body: bytes) -> tuple[int, int]:
    return PING_REQ.unpack(body)  # type: ignore[return-value]


def pack_ack(seq: int, entry: tuple[int, int, int] | None) -> bytes:
    """An ack carrying the probed node's announcement (node key, version, status << 30 |
    incarnation); a nack (entry None) the seq only."""
    if entry is None:
        return PING.pack(seq)
    key, version, tail = entry
    return ACK.pack(seq, key >> 32, key & _SERIAL_MASK, version & _SERIAL_MASK, tail)


def unpack_ack(body: bytes) -> tuple[int, tuple[int, int, int] | None]:
    """The probe seq, and the announcement as a full one of gossip: its version as low 32
    bits (unserial)."""
    if len(body) == PING.size:
        return PING.unpack(body)[0], None
    seq, hi, lo, version, tail = ACK.unpack(body)
    return seq, (hi << 32 | lo, version, tail)


# --- announcements and wants --------------------------------------------------------------

def entry_room(max_datagram: int) -> int:
    """Bytes of announcements, or of wants, a datagram holds after their count."""
    return max_datagram - HEADER.size - TAG_BYTES - ENTRIES_HEAD.size


def entry_capacity(max_datagram: int) -> int:
    """Full announcements a datagram holds."""
    return entry_room(max_datagram) // ENTRY.size


@functools.lru_cache(maxsize=256)
def _entries_struct(full: int, short: int) -> struct.Struct:
    return struct.Struct("!H" + "HIII" * full + "Q" * short)


def pack_entries(entries: list[tuple[int, int, int]]) -> bytes:
    """Announcements (node key, version, status << 30 | incarnation, or VERSION_ONLY for a
    short one), the full ones first. One C call for the whole datagram: this runs for
    every datagram of every round."""
    m = _SERIAL_MASK
    full = [(k >> 32, k & m, v & m, t) for k, v, t in entries if t >= 0]
    short = [k << SHORT_BITS | v & 0xFFFF for k, v, t in entries if t < 0]
    return _entries_struct(len(full), len(short)).pack(len(full), *itertools.chain.from_iterable(full), *short)


Entries = tuple[list[tuple[int, int, int]], tuple[int, ...]]


def short_code(key: int, version: int) -> int:
    """A short announcement as it is on the wire: node key << 16 | the version's low 16
    bits. A receiver compares it whole with the codes of the versions it holds
    (membership.PeerTable.settled): at 1000 nodes a node reads some 4,000 of them a
    second, nearly all of a version it holds already."""
    return key << SHORT_BITS | version & 0xFFFF


def unpack_entries(body: bytes) -> Entries:
    """The full announcements, (node key, the version's low 32 bits, status << 30 |
    incarnation) each, and the short ones as they are on the wire (short_code: the key is
    code >> SHORT_BITS, the version's low 16 bits code & 0xFFFF): the receiver reads each
    version against the one it holds (unserial, unserial_short)."""
    if not body:
        return [], ()  # a bare contact: asks for the reply flag's answer only
    full, short = _full_then_short(body, ENTRY, "announcements")
    return [(h << 32 | lo, v, t) for h, lo, v, t in full], short


def _full_then_short(body: bytes, full: struct.Struct, what: str) -> tuple[list[tuple[int, ...]],
                                                                          tuple[int, ...]]:
    """The layout announcements and wants share: a u16 count of full items of `full`'s
    size, the full ones, then short ones (u64: node key << 16 | a version's low 16 bits)
    to the body's end, as they are (one C call for all of them)."""
    if len(body) < ENTRIES_HEAD.size:
        raise WireError("malformed", f"{what} of {len(body)} bytes")
    (n,) = ENTRIES_HEAD.unpack_from(body)
    end = ENTRIES_HEAD.size + n * full.size
    if end > len(body) or (len(body) - end) % SHORT.size:
        raise WireError("malformed", f"{n} full {what} in {len(body)} bytes")
    return (list(full.iter_unpack(body[ENTRIES_HEAD.size:end])),
            _shorts_struct((len(body) - end) // SHORT.size).unpack_from(body, end))


@functools.lru_cache(maxsize=256)
def _shorts_struct(count: int) -> struct.Struct:
    return struct.Struct(f"!{count}Q")


Want = tuple[int, int, int]  # node key, version held (0: none), version announced


def _short_want(have: int, announced: int) -> bool:
    return have != 0 and announced - have < SHORT_WANT_SPAN


def want_size(want: Want) -> int:
    """The bytes pack_wants makes of `want`."""
    return SHORT.size if _short_want(want[1], want[2]) else WANT.size


def pack_wants(wants: Iterable[Want]) -> bytes:
    """Wants (node key, version held, version announced), short where the version held
    is close enough to the announced one for the answerer to read its low bits."""
    full: list[int] = []
    short: list[int] = []
    for k, have, announced in wants:
        if _short_want(have, announced):
            short.append(k << SHORT_BITS | have & 0xFFFF)
        else:
            full += (k, have)
    return struct.pack(f"!H{len(full)}Q{len(short)}Q", len(full) // 2, *full, *short)


def unpack_wants(body: bytes) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The full wants, (node key, version held), and the short ones, (node key, the version
    held's low 16 bits: read it against the version this node holds, unserial_short)."""
    full, short = _full_then_short(body, WANT, "wants")
    return [(k, have) for k, have in full], [(x >> SHORT_BITS, x & 0xFFFF) for x in short]


def pack_gossip(entries: bytes, wants: bytes) -> tuple[bytes, int]:
    """A gossip body of packed announcements and, if any, packed wants; with its flag."""
    if not wants:
        return entries, 0
    return WANTS_HEAD.pack(len(wants)) + wants + entries, FLAG_WANTS


def split_gossip(body: bytes, flags: int) -> tuple[bytes, bytes]:
    """A gossip body's announcements and wants (packed; b"" for none)."""
    if not flags & FLAG_WANTS:
        return body, b""
    if len(body) < WANTS_HEAD.size:
        raise WireError("malformed", f"gossip with wants of {len(body)} bytes")
    (n,) = WANTS_HEAD.unpack_from(body)
    end = WANTS_HEAD.size + n
    if end > len(body):
        raise WireError("malformed", f"{n} bytes of wants in {len(body)} bytes")
    return body[end:], body[WANTS_HEAD.size:end]


# --- content records ---------------------------------------------------------------------

def pack_full(flags: int, incarnation: int, addr: tuple[str, int], content: bytes) -> bytes:
    return msgpack.packb([0, flags, incarnation, addr[0], addr[1], content], use_bin_type=True)


def pack_delta(flags: int, key: int, base_version: int, version: int, incarnation: int, crc: int,
               changes: bytes) -> bytes | None:
    """A delta record; None where its base is too far back for one (send the full one)."""
    back = version - base_version
    if not 0 < back <= MAX_BACK:
        return None
    head = DELTA.pack(flags, key >> 32, key & _SERIAL_MASK, version & _SERIAL_MASK, back, incarnation, crc)
    return msgpack.packb(head + changes, use_bin_type=True)


def _array_header(n: int) -> bytes:
    return bytes([0x90 | n]) if n < 16 else b"\xdc" + n.to_bytes(2, "big")


def pack_content(records: list[bytes], max_datagram: int) -> list[bytes]:
    """Bodies of content datagrams holding `records` in order, each within max_datagram;
    a record too large for any shares a body with nothing."""
    budget = max_datagram - HEADER.size - TAG_BYTES - 3
    bodies: list[bytes] = []
    chunk: list[bytes] = []
    used = 0
    for rec in records:
        if chunk and used + len(rec) > budget:
            bodies.append(_array_header(len(chunk)) + b"".join(chunk))
            chunk, used = [], 0
        chunk.append(rec)
        used += len(rec)
    if chunk:
        bodies.append(_array_header(len(chunk)) + b"".join(chunk))
    return bodies


def _uint(value: object, limit: int, what: str) -> int:
    if type(value) is not int or not 0 <= value <= limit:
        raise WireError("malformed", f"{what}: {value!r}")
    return value


def _record(raw: object) -> Record:
    if isinstance(raw, bytes):
        if len(raw) < DELTA.size:
            raise WireError("malformed", f"delta of {len(raw)} bytes")
        flags, hi, lo, serial, back, incarnation, crc = DELTA.unpack_from(raw)
        if back == 0:
            raise WireError("malformed", "delta does not move forward from a version")
        return DeltaRecord(flags, hi << 32 | lo, serial, back, _uint(incarnation, INCARNATION_MAX, "incarnation"),
                           crc, raw[DELTA.size:])
    if not isinstance(raw, list) or not raw:
        raise WireError("malformed", "record is neither an array nor a delta")
    tag = raw[0]
    if tag == 0 and len(raw) == 6:
        _, flags, incarnation, host, port, content = raw
        if not isinstance(host, str) or not 0 < len(host.encode()) <= _MAX_HOST_BYTES:
            raise WireError("malformed", "gossip host")
        if not isinstance(content, bytes):
            raise WireError("malformed", "snapshot is not bytes")
        return FullRecord(_uint(flags, 255, "flags"), _uint(incarnation, INCARNATION_MAX, "incarnation"),
                          (host, _uint(port, 65535, "port")), content)
    raise WireError("malformed", f"unknown record {tag!r} of {len(raw)} fields")


def unpack_content(body: bytes) -> tuple[list[Record], list[str]]:
    """The valid records of a content body, and the drop reason of each invalid one.

    A body that is not an array is malformed as a whole (WireError)."""
    try:
        raw = msgpack.unpackb(body, raw=False)
    except (ValueError, TypeError) as e:  # msgpack reports malformed input as ValueError
        raise WireError("malformed", f"content: {e}") from None
    if not isinstance(raw, list):
        raise WireError("malformed", "content is not an array")
    records: list[Record] = []
    bad: list[str] = []
    for item in raw:
        try:
            records.append(_record(item))
        except WireError as e:
            bad.append(e.reason)
    return records, bad
