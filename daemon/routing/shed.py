"""The sessions' load bound, decided by the host that carries the load.

Each session has, for each peer, a coin in [0, 1) (BLAKE2b of the two names, so every host
draws the same), in a part of the circle that says what the session is to that peer (Seat):
in [GUESTS, LAST) where the peer is the session's own (the first on its ring), in [LAST, 1)
where it is its own and weighs (heavy.py: a heavy or middling session); in [ORPHANS,
GUESTS) where it is a guest, its owner live and passing it on; in [0, ORPHANS) where it is
an orphan, its owner gone (dead, draining, not serving), at every peer it reaches along the
ring. A peer publishes, per model, a band of the coins: [start, start + width) around the
circle. It passes on the sessions whose coin falls in its band, which then go to the next
peer on their ring (router.py); it keeps the others. A band grows from 0, so a host passes
on a lost host's sessions first, then the sessions that live peers passed on to it, then
its own, those that weigh last: when a host is lost, its sessions move on to where there
is room, and the sessions of the hosts that took them stay where they are, their own and
the guests they hold for a live peer (with one part for both kinds of guest, the hosts
that took a lost host's sessions passed on, with them, guests held for 20 s: of the
requests of the others' sessions that moved after a kill in the fleet bench, 5 of 6 were
guests'). An orphan moved on has just lost its cache anyway; a guest has warmed one here.
The guests' part is small: a host with few of them must reach its own sessions soon.

The band follows the host's load per slot (in flight over capacity, the batch it has
shown), smoothed over _SMOOTH_MS. A slot is a unit of batch, so equal load per slot is
equal queueing; a slower host at equal load per slot already takes fewer requests a
second. Against the others' level (_level: their mean load per slot, every host above this
one counted at this one's), the host's share is that level times its slots:

- Above 1 + epsilon times its share for long enough that chance cannot explain it, every
  _STEP_MS the band grows by the excess over that mark times _GAIN (at least _MIN_STEP,
  at most _MAX_STEP) of the coins it still keeps: the sessions at its end move away.
  Of what it keeps, because the excess is a share of the load it still carries: grown
  by that share of the whole circle, a band 0.48 wide passed on two thirds of what was
  left in one step, and in the fleet bench a host holding the busiest session (16% of
  the requests) went 0.48, 0.84, 1.00 in 10 s, passed on every session it had, the
  busiest with them, and sat idle while the next hosts on their ring took them and
  passed them on in turn (on seed 2, of the others' sessions' requests, 25-60% moved
  after the kill in three runs). Grown from what it keeps, the same host stopped at
  0.77 and 0.78, and 3.1-4.6% moved in two runs. On seed 1, whose lost host leaves the
  others at 103% of their slots, the bands still reach 0.6-0.86 after the kill and
  40-51% moved in three runs (79%, every band at 1.00, grown by a fixed width).
  Requests come and go at random: a count whose mean is its share has the share's
  square root as its standard deviation,
  and a host holding six when its share is five is not overloaded. So each step adds the
  excess in standard deviations, less _SLACK, to the band's evidence (a CUSUM, floored at
  0, capped at _EVIDENCE), and the band grows while the evidence is at _EVIDENCE; a
  growth spends all of it, so the next is grown on evidence gathered after it. With the
  counting process of tests/test_routing_shed.py (Poisson arrivals, lognormal service
  times of 2.5 s on average, the share 4.8; 10 seeds): at its share, a band grows by
  chance once in 460 s; it first grows after 8 s at 2.5 times the share, 14 s at 1.9
  times, 20 s at 1.6 times (medians, from a cold start, the 5 s the count takes to rise
  included). The rule it replaces, a mark one standard deviation above 1 + epsilon, grew
  bands by chance about as often (10 times in 1800 s of the same model) and never below
  1.6 times the share: a host held 1.8 times its share of the fleet's requests for 30 s
  in the fleet bench. Without any margin, chance alone grew every band: after 20 s of
  traffic without sessions the fleet bench's hosts passed on 14-52% of their sessions,
  and a band comes back only after a long quiet. It does not grow while the host's
  in-flight count is below _DRAINING of what it was at the last step, or below the mark
  (unsmoothed: the smoothed figure would still be rising): the sessions passed on are
  working, and what still counts against the host is the queue they left, which only
  time drains. Steps sized by the excess, each given time to show: a step that shows
  only after the next has been taken overshoots, and every host then passes everything
  on. Small steps, each on fresh evidence: with steps of up to 0.35 of what the band
  keeps, each spending half the evidence (a host at twice its share passed half on in
  6 s, against 18 s now), every band in the fleet bench climbed to 0.4-0.9 within the
  first 30 s and stayed there, the hosts passing each other's sessions round the ring:
  over four seeds 88-94% of a session's requests stayed on its host, 10-30% of them
  went elsewhere than their host of the 10 s before in 16 s with no host lost, and the
  small host held up to 2.2 times its share. With these steps, the bands held 0.21-0.30
  on average (0.32-0.53), 95-97% of a session's requests stayed on its host and 5-15%
  moved in 16 s (eight runs, docs/routing.md; the small host still held 2.0 times its
  share on seed 7). It takes both: the gain alone (0.2, steps still up to 0.35, half
  spent) kept 91-94%, the whole spend alone 87%.
  A band that grows from 0 stops for a step at the end of each part that the host may
  hold sessions in (the orphans' where a peer is gone, the guests' where another passes
  sessions on): what they carried leaves before any of its own sessions do. Where it
  holds none, the step would only lose 2 s. A band whose start has moved on (sessions
  taken back) grows at its start first, down to 0: the guests, and the sessions taken
  back last, go before any of its own beyond the end (grown at the end, in a fleet
  bench run, a band taken back from [0, 0.82) to [0.10, 0.82) grew to [0.10, 0.99)
  after a host was lost: its own sessions went, none of the guests the loss sent it).
- While the other candidates have less than _ROOM of their slots free (a host lost, a
  surge), the band grows no further than the guests: they queue too, so a session of its
  own moved there moves its queue rather than shortening it, and costs its prefix cache,
  a whole prefill, when the fleet can least afford one; and a lost host's sessions, not
  the survivors' own, are the ones that move on. Free slots are counted per peer: by the
  sums, two queueing hosts would make three idle ones look full. (Growing above twice
  1 + epsilon instead, the hosts that took a lost host's sessions passed on 64-100% of
  their own in the fleet bench, and half the survivors' sessions moved.) Where a peer is
  gone, no further than the orphans: the guests are other live hosts' sessions, and a
  loss is to move the lost host's alone (stopped at the guests, on the fleet bench's
  seed 7 every survivor's band grew past 0.6, and two thirds of the others' requests
  that moved after the kill were sessions every survivor passed on, spilled by weights
  that moved with each band; docs/routing.md).

Against the fleet's mean load per slot:

- Below the fleet's mean load per slot at the first step after a peer is lost, a band
  over the orphans' part gives it back: a lost host's sessions move anyway, and a host
  with room takes them, whatever its band passed on before the loss (a band grown for
  an overload long past refused them all: in the fleet bench, h2 and h4, at 0.6 and 0.9
  of their shares with bands of 0.50 and 0.24, passed on every one of h3's sessions
  that reached them, to h1 and h5, which then held 2.8 and 5.3 requests a slot and
  passed on guests of their own). At that step only: a band grown since, for the
  orphans, passed them on first, and taking them back later would move them twice (at
  every step instead, h1 passed them on, then its guests, then took them back and kept
  passing on the guests). Below the mean, not merely under the mark, so that the
  orphans taken do not grow the band straight back.
- Below _LOW for _QUIET_MS on end, every _STEP_MS the band's start moves forward by
  _RETURN_GAIN times the shortfall under _LOW (as a fraction of it), at least _RETURN: the
  sessions passed on first come back first, and an idle host's sooner (at _RETURN alone, a
  host that had passed everything on sat at 0.07 of its share of the fleet's requests for
  30 s in the fleet bench, while another held 1.4 times its share). The last one passed
  on is the one that ended the overload (often the busiest session), and it stays away
  longest; taking it back first would pass it on again at once. Only after a long quiet,
  because a session that comes back is a session moved twice (returning by 0.2 x the
  shortfall after 4 s, bands swung between 0.05 and 0.9 in the fleet bench and 68% of a
  session's requests stayed on its host). An empty band starts from 0 again.

With less than one request in flight per candidate the comparison says nothing: the band
holds. While this host has answered no request of a session for _QUIET_MS, it neither
grows nor keeps its band: it gives it back by _RETURN_GAIN every _STEP_MS. Passing
sessions on cannot lower a load that has none, so a band grown on it is only a band too
wide when sessions come: in the fleet bench, the runs at 95% and the slowdown (no
sessions) left h5 passing on all of its sessions, and the sessions run after them began
with h5 idle, its sessions overloading the next hosts, whose bands grew in turn (83% of a
session's requests on its host, 69% of the others' moved after the kill). Each host sees
a sample of the fleet's sessions, as an entry for its own clients; a fleet whose session
traffic enters at a few hosts only keeps its sessions on the others' hosts, overloaded or
not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from loadmesh.daemon.routing.ring import hash64
from loadmesh.daemon.routing.session_counts import SessionCounts
from loadmesh.gossip.snapshot import MAX_MODELS

GUESTS = 0.1
ORPHANS = 0.05
LAST = 0.9
_SMOOTH_MS = 2_000
_STEP_MS = 2_000
_GAIN = 0.2
_MIN_STEP = 0.03
_MAX_STEP = 0.2
_DRAINING = 0.95
_ROOM = 0.1
_SLACK = 0.5
_EVIDENCE = 3.0
_LOW = 0.75
_QUIET_MS = 10_000
_RETURN = 0.02
_RETURN_GAIN = 0.1


class Seat(Enum):
    """What a session is to one peer of its ring: the part of the circle of its coin."""

    ORPHAN = (0.0, ORPHANS)    # its owner (the first peer on its ring) is gone
    GUEST = (ORPHANS, GUESTS)  # its owner is live and passes it on
    OWN = (GUESTS, LAST)       # the first peer on its ring
    OWN_LAST = (LAST, 1.0)     # the same, a session that weighs (heavy.py): passed on last


def coin(node_id: str, session: str, seat: Seat) -> float:
    low, high = seat.value
    return low + hash64(f"{node_id}\x1f{session}") / 2**64 * (high - low)


def passes_on(start: float, width: float, node_id: str, session: str, seat: Seat) -> bool:
    """Whether a peer publishing the band (start, width) passes the session on."""
    if width <= 0:
        return False
    return (coin(node_id, session, seat) - start) % 1.0 < width


@dataclass
class _Band:
    start: float = 0.0
    width: float = 0.0
    load: float = 0.0           # smoothed in flight
    share: float = 0.0          # smoothed in flight at the others' level (_level)
    ratio: float = 1.0          # smoothed load per slot over the fleet's mean
    free: float = 1.0           # smoothed share of the other candidates' slots free
    step_load: float = 0.0      # in flight at the last step
    evidence: float = 0.0       # CUSUM of the standard deviations above the mark
    smoothed_ms: int | None = None
    stepped_ms: int = 0
    quiet_since: int | None = None
    gone: int = 0               # peers gone at the last step


def _level(own_per_slot: float, others: Sequence[tuple[float, float]]) -> float:
    """The other hosts' load per slot, every one above this host counted at this host's
    level: how far this host stands above the rest, not counting those above it. With the
    plain mean, one host's long queue makes every other host look idle, queueing or not;
    with the median, two queueing hosts hide two idle ones. This host's own load is left
    out: a queue of its own lifts the fleet's mean, and its share with it (in the fleet
    bench, a host with 17 in flight on 8 slots, next to one idle host and three at one a
    slot, counted 10 of them as its share)."""
    total = sum(cap for _, cap in others)
    return sum(min(load / cap, own_per_slot) * cap for load, cap in others if cap > 0) / total


class Shedding:
    """This host's bands, per model_id. Not thread-safe: the router's update calls it."""

    def __init__(self, epsilon: float) -> None:
        self.epsilon = epsilon
        self._bands: dict[int, _Band] = {}
        self._sessions_ms: dict[int, int] = {}
        self.counts = SessionCounts(MAX_MODELS)

    def saw(self, model_id: int, session: int | None, now_ms: int) -> None:
        """This host answered a request for the model: of a session (its key), or of none."""
        if session is not None:
            self._sessions_ms[model_id] = now_ms
        self.counts.saw(model_id, session, now_ms)

    def watching(self, model_id: int, now_ms: int) -> bool:
        """Whether this host answered a session of the model within _QUIET_MS: if not,
        step() only gives the band back, and reads nothing of the others."""
        seen = self._sessions_ms.get(model_id)
        return seen is not None and now_ms - seen <= _QUIET_MS

    def band(self, model_id: int) -> tuple[float, float]:
        b = self._bands.get(model_id)
        return (0.0, 0.0) if b is None else (b.start, b.width)

    def forget_except(self, model_ids: set[int]) -> None:
        for gone in self._bands.keys() - model_ids:
            del self._bands[gone]
        for gone in self._sessions_ms.keys() - model_ids:
            del self._sessions_ms[gone]

    def step(self, model_id: int, own_load: float, own_capacity: float,
             others: Sequence[tuple[float, float]], now_ms: int,
             gone: int = 0, guests: bool = True) -> None:
        """own_load, own_capacity: this host's in flight and slots; others: the same for
        each other candidate of the model; gone: how many of the peers known to serve it
        are not candidates (their sessions are orphans here); guests: whether another
        peer passes sessions on."""
        b = self._bands.setdefault(model_id, _Band(stepped_ms=now_ms))
        if not self.watching(model_id, now_ms):
            b.smoothed_ms, b.quiet_since, b.evidence = None, None, 0.0
            if now_ms - b.stepped_ms >= _STEP_MS:
                _give_back(b, _RETURN_GAIN)
                b.stepped_ms, b.step_load = now_ms, own_load
            return
        fleet_load = own_load + sum(load for load, _ in others)
        fleet_capacity = own_capacity + sum(cap for _, cap in others)
        if fleet_load < 1 + len(others) or own_capacity <= 0 or fleet_capacity <= 0:
            b.smoothed_ms, b.quiet_since, b.evidence = None, None, 0.0
            return
        own = own_load / own_capacity
        room = fleet_capacity - own_capacity
        share = (_level(own, others) if room > 0 else own) * own_capacity
        ratio = own / (fleet_load / fleet_capacity)
        free = sum(max(0.0, cap - load) for load, cap in others) / room if room > 0 else 0.0
        if b.smoothed_ms is None:
            b.load, b.share, b.ratio, b.free, b.step_load = own_load, share, ratio, free, own_load
        else:
            keep = math.exp(-max(0, now_ms - b.smoothed_ms) / _SMOOTH_MS)
            b.load = keep * b.load + (1 - keep) * own_load
            b.share = keep * b.share + (1 - keep) * share
            b.ratio = keep * b.ratio + (1 - keep) * ratio
            b.free = keep * b.free + (1 - keep) * free
        b.smoothed_ms = now_ms
        if b.ratio >= _LOW:
            b.quiet_since = None
        elif b.quiet_since is None:
            b.quiet_since = now_ms
        if now_ms - b.stepped_ms < _STEP_MS:
            return
        mark = (1 + self.epsilon) * b.share
        if b.share > 0:
            z = (b.load - mark) / math.sqrt(b.share) - _SLACK
            b.evidence = min(_EVIDENCE, max(0.0, b.evidence + z))
        excess = (b.load - mark) / b.share if b.share > 0 else 0.0
        most = 1.0 if b.free >= _ROOM else max(b.width, ORPHANS if gone > 0 else GUESTS)
        draining = own_load <= max(mark, _DRAINING * b.step_load)
        if b.evidence >= _EVIDENCE and excess > 0 and not draining and b.width < most:
            step = min(_MAX_STEP, max(_MIN_STEP, _GAIN * excess)) * (1.0 - b.width)
            width = min(most, b.width + step)
            if b.start == 0:
                for end, held in ((ORPHANS, gone > 0), (GUESTS, guests)):
                    if held and b.width < end:
                        width = min(width, end)
                        break
            # Below a start above 0 are the guests and the sessions taken back last: they
            # go before any of its own beyond the end.
            back = min(width - b.width, b.start)
            b.start, b.width = b.start - back, width
            b.evidence = 0.0
        elif gone > b.gone and b.ratio < 1 and b.start < ORPHANS < b.start + b.width <= 1:
            _give_back(b, ORPHANS - b.start)
        elif b.quiet_since is not None and now_ms - b.quiet_since >= _QUIET_MS:
            _give_back(b, max(_RETURN, _RETURN_GAIN * (_LOW - b.ratio) / _LOW))
        b.stepped_ms, b.step_load, b.gone = now_ms, own_load, gone


def _give_back(b: _Band, part: float) -> None:
    """Takes back the first `part` of the band: the sessions passed on first."""
    back = min(b.width, part)
    b.start, b.width = (b.start + back) % 1.0, b.width - back
    if b.width <= 0:
        b.start, b.width = 0.0, 0.0
