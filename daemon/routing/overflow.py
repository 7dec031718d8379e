"""One request of a session sent past its host while that host queues well above the fleet:
the session stays where it is, this request goes to the next peer along its ring.

The bands (shed.py) move sessions, and only on evidence: a host's excess must outlast
what chance explains, 8 s at 2.5 times its share and 20 s at 1.6 times, because a session
moved costs its prefix cache and moving on noise passed sessions round the ring. A small
host's queue wanders faster than that: at 80% load, a 4-slot host beside 8-slot ones
that gets 1.2 times its share for 10 s (a count of some 20 requests; a few light
sessions bursting together) runs past its batch and queues. On the fleet bench, 30 s
into the sessions, the small host held 1.90-2.31 times its share of the requests in flight
(seeds 7 and 1, three runs), while 92-97% of a session's requests stayed on its host:
affinity to spare, spent nowhere. A request sent past a queue costs one prefill
elsewhere and moves nothing: the session's next request goes home again once the queue
has drained.

A peer overflows while its snapshot's in-flight count is above its capacity (requests
wait there) and above OVERFLOW times the model's level, the candidates' in-flight
count over their capacity all together, times its own capacity: its load per slot
against the fleet's, as the bands measure it, but at once and at a mark chance rarely
reaches. From the snapshots' figures alone, not this node's sends since, so that every
node holding the same snapshots sends a session's request to the same peer; the level
is taken every LEVEL_EVERY_MS (the snapshot tick), a pass over the model's candidates
where sessions are routed.

Light sessions only: a heavy one is most of its host's bursts (heavy.py), so its host
overflows and drains with its own requests, and sent past by turns, the fleet bench's
busiest session went between its host and the next every second or so; of the pairs of
one session's requests that two hosts sent to different peers within a second on seed
2, all seven were of requests sent past, four of that session's, and two hosts agreed
94.3% of the time (light sessions only: 97.2-99.0% on four seeds; docs/routing.md).
Nor a middling one (heavy.weighs): a session busy enough to be one has its prefix in
its host's cache, and its requests are the ones a move of its own costs most; a
sparse session's prefix a busy host has mostly evicted between its requests. With the
middling sessions kept home the mark could come down from 1.75 to 1.25: on the fleet
bench after 30 s of sessions, seeds 7, 1, 2, 3, the busiest host held 1.22, 1.13, 1.18,
1.25 times its share, 88.9-95.2% of a session's requests stayed on its host, and two
agents asked at the same moment agreed 95.4-97.7% of the time (at 1.25 with middling
sessions sent past too: 88.7% and 92.5% on seed 7; at 1.5 without them, the busiest host
1.24-1.34; at 1.75, 1.22 and 1.51 on seeds 1 and 7).
"""

from __future__ import annotations

from loadmesh.daemon.routing.candidates import Candidate, ModelCandidates

OVERFLOW = 1.25
LEVEL_EVERY_MS = 250


class Overflow:
    """Per model, the fleet's load per slot, taken at most every LEVEL_EVERY_MS."""

    def __init__(self) -> None:
        self._levels: dict[int, tuple[int, float]] = {}

    def overflows(self, entry: ModelCandidates, c: Candidate, now_ms: int) -> bool:
        in_flight = c.peer.in_flight
        return in_flight > c.capacity and in_flight > OVERFLOW * self._level(entry, now_ms) * c.capacity

    def spare(self, entry: ModelCandidates, ordered: list[Candidate], now_ms: int) -> Candidate | None:
        """The first of the peers after ordered[0] (its session's next along its ring) that
        does not overflow, where ordered[0] does; else None."""
        if not self.overflows(entry, ordered[0], now_ms):
            return None
        return next((c for c in ordered[1:] if not self.overflows(entry, c, now_ms)), None)

    def forget_except(self, model_ids: set[int]) -> None:
        for gone in self._levels.keys() - model_ids:
            del self._levels[gone]

    def _level(self, entry: ModelCandidates, now_ms: int) -> float:
        taken = self._levels.get(entry.model_id)
        if taken is None or now_ms - taken[0] >= LEVEL_EVERY_MS:
            capacity = sum(c.capacity for c in entry.candidates)
            level = sum(c.peer.in_flight for c in entry.candidates) / capacity if capacity > 0 else 0.0
            taken = self._levels[entry.model_id] = (now_ms, level)
        return taken[1]
