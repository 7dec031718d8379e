"""The announcement queue: memberlist's TransmitLimitedQueue for (node, version, status and incarnation).

- Latest wins: one entry per node; news about a node replaces its queued entry and
  starts it again from zero transmissions.
- Least-sent first, newest first among equals, so fresh news overtakes news that most
  of the mesh has already heard.
- Each entry is sent at most `limit` times (RetransmitMult * ceil(log10(N + 1)), fixed
  when it is queued), then dropped: the queue holds at most one entry per node and
  empties when nothing changes, so the bytes sent follow the rate of real changes.
"""

from __future__ import annotations

from itertools import islice

Entry = tuple[int, int, int]  # node key, version, status << 30 | incarnation


class BroadcastQueue:
    def __init__(self) -> None:
        # _levels[n] holds the entries sent n times so far, oldest first, each as
        # (version, status and incarnation, how many times to send it).
        self._levels: list[dict[int, tuple[int, int, int]]] = [{}]
        self._level_of: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._level_of)

    def __contains__(self, key: int) -> bool:
        return key in self._level_of

    def put(self, key: int, version: int, tail: int, limit: int) -> None:
        """Queue news about `key`, to be sent `limit` times, replacing older news."""
        level = self._level_of.get(key)
        if level is not None:
            del self._levels[level][key]
        self._levels[0][key] = (version, tail, limit)
        self._level_of[key] = 0

    def take(self, n: int, first: int | None = None, skip: frozenset[int] | set[int] = frozenset()) -> list[Entry]:
        """Up to n entries to send now, `first` ahead of all when queued, none of `skip`
        (the receiver has them); each taken entry counts one transmission."""
        levels, level_of = self._levels, self._level_of
        out: list[Entry] = []
        # (level it moves to, key, item), applied at the end so that nothing goes twice.
        moved: list[tuple[int, int, tuple[int, int, int]]] = []
        if first is not None and first not in skip and first in level_of:
            level = level_of[first]
            item = levels[level].pop(first)
            out.append((first, item[0], item[1]))
            moved.append((level + 1, first, item))
        for level, bucket in enumerate(levels):
            room = n - len(out)
            if room <= 0:
                break
            if not bucket:
                continue
            newest = reversed(bucket)
            keys = list(islice((k for k in newest if k not in skip) if skip else newest, room))
            pop = bucket.pop
            items = [pop(k) for k in keys]
            out += [(k, item[0], item[1]) for k, item in zip(keys, items)]
            moved += [(level + 1, k, item) for k, item in zip(keys, items)]
        for level, key, item in moved:
            if level >= item[2]:
                del level_of[key]
                continue
            if level == len(levels):
                levels.append({})
            levels[level][key] = item
            level_of[key] = level
        return out
