"""Return routability: proof that a datagram's source address can receive there.

UDP source addresses are free to forge. A node that answered every datagram would let
anyone aim its answers at a third party (reflection), and would let a replayed datagram
rebind a peer's address. So every datagram carries, in its header, a token for the
receiver's address and the echo of the last token the receiver gave the sender; a
datagram whose echo matches what this node gives out for its source address comes from
someone who received there (QUIC's address validation, DTLS's HelloVerifyRequest,
WireGuard's cookies). A source that cannot show that gets a cookie datagram, never
larger than what it sent, and nothing else.

Tokens are 32 bits of keyed BLAKE2b of the address under a random secret that rotates
every `epoch_ms`; the current and the previous secrets are accepted. Nothing is stored
per address to check one (a cache spares the hash); what a node stores is the tokens its
peers gave it, and the last few datagrams it sent to an address whose token it lacks, to
send again when the cookie comes back.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable

from loadmesh.gossip.membership import Addr


def _addr_bytes(addr: Addr) -> bytes:
    return f"{addr[0]}|{addr[1]}".encode()


class AddressCookies:
    """The tokens this node gives out, and their check."""

    def __init__(self, secret: Callable[[int], bytes], epoch_ms: int, max_cached: int) -> None:
        self._secret_source = secret
        self.epoch_ms = epoch_ms
        self._max_cached = max_cached
        self._secrets = (secret(16), secret(16))  # current, previous
        self._epoch_end: int | None = None
        self._cache: dict[Addr, int] = {}
        self._previous: dict[Addr, int] = {}

    def _rotate(self, now: int) -> None:
        if self._epoch_end is None:
            self._epoch_end = now + self.epoch_ms
        elif now >= self._epoch_end:
            self._secrets = (self._secret_source(16), self._secrets[0])
            self._previous, self._cache = self._cache, {}
            self._epoch_end = now + self.epoch_ms

    @staticmethod
    def _hash(secret: bytes, addr: Addr) -> int:
        token = int.from_bytes(hashlib.blake2b(_addr_bytes(addr), key=secret, digest_size=4).digest(), "big")
        return token or 1  # 0 on the wire means "no token"

    def token(self, addr: Addr, now: int) -> int:
        """What `addr` must echo to prove it receives there."""
        self._rotate(now)
        token = self._cache.get(addr)
        if token is None:
            if len(self._cache) >= self._max_cached:
                self._cache.clear()
            token = self._cache[addr] = self._hash(self._secrets[0], addr)
        return token

    def valid(self, addr: Addr, echo: int, now: int) -> bool:
        if echo == 0:
            return False
        if echo == self.token(addr, now):
            return True
        previous = self._previous.get(addr)
        if previous is None:
            previous = self._hash(self._secrets[1], addr)
        return echo == previous


class PeerTokens:
    """The tokens others gave this node, per address, and what to send again when a
    cookie comes back from an address that did not yet know this node.

    A token is taken from a datagram that proved its own source (its echo was right),
    or from any datagram when none is held for that address: a forged first token only
    costs one round trip, as the real peer's cookie then replaces it.
    """

    # A first contact is a round's datagrams, a probe and content: a few at most.
    PENDING_PER_ADDR = 8

    def __init__(self, epoch_ms: int, max_entries: int, max_pending: int) -> None:
        self.epoch_ms = epoch_ms
        self._max_entries = max_entries
        self._max_pending = max_pending
        self._tokens: OrderedDict[Addr, tuple[int, int]] = OrderedDict()
        self._pending: OrderedDict[Addr, list[tuple[int, int, bytes]]] = OrderedDict()

    def echo(self, addr: Addr) -> int:
        held = self._tokens.get(addr)
        return held[0] if held is not None else 0

    def learn(self, addr: Addr, token: int, proven: bool, now: int) -> None:
        if token == 0 or (not proven and addr in self._tokens):
            return
        self._tokens[addr] = (token, now)
        self._tokens.move_to_end(addr)
        if len(self._tokens) > self._max_entries:
            self._tokens.popitem(last=False)

    def may_be_refused(self, addr: Addr, now: int) -> bool:
        """Whether `addr` may answer a datagram echoing our token with a cookie: no
        token, or one old enough that its secret may have rotated out."""
        held = self._tokens.get(addr)
        return held is None or now - held[1] >= self.epoch_ms

    def keep(self, addr: Addr, kind: int, flags: int, body: bytes) -> None:
        """A datagram sent to `addr` while it may be refused, to send again (the last
        PENDING_PER_ADDR of them, for the last max_pending addresses)."""
        kept = self._pending.pop(addr, [])
        kept.append((kind, flags, body))
        self._pending[addr] = kept[-self.PENDING_PER_ADDR:]
        if len(self._pending) > self._max_pending:
            self._pending.popitem(last=False)

    def take_pending(self, addr: Addr) -> list[tuple[int, int, bytes]]:
        return self._pending.pop(addr, [])
