"""Heavy sessions: those that are a large part of a host's share of a model's requests,
placed on hosts by every node alike, from figures every node holds.

A band (shed.py) moves sessions by their coins, blind to their weight. A session that is
most of a small host's share moves whole: the fleet bench's busiest session, 16-17% of
the requests where the small host's share is 12.5%, overloaded every host that took it,
whose band then passed it on in turn; after the sessions' cold start the bands only grew,
the loads swung between 0.05 and 3-4 times a host's share with a period of 10-15 s, and
74-85% of a session's requests stayed on its host (docs/routing.md). Kept by its ring
owner whatever the owner's band, judged heavy by each node from the requests it routed
itself, such sessions stayed put (85-95%), but nodes near the mark judged differently and
agreed on a session's host 93-95% of the time. So the judgment is made from the fleet's
figures: each node publishes the request rates of the busiest sessions it routed
(gossip/snapshot.SessionRates), and every node sums them.

A session is heavy once its rate is ENTER of the smallest known peer's share of the model's
requests (the requests its peers say they routed, counted as the sessions' are:
session_counts.py), and stays heavy down to LEAVE: a third, as much as ALONE lets any
host hold in one session, so that the small host takes a heavy session only where no
larger one has room. A quarter (and 0.15) was chosen while each agent counted a session's
rate over its own time rather than the session's (session_counts.py), which held the
fleet bench's sessions at 46-83% of their rates over their first minute: a threshold
of about a third in effect. Counted at their rates, at a quarter 5-8 sessions were
heavy where 4-5 had been (the sixth to eighth busiest, 2-2.6% of the requests, came in
on a burst and stayed above LEAVE), and each agent logged 6-23 placements that moved a
heavy session in a run where it had logged 3-4, two sessions of the same step
swapping hosts back and forth (23 on seed 7, where the small host held 2.41 times its
share from 30 to 60 s); at a third, 3-4 again. The smallest share is taken before the
pooling factor (pooling.py), which bounds how much a small host takes, not what weighs on
it: taken after it, 10% less for the small host let a sixth session in on seed 7. Shares
are the ring's weights (candidates.ring_points), which every node computes alike. The
heavy sessions are placed busiest first, each on the first candidate along its ring whose
heavy sessions, with it, stay within ROOM of its share and which it alone would not fill
past ALONE of its share; where none fits, on the one with the most room left (the first
such along its ring). So a heavy session stays with its ring owner while that has room,
and the busiest goes to a large host: on a host of half the share it would be most of its
load alone. The rest of the host's share is for the light sessions, which its band bounds
as before; it counts the heavy ones' load like any. The light sessions walk a ring of their
own (router._place_light), each peer's points cut by the part of its share its heavy
sessions take (held: placed as if every known peer were a candidate, so that a loss changes
neither the placement of the survivors' sessions nor that ring). One session is one stream of bursts,
and a host's queue grows with the bursts against its batch: in tests/test_fleet_sessions.py
the small host (4 slots of 20) held the second busiest session, half its share, within
ROOM, and held 1.35-1.40 times its share of the requests in flight over four runs (the
large hosts 0.77-1.03), where the same requests a second on a larger host queue less. At
most a third of a host's share alone, the session went to a large host, and the small
host held 0.89-1.26 times its share, the busiest host 1.10-1.26, in ten runs.

A session below heavy but at least MIDDLING of the smallest share (until below
MIDDLING_LEAVE) is middling: its owner's band passes it on last, after every light
session of its own (shed.Seat.OWN_LAST); a heavy one too, where its placed host is not
usable and the ring decides. The fleet bench's 6th to 20th busiest sessions (0.8-3% of
the requests each) were most of the requests that went elsewhere than their session's
host: passed along the ring as the bands grew over their coins, each a few percent of the
next host's load, which grew its band in turn. Passed on last, 91.7% of a session's
requests stayed on its host on average over eight runs (89.7% before). Kept by their
owner whatever its band (pinned), they left a small host's band too little to pass on
(docs/routing.md, "Middling sessions").

Rates are compared in steps of 2**(1/4) (19%): a figure's noise moves a placement only
where it crosses a step. A heavy session keeps the step it had until its share is a whole
step from it (quantized_from): rounded afresh, a share near a step's midpoint crossed it
back and forth, and in the fleet bench one session went between h1, h3 and h5 thirteen
times in 41 s (seed 1); each agent moved heavy sessions 30-39 times in a run, 11-13 with
the step held (one run; 18-26 in two runs before ALONE). Each node recomputes the
placement from the same snapshots, and the step it holds is where the same shares took
it, so nodes disagree only while a change that moves a placement has reached some and
not others, or a share stays within the step it crossed at one node and not yet at
another (agreement 98.3 and 99.5% on seeds 1 and 7 with the step held).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection, Iterable, Mapping

from loadmesh.daemon.routing.ring import stepped

ENTER = 1 / 3
LEAVE = 0.2
ROOM = 0.5
ALONE = 1 / 3
MIDDLING = 1 / 16
MIDDLING_LEAVE = 0.6 / 16
# Bounds on the work of a placement, whatever the peers publish: the busiest MAX_HEAVY
# sessions of a model are placed, each among the first MAX_WALK peers along its ring.
MAX_HEAVY = 64
MAX_WALK = 8
_STEPS_PER_DOUBLING = 4


def quantized(share: float) -> float:
    """share rounded to its step (2**(1/4) apart); 0 stays 0."""
    return stepped(share, _STEPS_PER_DOUBLING)


def quantized_from(share: float, before: float | None) -> float:
    """quantized(share), but the step it had before while the share is still within a
    whole step of it: rounding alone changes step at the midpoint, which noise crosses
    back and forth."""
    if before is not None and share > 0 and abs(math.log2(share / before)) * _STEPS_PER_DOUBLING < 1:
        return before
    return quantized(share)


class HeavySessions:
    """Per model, the heavy sessions (by key) and the host placed for each."""

    def __init__(self) -> None:
        self._hosts: dict[int, dict[int, str]] = {}
        self._middling: dict[int, set[int]] = {}
        # Per model, each heavy session's step (quantized_from): its keys are the heavy ones.
        self._steps: dict[int, dict[int, float]] = {}
        # Per model, the share of the model's requests each peer holds in heavy sessions,
        # placed as if every known peer were a candidate: what a loss does not change.
        self._held: dict[int, dict[str, float]] = {}

    def weighs(self, model_id: int, session: int) -> bool:
        """Whether the session is heavy or middling: passed on last by its owner's band."""
        return session in self._steps.get(model_id, ()) or session in self._middling.get(model_id, ())

    def host(self, model_id: int, session: int) -> str | None:
        hosts = self._hosts.get(model_id)
        return None if hosts is None else hosts.get(session)

    def placed(self, model_id: int) -> Mapping[int, str]:
        return self._hosts.get(model_id, {})

    def held(self, model_id: int) -> Mapping[str, float]:
        """Each peer's share of the model's requests in the heavy sessions placed on it,
        every known peer counted a candidate (the placement a loss does not move)."""
        return self._held.get(model_id, {})

    def models(self) -> Mapping[int, Mapping[int, str]]:
        """model_id -> session key -> its host."""
        return self._hosts

    def forget_except(self, model_ids: set[int]) -> None:
        for gone in self._hosts.keys() - model_ids:
            del self._hosts[gone]
        for gone in self._middling.keys() - model_ids:
            del self._middling[gone]
        for gone in self._steps.keys() - model_ids:
            del self._steps[gone]
        for gone in self._held.keys() - model_ids:
            del self._held[gone]

    def place(self, model_id: int, rates: Mapping[int, float], rps: float,
              shares: Mapping[str, float], least: float, usable: Collection[str],
              walk: Callable[[int], Iterable[str]]) -> None:
        """rates: session key -> the fleet's requests per second of it; rps: the model's
        requests per second, the whole the rates are shares of; shares: each peer's share of the ring's
        weight, every peer known to serve the model (summing to 1); least: the smallest
        peer's share before the pooling factor (candidates.ring_points), which the marks
        are parts of; usable: the candidates among them; walk(key): the ring's peers from
        the key's point.

        Placed first as if every known peer were a candidate, then, for those whose host
        is not, again among the candidates with the room the others left: a host lost
        (or draining) moves its own heavy sessions and no other's. Among the candidates
        alone, the survivors' shares grew with the loss, some sessions now fitted their
        ring owner, and a greedy placement moved 65 of 250 of the survivors' heavy
        sessions over 50 draws of the fleet bench's rates (tests/test_routing_heavy.py)."""
        if rps <= 0 or not shares or not rates:
            self._hosts.pop(model_id, None)
            self._middling.pop(model_id, None)
            self._steps.pop(model_id, None)
            self._held.pop(model_id, None)
            return
        steps = self._steps.get(model_id, {})
        # A share above 1 is a peer's error or a lie: it weighs as the whole model.
        heavy = {key: quantized_from(min(1.0, rate / rps), steps.get(key)) for key, rate in rates.items()
                 if rate / rps >= (LEAVE if key in steps else ENTER) * least}
        order = _busiest(heavy)
        self._steps[model_id] = {key: heavy[key] for key in order}
        was_middling = self._middling.get(model_id, set())
        middling = {key: rate for key, rate in rates.items() if key not in heavy and rate / rps
                    >= (MIDDLING_LEAVE if key in was_middling else MIDDLING) * least}
        self._middling[model_id] = set(_busiest(middling))
        held = dict.fromkeys(shares, 0.0)
        hosts = {key: node for key in order if (node := _fit(key, heavy[key], shares, held, walk)) is not None}
        self._held[model_id] = {node: share for node, share in held.items() if share > 0}
        for key in order:
            if key in hosts and hosts[key] not in usable:
                held[hosts.pop(key)] -= heavy[key]
        for key in order:
            if key not in hosts and (node := _fit(key, heavy[key], shares, held, walk, usable)) is not None:
                hosts[key] = node
        self._hosts[model_id] = hosts


def _busiest(rates: Mapping[int, float]) -> list[int]:
    """The MAX_HEAVY busiest session keys, busiest first (ties by key: alike everywhere)."""
    return sorted(rates, key=lambda k: (-rates[k], k))[:MAX_HEAVY]


def _fit(key: int, share: float, shares: Mapping[str, float], held: dict[str, float],
         walk: Callable[[int], Iterable[str]], among: Collection[str] | None = None) -> str | None:
    """The first of the first MAX_WALK peers along the key's walk whose heavy sessions,
    with this one, stay within ROOM of its share and of which this one alone is at most
    ALONE, else the one of them with the most room left (the first such); counted into
    `held`."""
    roomiest: str | None = None
    for node in itertools.islice(walk(key), MAX_WALK):
        if node not in shares or (among is not None and node not in among):
            continue
        left = ROOM * shares[node] - held[node]
        if share <= min(left, ALONE * shares[node]):
            roomiest = node
            break
        if roomiest is None or left > ROOM * shares[roomiest] - held[roomiest]:
            roomiest = node
    if roomiest is not None:
        held[roomiest] += share
    return roomiest
