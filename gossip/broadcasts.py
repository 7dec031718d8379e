"""The announcement queue: memberlist's TransmitLimitedQueue for (node, version, status and incarnation).

- Latest wins: one entry per node; news about a node replaces its queued entry and
  starts it again from zero transmissions.
- Least-sent first, newest first among equals, so fresh news overtakes news that most
  of the mesh has already heard.
- Each entry is sent at most `limit` times (RetransmitMult * ceil(log10(N + 1)), more
  under loss: GossipParams.retransmit_limit; fixed when it is queued), then dropped:
  the queue holds at most one entry per node and empties when nothing changes, so the
  bytes sent follow the rate of real changes.
- An entry goes short (8 bytes, the version only: wire.py) unless it is liveness news
  (a suspicion, a death, a refutation: `full`), and stays full while news that was full
  is still being sent, so that a version published during a refutation does not cut the
  refutation's spread short. Nearly all news is a new version: short, it costs 8 bytes
  where it cost 14.
"""

from __future__ import annotations

from collections.abc import Iterable, KeysView
from itertools import islice

from loadmesh.gossip.wire import ENTRY, INCARNATION_MAX, SHORT, VERSION_ONLY

# node key, version, status << 30 | incarnation (VERSION_ONLY: a short announcement)
Entry = tuple[int, int, int]


class BroadcastQueue:
    def __init__(self) -> None:
        # _levels[n] holds the entries sent n times so far, oldest first, each as
        # (version, status and incarnation, how many times to send it).
        self._levels: list[dict[int, tuple[int, int, int]]] = [{}]
        self._level_of: dict[int, int] = {}
        # Full entries queued: while there are none (nearly always), take() counts entries
        # instead of weighing each (it runs for every datagram of every round).
        self._fulls = 0
        # Per short entry, the contacts that have shown they hold its news (heard_known).
        self._known: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._level_of)

    def __contains__(self, key: int) -> bool:
        return key in self._level_of

    def keys(self) -> KeysView[int]:
        """The nodes with news queued (a live view)."""
        return self._level_of.keys()

    def put(self, key: int, version: int, tail: int, limit: int, full: bool = False) -> None:
        """Queue news about `key`, to be sent `limit` times, replacing older news; short
        unless `full` or the news it replaces went full."""
        level = self._level_of.get(key)
        if level is not None:
            old = self._levels[level].pop(key)
            if old[1] != VERSION_ONLY:
                full = True
                self._fulls -= 1
                if (old[1] ^ tail) & INCARNATION_MAX == 0:
                    # Under one incarnation a death outranks a suspicion, which outranks
                    # life (as receivers merge them): a new version does not take back
                    # what was queued of the node's liveness.
                    tail = max(tail, old[1])
        self._levels[0][key] = (version, tail if full else VERSION_ONLY, limit)
        self._level_of[key] = 0
        self._fulls += full
        self._known.pop(key, None)

    def heard_known(self, keys: Iterable[int], limit: int) -> None:
        """A contact holds the queued news of `keys` already: a short entry that `limit`
        contacts have shown so is dropped (Demers' feedback and counter: a rumour that
        keeps meeting nodes that know it has reached most of them, and the rest learn it
        by pull from those). Liveness news (full) always goes its whole limit. At 1000
        nodes, with 4, a node sends 17% fewer bytes and the convergence p99 is the same
        (docs/gossip.md, known_stop)."""
        if not limit:
            return
        known, level_of, levels = self._known, self._level_of, self._levels
        for key in keys:
            level = level_of.get(key)
            if level is None or levels[level][key][1] != VERSION_ONLY:
                continue
            count = known.get(key, 0) + 1
            if count < limit:
                known[key] = count
                continue
            del levels[level][key], level_of[key]
            known.pop(key, None)

    def take(self, room: int, first: int | None = None, skip: frozenset[int] | set[int] = frozenset()) -> list[Entry]:
        """Entries to send now, up to `room` bytes of them, `first` ahead of all when
        queued, none of `skip` (the receiver has them); each taken entry counts one
        transmission."""
        levels, level_of = self._levels, self._level_of
        out: list[Entry] = []
        # (level it moves to, key, item), applied at the end so that nothing goes twice.
        moved: list[tuple[int, int, tuple[int, int, int]]] = []
        full, short = ENTRY.size, SHORT.size
        if first is not None and first not in skip and first in level_of:
            level = level_of[first]
            item = levels[level].pop(first)
            out.append((first, item[0], item[1]))
            moved.append((level + 1, first, item))
            room -= short if item[1] == VERSION_ONLY else full
        for level, bucket in enumerate(levels):
            if room < short:
                break
            if not bucket:
                continue
            newest = reversed(bucket)
            if skip:
                newest = (k for k in newest if k not in skip)
            if self._fulls:
                keys = []
                for k in newest:
                    cost = short if bucket[k][1] == VERSION_ONLY else full
                    if cost > room:
                        continue  # a full one: short ones may still fit
                    room -= cost
                    keys.append(k)
                    if room < short:
                        break
            else:
                keys = list(islice(newest, room // short))
                room -= len(keys) * short
            pop = bucket.pop
            items = [pop(k) for k in keys]
            out += [(k, item[0], item[1]) for k, item in zip(keys, items)]
            moved += [(level + 1, k, item) for k, item in zip(keys, items)]
        for level, key, item in moved:
            if level >= item[2]:
                del level_of[key]
                self._known.pop(key, None)
                self._fulls -= item[1] != VERSION_ONLY
                continue
            if level == len(levels):
                levels.append({})
            levels[level][key] = item
            level_of[key] = level
        return out
