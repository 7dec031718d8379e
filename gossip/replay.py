"""Replay protection: each datagram's seq is fresh and seen once.

A sender stamps every datagram with a seq, the microseconds of its wall clock made
strictly increasing. A receiver refuses a seq further than `window_us` from its own
wall clock (a datagram captured earlier, or a sender whose clock is off by more than
NTP allows), and remembers, per sender and source address, the last `_KEPT` seqs it
took: one of them again, or one below all of them once that many are held, is refused,
so a datagram replayed from the address it was first sent from is refused. (IPsec's
sliding bitmap needs consecutive numbers; these are microseconds, sparse per receiver.)
A replay from any other address does not prove that address (gossip/cookies.py), so it
gets a cookie and nothing else. With a key the tag covers the seq, so these checks hold
against anyone without the key.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Hashable

# Datagrams between two hosts on one network are rarely reordered by more than a few.
_KEPT = 16


class ReplayGuard:
    def __init__(self, window_us: int, max_entries: int) -> None:
        self.window_us = window_us
        self._max_entries = max_entries
        self._seen: OrderedDict[Hashable, list[int]] = OrderedDict()

    def stale(self, seq: int, now_us: int) -> bool:
        """Whether `seq` lies outside the replay window around `now_us`."""
        return abs(seq - now_us) > self.window_us

    def first_time(self, source: Hashable, seq: int) -> bool:
        """Record `seq` from `source`; False when it was taken before, or is older than
        every seq held once `_KEPT` are."""
        kept = self._seen.pop(source, None)
        if kept is None:
            kept = [seq]
        else:
            i = bisect.bisect_left(kept, seq)
            if (i < len(kept) and kept[i] == seq) or (i == 0 and len(kept) >= _KEPT):
                self._seen[source] = kept
                return False
            kept.insert(i, seq)
            if len(kept) > _KEPT:
                del kept[0]
        self._seen[source] = kept
        if len(self._seen) > self._max_entries:
            self._seen.popitem(last=False)
        return True
