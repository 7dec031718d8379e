"""How much less than its capacity's share a host of a smaller batch should take, for its
requests to queue as the largest hosts' do.

A batch of B slots is B servers of one queue. At the same utilization a small pool queues
more than a large one: the fleet bench's hosts, each given exactly its capacity's share at
80% load, held their share of the requests in flight within 0.96-0.97 of their share of
the slots, and the 4-slot host beside 8-slot ones 1.30 (scripts/sim_occupancy.py, 300 s,
200 seeds); given 0.9 of its share, 0.99 (docs/routing.md, "What occupancy any assignment
can be held to"). The bands (shed.py) find such an excess only from evidence gathered
over tens of seconds, and a small host's queue wanders the most: on the bench it was the
worst host in most runs.

The factor is the utilization at which a pool of `slots` servers holds as many requests
per slot (in service and waiting, M/M/c: Erlang C) as a pool of `reference` servers at
DESIGN_LOAD, over DESIGN_LOAD. At 80%: 0.905 for 4 slots beside 8, the 0.9 that the
simulation found; 0.78 for 2 beside 8; 0.996 for 63 beside 128, where neither waits (1
from 64). It moves little with the load (4 beside 8: 0.95 at 50%, 0.91 at 70%, 0.93 at
90%, 0.96 at 95%), so it is one figure, from the batch alone, and a host's sessions do not
move as the fleet's load changes; at a lighter load the small host is only a little less
busy than it could be, where its queue costs nothing. Lognormal service (sigma 0.8, the
bench's tokens: a coefficient of variation near 1) queues about as the exponential does.
"""

from __future__ import annotations

import functools

DESIGN_LOAD = 0.8
_BISECTIONS = 40
# A pool of 64 slots barely waits at DESIGN_LOAD (0.996 beside 1024): 1, within a point of
# the ring's. And a reference beyond 1024 waits no less than 1024 do. So the work of a
# factor is bounded whatever batch a peer publishes (a snapshot's running count is a u32).
_POOLED_FROM = 64
_REFERENCE_CAP = 1024


def pooling_factor(slots: int, reference: int) -> float:
    """What share of its capacity's share a host of `slots` slots takes beside hosts of
    `reference` (1 where it has as many or more)."""
    if slots < 1 or slots >= min(reference, _POOLED_FROM):
        return 1.0
    return _factor(slots, min(reference, _REFERENCE_CAP))


@functools.lru_cache(maxsize=4096)
def _factor(slots: int, reference: int) -> float:
    target = _target(reference)
    low, high = 0.0, DESIGN_LOAD
    for _ in range(_BISECTIONS):
        mid = (low + high) / 2
        if _per_slot(slots, mid) < target:
            low = mid
        else:
            high = mid
    return low / DESIGN_LOAD


@functools.lru_cache(maxsize=1024)
def _target(reference: int) -> float:
    return _per_slot(reference, DESIGN_LOAD)


def _per_slot(servers: int, utilization: float) -> float:
    """Requests in service and waiting per server of an M/M/c queue."""
    offered = servers * utilization
    # Erlang B by its recurrence (no factorials: batches run to hundreds), then C from it.
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = offered * blocking / (k + offered * blocking)
    waiting = servers * blocking / (servers - offered * (1 - blocking))
    return utilization + waiting * utilization / (1 - utilization) / servers
