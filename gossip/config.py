"""Gossip parameters: every timer, size and bound of the mesh, with its default.

The defaults were chosen with the simulator (scripts/bench_gossip.py, docs/gossip.md
explains each choice with the figures). Timers are milliseconds of the monotonic clock.
The fields made with `setting` are the operator's `[gossip]` keys (daemon/config.py); the
others are tuning set only in code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from loadmesh.settings import SettingError, between, check_settings, setting

# The probes' delivery (gossip/probes.py, Delivery) above which nothing is taken as lost.
_KNOWN_DELIVERY = 0.95


@dataclass(frozen=True)
class GossipParams:
    # Rounds: every interval_ms (each period drawn in interval_ms * (1 +- jitter), so that
    # nodes started together do not stay in step), to `fanout` random live peers.
    interval_ms: int = setting(500, between(10, 60_000), "gossip round period")
    jitter: float = 0.1
    fanout: int = setting(3, between(1, 64), "peers contacted each round")
    # Compound datagrams never exceed this; 1400 leaves room for IP/UDP headers and a
    # tunnel under a 1500-byte MTU. Must be the same on every node: a receiver drops larger.
    max_datagram: int = setting(1400, between(512, 65_507),
                                "largest datagram sent or accepted, the same on every node")
    # A round datagram carries announcements, each sent at most
    # retransmit_mult * ceil(log10(N + 1)) times by each node (memberlist's limit), more
    # under loss (retransmit_limit).
    retransmit_mult: int = 3
    # ... and no more once this many contacts have shown they hold it already (Demers'
    # feedback and counter; 0: never stopped early), where nothing is lost (known_limit).
    known_stop: int = 4
    # A round may send a peer several compound datagrams when the queue holds more than
    # one: at 1000 nodes one datagram per peer cannot carry the announcements (docs).
    max_datagrams_per_peer: int = 4
    # SWIM failure detection (gossip/probes.py): each period a node pings one peer; no ack
    # within probe_timeout_ms, it asks indirect_checks others to ping it; no answer by the
    # period's end, the peer is suspect. Both are stretched by local health (x1 to x9).
    probe_interval_ms: int = setting(500, between(50, 60_000), "SWIM protocol period: one peer probed")
    probe_timeout_ms: int = setting(200, between(10, 30_000),
                                    "a probe unanswered this long is retried through other peers")
    indirect_checks: int = 3
    health_max: int = 8
    # A suspect has suspicion_mult * max(1, log10 N) * probe_interval (never less than
    # suspicion_min_ms) to refute once corroborated by suspicion_confirmations more
    # accusers, up to suspicion_max_mult times that while a single accuser speaks.
    suspicion_mult: float = 2.5
    suspicion_max_mult: int = 6
    suspicion_confirmations: int = 1
    suspicion_min_ms: int = setting(2500, between(100, 3_600_000),
                                    "the least time a suspect peer has to refute before it is dead")
    # A tick this much later than the core asked for means this node was stalled: its
    # own timers are pushed back by the stall instead of judging peers by it.
    stall_ms: int = 250
    reap_after_ms: int = setting(600_000, between(1000, 86_400_000), "... and forgotten")
    # An urgent snapshot is relayed at once, on first receipt, to this many peers; at
    # most urgent_relays_per_s of them (a burst of twice that), so that a fleet starting
    # at once (every first snapshot is urgent) does not flood: beyond it, the rounds
    # carry them.
    urgent_fanout: int = 8
    urgent_relays_per_s: float = 20.0
    # A pull unanswered after pull_timeout_ms is sent again, up to pull_retries times.
    pull_timeout_ms: int = 100
    pull_retries: int = 2
    # Full-state exchange with a random peer (memberlist's push-pull), scaled with the
    # mesh like memberlist does above 32 nodes; and with a random dead peer, so that the
    # two sides of a healed partition find each other again.
    push_pull_interval_ms: int = 30_000
    dead_sync_interval_ms: int = 10_000
    join_retry_ms: int = 2_000
    # Bounds on what peers can make this node hold or do (membership.py: which peer gives
    # way when the table is full). Bytes are of snapshot encodings, each peer's and the
    # one before it; decoded, a snapshot takes up to ~20x its encoding in memory, so the
    # default holds the table under ~100 MB whatever peers send (a 4-GPU, 2-model snapshot
    # is ~220 bytes; 16 GPUs and 64 models ~2-8 KB).
    max_peers: int = setting(4096, between(1, 1_000_000), "bound of the peer table")
    max_table_bytes: int = setting(2 << 20, between(64 << 10, 1 << 30),
                                   "bound of the peers' snapshot encodings held")
    anchors_per_source: int = 8
    rate_per_source: float = 500.0
    rate_burst: float = 1000.0
    max_sources: int = 16_384
    # How far the mesh's wall clocks may disagree. A snapshot stamped further in the
    # future than this (by the receiver's clock) is dropped: it would shadow its owner's
    # real updates; so is a version above the receiver's clock in ms plus this (versions
    # are seeded from the owner's clock and move by one a change), and a datagram whose
    # seq is further than this from the receiver's clock either way (a replay).
    max_clock_skew_ms: int = 30_000
    # The secret behind the address tokens rotates this often; a token stays good for
    # one to two periods (gossip/cookies.py).
    cookie_epoch_ms: int = 60_000

    def __post_init__(self) -> None:
        # The class's own fields: the agent's GossipConfig adds addresses and paths.
        for f in fields(GossipParams):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SettingError(f.name, f"expected a number, got {value!r}")
            if value < 0 or (isinstance(value, float) and not math.isfinite(value)):
                raise SettingError(f.name, f"must be a finite number >= 0, got {value!r}")
        check_settings(self)
        if not 0 <= self.jitter < 1:
            raise SettingError("jitter", f"must be in [0, 1), got {self.jitter}")
        for name in ("retransmit_mult", "max_datagrams_per_peer", "pull_timeout_ms",
                     "push_pull_interval_ms", "dead_sync_interval_ms", "join_retry_ms",
                     "anchors_per_source", "rate_per_source", "rate_burst", "max_sources",
                     "urgent_relays_per_s", "indirect_checks", "suspicion_mult", "suspicion_confirmations",
                     "suspicion_max_mult", "stall_ms", "cookie_epoch_ms", "max_clock_skew_ms"):
            if getattr(self, name) <= 0:
                raise SettingError(name, "must be positive")
        # The indirect probes need time within the period: ping-req, ping, ack, ack.
        if self.probe_timeout_ms * 2 > self.probe_interval_ms:
            raise SettingError("probe_timeout_ms", f"{self.probe_timeout_ms} must be at most half of "
                               f"probe_interval_ms ({self.probe_interval_ms}): the indirect probes "
                               f"need the rest of the period")
        if self.suspicion_min_ms >= self.reap_after_ms:
            raise SettingError("suspicion_min_ms", f"{self.suspicion_min_ms} must be below "
                               f"reap_after_ms ({self.reap_after_ms})")

    def retransmit_limit(self, nodes: int, delivery: float = 1.0) -> int:
        """How many times a node sends one announcement: memberlist's
        RetransmitMult * ceil(log10(N + 1)), over the share of datagrams that arrive
        (the square root of `delivery`, the probes' round trips: gossip/probes.py), at
        most twice that. A node misses every copy of a version with probability about
        e**-(the copies that reach it): under loss, as many copies reach it as without."""
        base = self.retransmit_mult * max(1, math.ceil(math.log10(nodes + 1)))
        return math.ceil(base / math.sqrt(min(1.0, max(delivery, 0.25))) - 1e-9)

    def known_limit(self, delivery: float = 1.0) -> int:
        """After how many contacts that held a version already a node stops announcing
        it (0: never): known_stop while the probes' round trips all but all complete
        (`delivery`). Under loss the counter cut no bytes and stretched the convergence
        tail (100 nodes, 20% loss, 5 killed, seeds 1-3: p99 4.5, 5.2, 3.0 s against 3.6,
        2.0, 2.4 s, even waiting for five contacts), so there the whole retransmit limit
        goes, as before."""
        return self.known_stop if delivery >= _KNOWN_DELIVERY else 0

    def suspicion_ms(self, nodes: int) -> tuple[int, int, int]:
        """The shortest and longest time a suspect has to refute in a mesh of `nodes`,
        and how many accusers corroborate a suspicion (memberlist's suspicionTimeout,
        with a floor). The log grows the time a rumour takes to reach everyone."""
        shortest = max(self.suspicion_min_ms,
                       int(self.suspicion_mult * max(1.0, math.log10(max(nodes, 1))) * self.probe_interval_ms))
        expected = self.suspicion_confirmations
        if nodes - 2 < expected:
            expected = 0
        return shortest, shortest * self.suspicion_max_mult, expected

    def push_pull_ms(self, nodes: int) -> int:
        """memberlist's pushPullScale: one more base interval each time N doubles past 32."""
        if nodes <= 32:
            return self.push_pull_interval_ms
        return self.push_pull_interval_ms * (math.ceil(math.log2(nodes) - 5) + 1)
