"""The rules that tie keys of the configuration together, in one place.

A section's dataclass checks each of its keys, and the few of its own keys that only make
sense together (suspect_after_ms < dead_after_ms, degraded_at < overloaded_at). What
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


def _longest_beat_gap_ms(gossip: GossipConfig) -> int:
    """The longest a live peer goes without sending this node a beat, in a mesh of up to
    scale_nodes nodes.

    Beats ride the rounds (gossip/protocol.py, GossipCore._beats): a peer owed a beat gets
    it at the first round after its beat interval, and a round comes interval_ms * (1 +
    jitter) at the latest. Past scale_nodes the beats slow down faster than the failure
    timers, on purpose (GossipParams.beat_scale): there the versions and the probes carry
    liveness."""
    return gossip.beat_interval_ms + int(gossip.interval_ms * (1 + gossip.jitter))


def _beats_within_suspicion(config: Config) -> Broken | None:
    # A peer heard from neither by a beat nor by a newer version for suspect_after_ms turns
    # suspect (gossip/membership.py). Rounds so slow that the gap between beats exceeds it
    # make every live peer suspect between two beats, until a probe brings it back: with
    # interval_ms = 5000, a 2-node mesh flapped alive/suspect 24 times a minute (issue 18).
    # The defaults leave 750 ms (1500 + 550 against 2800) for the network's delay; lost
    # beats are what the probes are for.
    g = config.gossip
    gap = _longest_beat_gap_ms(g)
    if gap < g.suspect_after_ms:
        return None
    most = (g.suspect_after_ms - g.beat_interval_ms) / (1 + g.jitter)
    return ("gossip.interval_ms",
            f"{g.interval_ms} ms is too long for gossip.suspect_after_ms = {g.suspect_after_ms}: "
            f"beats go out with the rounds, so a live peer can go {gap} ms without one (the "
            f"{g.beat_interval_ms} ms beat interval, then a round up to "
            f"{gap - g.beat_interval_ms} ms later) and would turn suspect between beats; need "
            f"interval_ms below {max(0.0, most):.0f} or suspect_after_ms above {gap}")


def _heartbeat_within_freshness(config: Config) -> Broken | None:
    # While its figures stay within their deadbands, a peer's snapshot is renewed only by
    # the heartbeat version: made at the first tick after heartbeat_ms, it reaches this
    # node with the peer's next beat at the latest (a beat carries the version, and this
    # node pulls what it lacks: a pull and its retries). A freshness window shorter than
    # the sum calls a healthy, quiet peer stale and routes to it only when nothing fresh is
    # left. The defaults: 5000 + 250 + 2050 + 300 ms = 7.6 s against 15 s.
    load, g = config.load, config.gossip
    spread = _longest_beat_gap_ms(g) + g.pull_timeout_ms * (1 + g.pull_retries)
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


_RULES: tuple[Callable[[Config], Broken | None], ...] = (
    _beats_within_suspicion, _heartbeat_within_freshness, _heartbeat_after_tick)


def broken(config: Config) -> Broken | None:
    """The first rule the configuration breaks, as (key, problem); None if none."""
    for rule in _RULES:
        found = rule(config)
        if found:
            return found
    return None
