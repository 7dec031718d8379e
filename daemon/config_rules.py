"""The rules that tie keys of the configuration together, in one place.

A section's dataclass checks each of its keys, and the few of its own keys that only make
sense together (probe_timeout_ms <= probe_interval_ms / 2, degraded_at < overloaded_at). What
depends on keys of several sections, or on the gossip's internal timing, is checked
here, on the whole configuration; each broken rule names both keys, and the loader adds
the file.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadmesh.daemon.config import Config, GossipConfig

# (the key to blame, the problem, which names the other key)
Broken = tuple[str, str]


def _spread_ms(gossip: GossipConfig) -> int:
    """How long a new version takes to reach every node, with a margin: four rounds (the
    simulator's convergence p99 is under three at 100 and 1000 nodes, docs/gossip.md),
    each up to interval_ms * (1 + jitter), then a pull and its retries."""
    return 4 * int(gossip.interval_ms * (1 + gossip.jitter)) + gossip.pull_timeout_ms * (1 + gossip.pull_retries)


def _heartbeat_within_freshness(config: Config) -> Broken | None:
    # While its figures stay within their deadbands, a peer's snapshot is renewed only by
    # the heartbeat version: made at the first tick after heartbeat_ms, it reaches this
    # node by gossip. A freshness window shorter than the sum calls a healthy, quiet peer
    # stale and routes to it only when nothing fresh is left. The defaults: 5000 + 250 +
    # 2200 + 300 ms = 7.75 s against 15 s.
    load, g = config.load, config.gossip
    spread = _spread_ms(g)
    oldest_ms = load.heartbeat_ms + load.tick_ms + spread
    freshness = config.routing.freshness_s
    if freshness * 1000 >= oldest_ms:
        return None
    return ("routing.freshness_s",
            f"{freshness:g} s is shorter than a quiet peer's snapshot gets before its next "
            f"one arrives: load.heartbeat_ms = {load.heartbeat_ms}, plus load.tick_ms = "
            f"{load.tick_ms}, plus {spread} ms to reach this node by gossip = "
            f"{oldest_ms / 1000:g} s; healthy peers would count as stale: need freshness_s of "
            f"at least {oldest_ms / 1000:g} or a shorter load.heartbeat_ms")


def _heartbeat_after_tick(config: Config) -> Broken | None:
    # The heartbeat is checked when a snapshot is built, once a tick: a shorter heartbeat
    # cannot move the version that often, and makes every tick a new version.
    load = config.load
    if load.heartbeat_ms >= load.tick_ms:
        return None
    return ("load.heartbeat_ms",
            f"{load.heartbeat_ms} ms is shorter than load.tick_ms = {load.tick_ms}: the "
            f"heartbeat is checked once a tick; need heartbeat_ms of at least tick_ms")


_RULES: tuple[Callable[[Config], Broken | None], ...] = (_heartbeat_within_freshness, _heartbeat_after_tick)


def broken(config: Config) -> Broken | None:
    """The first rule the configuration breaks, as (key, problem); None if none."""
    for rule in _RULES:
        found = rule(config)
        if found:
            return found
    return None
