"""A gossip peer played by a test (or a benchmark) over a real UDP socket: it speaks the
wire as an agent does (seq, token, echo), or bends it as an attacker would."""

from __future__ import annotations

import socket
import time

from loadmesh.gossip import wire
from loadmesh.gossip.keyring import Keyring
from loadmesh.gossip.membership import Addr
from loadmesh.gossip.snapshot import decode
from loadmesh.gossip.wire import Kind


class RawPeer:
    def __init__(self, node_id: str, keyring: Keyring | None = None, host: str = "127.0.0.1") -> None:
        self.node_id = node_id
        self.key = wire.node_key(node_id)
        self.keyring = keyring
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((host, 0))
        self.tokens: dict[Addr, int] = {}
        self._seq = 0

    @property
    def addr(self) -> Addr:
        host, port = self.sock.getsockname()[:2]
        return host, port

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def seal(self, kind: Kind, body: bytes, to: Addr, flags: int = 0, *, sender: int | None = None,
             echo: int | None = None, seq: int | None = None) -> bytes:
        """A datagram as this peer would send it to `to`: a fresh seq and the echo of the
        token `to` gave it, unless told otherwise."""
        if seq is None:
            self._seq = seq = max(self._seq + 1, time.time_ns() // 1000)
        return wire.seal(kind, self.key if sender is None else sender, body, self.keyring, flags,
                         seq=seq, echo=self.tokens.get(to, 0) if echo is None else echo)

    def send(self, data: bytes, to: Addr) -> int:
        return self.sock.sendto(data, to)

    def receive(self, quiet_s: float = 0.3, limit_s: float = 5.0) -> list[tuple[bytes, Addr]]:
        """Everything that arrives until nothing has for `quiet_s`; learns the tokens."""
        got: list[tuple[bytes, Addr]] = []
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            self.sock.settimeout(quiet_s)
            try:
                data, src = self.sock.recvfrom(65536)
            except TimeoutError:
                break
            src = src[:2]
            got.append((data, src))
            try:
                dg = wire.open_datagram(data, None, wire.MAX_SINGLE_RECORD_DATAGRAM)
            except wire.WireError:
                continue
            if dg.token:
                self.tokens[src] = dg.token
        return got

    def prove(self, to: Addr) -> None:
        """Get `to`'s token, so that what this peer sends next is acted on."""
        for _ in range(5):
            self.send(self.seal(Kind.GOSSIP, b"", to), to)
            self.receive(quiet_s=0.3)
            if to in self.tokens:
                return
        raise TimeoutError(f"no cookie from {to}")


def hostile_asks(known: list[str], newcomer: bytes, version: int) -> dict[str, tuple[Kind, bytes, int]]:
    """What an attacker asks an agent that holds the nodes `known`, to make it answer as
    much as it can, by message kind: (kind, body, flags). `newcomer`: an encoded snapshot
    of a node the agent does not hold."""
    keys = [wire.node_key(node) for node in known]
    wants = keys[:wire.entry_room(1400) // wire.WANT.size]
    unknown = [k + 1 for k in keys[:wire.entry_capacity(1400)]]
    return {
        "sync, reply wanted": (Kind.SYNC, b"", wire.FLAG_REPLY),
        f"pull of {len(wants)} peers": (Kind.PULL, wire.pack_wants([(k, 0, version) for k in wants]), 0),
        f"gossip of {len(unknown)} unknown nodes": (
            Kind.GOSSIP, wire.pack_entries([(k, version, 0) for k in unknown]), wire.FLAG_REPLY),
        "content, a node not held": (
            Kind.CONTENT, wire.pack_content([wire.pack_full(0, 0, ("127.0.0.9", 9), newcomer)], 1400)[0], 0),
    }


def routine(data: bytes) -> bool:
    """Whether an agent sends a live peer this datagram on its own initiative, answer to
    nothing the peer sent but its own gossip: a round (gossip; its first datagram asks for
    the push-pull reply, which is gossip too), a push-pull or dead sync (a sync asking for
    one), SWIM's probing (a ping of it, a ping-req asking it to ping another), or the push
    of its own new version to a few peers (content whose records are all the sender's own).
    Answers to a sync, pull or ping are syncs without the flag, pulls, acks, and content
    about other nodes."""
    kind, flags = data[wire.KIND_AT], data[wire.FLAGS_AT]
    if kind == Kind.CONTENT:
        return _own_push(wire.open_datagram(data, None, wire.MAX_SINGLE_RECORD_DATAGRAM))
    return kind in (Kind.GOSSIP, Kind.PING, Kind.PING_REQ) or (kind == Kind.SYNC and flags & wire.FLAG_REPLY)


def _own_push(dg: wire.Datagram) -> bool:
    records, bad = wire.unpack_content(dg.body)
    return not bad and bool(records) and all(_record_key(r) == dg.sender for r in records)


def _record_key(record: wire.Record) -> int:
    if isinstance(record, wire.DeltaRecord):
        return record.key
    return wire.node_key(decode(record.content).node_id)
