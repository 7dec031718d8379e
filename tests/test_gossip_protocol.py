"""The protocol core, several nodes driven in-process over a fake network."""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loadmesh.gossip import wire
from loadmesh.gossip.config import GossipParams
from loadmesh.gossip.keyring import Keyring
from loadmesh.gossip.membership import Addr, PeerState
from loadmesh.gossip.protocol import GossipCore, Outgoing
from loadmesh.gossip.snapshot import Endpoint, HostLoad, LoadSnapshot, NodeState, encode
from loadmesh.gossip.wire import Kind

WALL = 1_764_000_000_000
KEY_A = bytes(range(32))
KEY_B = bytes(range(1, 33))
FAST = GossipParams(interval_ms=100, probe_interval_ms=200, probe_timeout_ms=50, suspicion_min_ms=600,
                    reap_after_ms=60_000, dead_sync_interval_ms=1000, push_pull_interval_ms=5000,
                    join_retry_ms=500)
# The longest a dead node of a small FAST mesh takes to be dead everywhere: a few periods
# until a probe of it fails, then a lone accuser's longest suspicion.
FAST_DETECTION_MS = 5 * FAST.probe_interval_ms + FAST.suspicion_min_ms * FAST.suspicion_max_mult


_SEQ = itertools.count(1)


def forge(to: GossipCore, kind: Kind, sender: int, body: bytes, src: Addr, now: int,
          keyring: Keyring | None = None, flags: int = 0) -> bytes:
    """A datagram that `to` acts on from `src` at `now`: a fresh seq, and the echo of the
    token `to` gives that address (what a sender that receives there would hold)."""
    return wire.seal(kind, sender, body, keyring, flags, seq=(now + WALL) * 1000 + next(_SEQ) % 1000,
                     echo=to.cookies.token(src, now))


def snap(node: str, version: int, now: int = 0, state: NodeState = NodeState.OK, score: float = 0.5) -> LoadSnapshot:
    return LoadSnapshot(node_id=node, endpoints=(Endpoint("10.9.9.9", 8000),), version=version,
                        timestamp_ms=WALL + now, state=state, score=score,
                        host=HostLoad(score, 1000, 2000, 1.5, None), gpus=(), models=())


class Mesh:
    """Cores on an in-process network: fixed latency, links that can be cut, nodes that
    can be stopped. Time moves only in run(), from event to event."""

    def __init__(self, latency: int = 1) -> None:
        self.latency = latency
        self.now = 0
        self.cores: dict[Addr, GossipCore] = {}
        self.down: set[Addr] = set()
        # Stalled nodes: not run (no ticks, nothing read) while their datagrams wait.
        self.paused: set[Addr] = set()
        self.cut: set[frozenset[Addr]] = set()
        self.heap: list[tuple[int, int, Addr, Addr, bytes]] = []
        self.seq = 0
        self.delivered = 0

    def add(self, node_id: str, params: GossipParams = FAST, keyring: Keyring | None = None,
            addr: Addr | None = None) -> GossipCore:
        addr = addr or (f"10.0.0.{len(self.cores) + 1}", 7946)
        core = GossipCore(node_id, addr, params, keyring, rng=random.Random(len(self.cores)), wall_offset_ms=WALL)
        self.cores[addr] = core
        self.down.discard(addr)
        return core

    def send(self, src: Addr, out: Outgoing) -> None:
        for dst, data in out:
            if src in self.down or dst in self.down or frozenset((src, dst)) in self.cut:
                continue
            self.seq += 1
            heapq.heappush(self.heap, (self.now + self.latency, self.seq, src, dst, data))

    def publish(self, core: GossipCore, snapshot: LoadSnapshot, urgent: bool = False) -> None:
        self.send(core.advertise, core.publish(snapshot, urgent, self.now))

    def join(self, core: GossipCore, *seeds: GossipCore) -> None:
        self.send(core.advertise, core.join([s.advertise for s in seeds], self.now))

    def run(self, duration: int) -> None:
        until = self.now + duration
        held: list[tuple[int, int, Addr, Addr, bytes]] = []
        while True:
            event = self.heap[0][0] if self.heap else math.inf
            live = [(c.next_deadline(), a) for a, c in self.cores.items()
                    if a not in self.down and a not in self.paused]
            tick, addr = min(live) if live else (math.inf, None)
            t = min(event, tick)
            if t > until:
                break
            self.now = max(self.now, t)
            if event <= tick:
                item = heapq.heappop(self.heap)
                _, _, src, dst, data = item
                if dst in self.paused:
                    held.append(item)  # in its socket, unread
                elif dst in self.cores and dst not in self.down:
                    self.delivered += 1
                    self.send(dst, self.cores[dst].on_datagram(data, src, self.now))
            else:
                self.send(addr, self.cores[addr].on_tick(self.now))
        for item in held:
            heapq.heappush(self.heap, item)
        self.now = until

    def run_until(self, check: Callable[[], bool], limit: int, step: int = 50) -> int:
        """Runs until check() holds; the time it took (ms). Fails past `limit` ms."""
        start = self.now
        while not check():
            assert self.now - start < limit, f"not within {limit} ms"
            self.run(step)
        return self.now - start

    def versions(self, node: str) -> dict[str, int | None]:
        """What each running node holds of `node`'s snapshot."""
        out = {}
        for addr, core in self.cores.items():
            if addr not in self.down and core.node_id != node:
                view = core.snapshots(self.now).get(node)
                out[core.node_id] = view.snapshot.version if view else None
        return out

    def state_of(self, node: str) -> dict[str, str | None]:
        out = {}
        for addr, core in self.cores.items():
            if addr not in self.down and core.node_id != node:
                rows = [p.state.value for p in core.peers(self.now) if p.node_id == node]
                out[core.node_id] = rows[0] if rows else None
        return out


def mesh_of(n: int, params: GossipParams = FAST, keyring: Keyring | None = None) -> tuple[Mesh, list[GossipCore]]:
    mesh = Mesh()
    cores = [mesh.add(f"node-{i}", params, keyring) for i in range(n)]
    for i, core in enumerate(cores):
        mesh.publish(core, snap(core.node_id, 100 + i))
        if i:
            mesh.join(core, cores[0])
    mesh.run(3000)
    return mesh, cores


def total(core: GossipCore, prefix: str) -> int:
    return sum(v for k, v in core.counters().items() if k.startswith(prefix))


# --- joining and converging -----------------------------------------------------------------

def test_join_through_one_seed_and_converge() -> None:
    mesh, cores = mesh_of(8)
    for core in cores:
        assert set(core.snapshots(mesh.now)) == {c.node_id for c in cores}
        assert all(p.state is PeerState.ALIVE for p in core.peers(mesh.now))
    mesh.publish(cores[5], snap("node-5", 200, mesh.now, score=0.9))
    mesh.run(2000)
    assert set(mesh.versions("node-5").values()) == {200}
    assert all(c.snapshots(mesh.now)["node-5"].snapshot.score == 0.9 for c in cores)


def test_new_versions_travel_as_deltas_to_holders_of_the_previous_one() -> None:
    mesh, cores = mesh_of(5)
    mesh.publish(cores[1], snap("node-1", 300, mesh.now, score=0.7))
    mesh.run(2000)
    deltas = [c.table.get(cores[1].key).delta for c in cores if c is not cores[1]]
    assert all(d is not None for d in deltas)
    # A node that never held the previous version gets the full snapshot.
    late = mesh.add("late")
    mesh.join(late, cores[0])
    mesh.run(1000)
    assert late.table.get(cores[1].key).snapshot.version == 300
    assert late.table.get(cores[1].key).delta is None


def test_a_push_pull_reply_carries_the_repliers_pulls_and_the_contact_answers_them() -> None:
    mesh, cores = mesh_of(6)
    sent: list[tuple[Addr, Addr, wire.Datagram]] = []
    send = mesh.send

    def recording(src: Addr, out: Outgoing) -> None:
        sent.extend((src, dst, wire.open_datagram(data, None, 1400)) for dst, data in out)
        send(src, out)

    mesh.send = recording  # type: ignore[method-assign]
    for round_ in range(1, 6):
        for i, core in enumerate(cores):
            mesh.publish(core, snap(core.node_id, 200 + 10 * round_ + i, mesh.now, score=round_ / 10))
        mesh.run(600)
    mesh.run(2000)
    for i, core in enumerate(cores):
        assert set(mesh.versions(core.node_id).values()) == {250 + i}
    replies = [i for i, (_, _, dg) in enumerate(sent) if dg.kind is Kind.GOSSIP and dg.flags & wire.FLAG_WANTS]
    assert replies, "no reply carried a pull"
    for i in replies:
        replier, contact, dg = sent[i]
        assert not dg.flags & wire.FLAG_REPLY  # only replies carry wants
        entries, asked = wire.split_gossip(dg.body, dg.flags)
        full, short = wire.unpack_wants(asked)
        assert short and not full  # versions one behind: 8 bytes each
        assert wire.unpack_entries(entries)[1], "the reply's own news went with it"
        # the contact answers the pulls with content, as it answers a pull
        assert any(src == contact and dst == replier and later.kind is Kind.CONTENT
                   for src, dst, later in sent[i + 1:])


def test_peers_lists_every_node_self_first() -> None:
    mesh, cores = mesh_of(3)
    rows = cores[0].peers(mesh.now)
    assert rows[0].node_id == "node-0" and rows[0].addr == ("10.0.0.1", 7946)
    for row in rows:
        assert row.state is PeerState.ALIVE
    # Each peer fresh from its own datagrams (probes and their acks, a few periods apart);
    # this node's own row is as old as its version.
    assert all(0 <= row.age_ms <= 5 * FAST.probe_interval_ms for row in rows[1:])
    assert {r.node_id: r.version for r in rows} == {"node-0": 100, "node-1": 101, "node-2": 102}


def test_a_reader_of_the_table_gets_what_changed_since_it_last_read() -> None:
    mesh, cores = mesh_of(3, replace(FAST, reap_after_ms=1000))
    reader = cores[0]
    mark, views, complete = reader.snapshots_since(None, mesh.now)
    assert complete and set(views) == {"node-0", "node-1", "node-2"}
    assert reader.snapshots_since(mark, mesh.now) == (mark, {}, False)
    mesh.publish(reader, snap("node-0", 200, mesh.now))  # its own
    mark, views, complete = reader.snapshots_since(mark, mesh.now)
    assert (set(views), complete) == ({"node-0"}, False) and views["node-0"].snapshot.version == 200
    mesh.publish(cores[1], snap("node-1", 201, mesh.now), urgent=True)  # a peer's, pushed at once
    mesh.run(100)
    mark, views, complete = reader.snapshots_since(mark, mesh.now)
    assert not complete and views["node-1"].snapshot.version == 201
    assert views["node-1"] == reader.snapshots(mesh.now)["node-1"]
    # A node forgotten (dead, then reaped) is in no view: the next answer is every view.
    mesh.down.add(cores[2].advertise)
    mesh.run_until(lambda: "node-2" not in reader.snapshots(mesh.now), FAST_DETECTION_MS + 2000)
    mark, views, complete = reader.snapshots_since(mark, mesh.now)
    assert complete and set(views) == {"node-0", "node-1"}


# --- failure detection --------------------------------------------------------------------

def test_dead_peer_detected_then_restart_rejoins_with_a_higher_version() -> None:
    mesh, cores = mesh_of(6)
    mesh.down.add(cores[3].advertise)
    mesh.run_until(lambda: "suspect" in mesh.state_of("node-3").values(), 10 * FAST.probe_interval_ms)
    mesh.run_until(lambda: set(mesh.state_of("node-3").values()) == {"dead"}, FAST_DETECTION_MS)
    views = cores[0].snapshots(mesh.now)
    assert views["node-3"].state is PeerState.DEAD
    assert sum(total(c, "deaths_declared") for c in cores) >= 1
    assert all(total(c, "became_dead") == 1 for c in cores if c is not cores[3])
    # The same node id comes back, its version clock ahead of what it published before.
    reborn = mesh.add("node-3", addr=cores[3].advertise)
    mesh.publish(reborn, snap("node-3", 5000, mesh.now), urgent=True)
    mesh.join(reborn, cores[0])
    mesh.run_until(lambda: set(mesh.state_of("node-3").values()) == {"alive"}, 1500)
    mesh.run(500)
    assert set(mesh.versions("node-3").values()) == {5000}
    assert set(reborn.snapshots(mesh.now)) == {c.node_id for c in cores}


def test_a_peer_unreachable_from_one_node_is_reached_through_others() -> None:
    mesh, cores = mesh_of(5)
    prober, target = cores[0], cores[1]
    mesh.cut = {frozenset((prober.advertise, target.advertise))}
    mesh.run(20 * FAST.probe_interval_ms)  # the prober's pass reaches the target several times
    assert mesh.state_of("node-1")["node-0"] == "alive"
    assert total(prober, "ping_reqs_sent") > 0
    assert all(total(c, "became_suspect") == 0 for c in cores)


def test_liveness_is_one_ping_and_one_ack_per_node_and_period() -> None:
    mesh, cores = mesh_of(7)
    before = [(c.counters()["pings_sent"], c.counters()["acks_sent"]) for c in cores]
    periods = 20
    mesh.run(periods * FAST.probe_interval_ms)
    for core, (pings, acks) in zip(cores, before):
        assert core.counters()["pings_sent"] - pings in (periods - 1, periods, periods + 1)
        assert core.counters()["ping_reqs_sent"] == 0
    sent = sum(c.counters()["acks_sent"] for c in cores) - sum(a for _, a in before)
    assert periods * 7 - 7 <= sent <= periods * 7 + 7  # every ping answered, once


def test_a_live_suspect_refutes_and_is_never_declared_dead() -> None:
    mesh, cores = mesh_of(4)
    accuser, suspect, witness = cores[0], cores[1], cores[2]
    inc = witness.table.get(suspect.key).incarnation
    # The accuser says it failed to reach the suspect (its own failed probe, on the wire).
    entry = wire.pack_entries([(suspect.key, suspect._own.version, inc | wire.STATUS_ACCUSED << wire.STATUS_SHIFT)])
    witness.on_datagram(forge(witness, Kind.GOSSIP, accuser.key, entry, accuser.advertise, mesh.now),
                        accuser.advertise, mesh.now)
    assert witness.table.get(suspect.key).state is PeerState.SUSPECT
    mesh.run_until(lambda: witness.table.get(suspect.key).state is PeerState.ALIVE, 10 * FAST.probe_interval_ms)
    assert total(suspect, "refutations") >= 1
    assert witness.table.get(suspect.key).incarnation > inc
    mesh.run(FAST_DETECTION_MS)
    assert all(total(c, "became_dead") == 0 for c in cores)
    assert set(mesh.state_of("node-1").values()) == {"alive"}


def test_a_refutation_heard_where_the_node_was_alive_is_passed_on_in_full() -> None:
    mesh, cores = mesh_of(4)
    refuter, witness, teller = cores[1], cores[2], cores[3]
    peer = witness.table.get(refuter.key)
    assert peer.state is PeerState.ALIVE
    inc = peer.incarnation + 1
    while witness.queue.take(1400):
        pass  # what the witness had queued, sent
    entry = wire.pack_entries([(refuter.key, peer.version, inc)])
    witness.on_datagram(forge(witness, Kind.GOSSIP, teller.key, entry, teller.advertise, mesh.now),
                        teller.advertise, mesh.now)
    # Versions go short, without the incarnation: a node that missed the refutation
    # could otherwise declare the refuter dead under the incarnation it replaced.
    assert (refuter.key, peer.snapshot.version, inc) in witness.queue.take(1400)


def test_a_newer_version_relayed_does_not_revive_a_dead_peer_its_own_word_does() -> None:
    mesh, cores = mesh_of(4)
    victim, watcher, relay = cores[1], cores[2], cores[3]
    mesh.down.add(victim.advertise)
    mesh.run_until(lambda: watcher.snapshots(mesh.now)["node-1"].state is PeerState.DEAD, FAST_DETECTION_MS)
    # A third node announces a version of the victim published before it died.
    peer = watcher.table.get(victim.key)
    entry = wire.pack_entries([(victim.key, peer.version + 1, peer.incarnation)])
    watcher.on_datagram(forge(watcher, Kind.GOSSIP, relay.key, entry, relay.advertise, mesh.now),
                        relay.advertise, mesh.now)
    assert watcher.snapshots(mesh.now)["node-1"].state is PeerState.DEAD
    short = wire.pack_entries([(victim.key, peer.version + 2, wire.VERSION_ONLY)])
    watcher.on_datagram(forge(watcher, Kind.GOSSIP, relay.key, short, relay.advertise, mesh.now),
                        relay.advertise, mesh.now)
    assert watcher.snapshots(mesh.now)["node-1"].state is PeerState.DEAD
    # The victim's own datagram is proof of life.
    entry = wire.pack_entries([(victim.key, peer.version, peer.incarnation)])
    watcher.on_datagram(forge(watcher, Kind.GOSSIP, victim.key, entry, victim.advertise, mesh.now),
                        victim.advertise, mesh.now)
    assert watcher.snapshots(mesh.now)["node-1"].state is PeerState.ALIVE


def test_a_node_stalled_for_two_seconds_is_declared_dead_by_no_one() -> None:
    params = GossipParams(interval_ms=100)  # SWIM's timers at their defaults
    mesh, cores = mesh_of(5, params)
    stalled = cores[2]
    mesh.paused.add(stalled.advertise)
    mesh.run(2000)
    assert "suspect" in mesh.state_of("node-2").values()  # it did not answer: suspected
    mesh.paused.discard(stalled.advertise)
    mesh.run(5 * params.suspicion_min_ms)
    assert all(total(c, "became_dead") == 0 for c in cores)
    assert set(mesh.state_of("node-2").values()) == {"alive"}
    # The stalled node judged no one by the time it did not see.
    assert stalled.counters()["stalls"] == 1 and total(stalled, "became_suspect") == 0
    # A real death, with the same timers, is still found.
    mesh.down.add(cores[3].advertise)
    mesh.run_until(lambda: set(mesh.state_of("node-3").values()) == {"dead"},
                   10 * params.probe_interval_ms + params.suspicion_min_ms * params.suspicion_max_mult)


def test_partition_heals_by_itself() -> None:
    mesh, cores = mesh_of(6)
    left, right = cores[:3], cores[3:]
    mesh.cut = {frozenset((a.advertise, b.advertise)) for a in left for b in right}
    mesh.run_until(lambda: mesh.state_of("node-4")["node-0"] == mesh.state_of("node-0")["node-4"] == "dead",
                   2 * FAST_DETECTION_MS)
    mesh.cut = set()
    mesh.run(2 * FAST.dead_sync_interval_ms + 500)
    for core in cores:
        assert all(p.state is PeerState.ALIVE for p in core.peers(mesh.now)), core.node_id


# --- urgent versions ---------------------------------------------------------------------------

def test_urgent_version_reaches_everyone_before_any_round() -> None:
    slow = replace(FAST, interval_ms=60_000, probe_interval_ms=60_000, reap_after_ms=300_000,
                   push_pull_interval_ms=100_000, dead_sync_interval_ms=100_000)
    mesh = Mesh()
    cores = []
    for i in range(10):  # without rounds, each node joins through all the others
        cores.append(mesh.add(f"node-{i}", slow))
        mesh.publish(cores[i], snap(f"node-{i}", 100))
        if i:
            mesh.join(cores[i], *cores[:i])
        mesh.run(20)
    assert all(len(c.table) == 9 for c in cores)
    mesh.publish(cores[0], snap("node-0", 500, mesh.now, state=NodeState.DRAINING), urgent=True)
    mesh.run(30)  # 30 ms, a few hops, no round
    assert set(mesh.versions("node-0").values()) == {500}
    # An ordinary version is pushed to `fanout` peers at once and waits for rounds.
    mesh.publish(cores[1], snap("node-1", 600, mesh.now))
    mesh.run(30)
    held = list(mesh.versions("node-1").values())
    assert held.count(600) == slow.fanout


# --- security and hostile input -----------------------------------------------------------------

def test_wrong_key_is_rejected_both_ways() -> None:
    mesh, cores = mesh_of(4, keyring=Keyring([KEY_A]))
    intruder = mesh.add("intruder", keyring=Keyring([KEY_B]))
    mesh.publish(intruder, snap("intruder", 1, mesh.now))
    mesh.join(intruder, cores[0])
    mesh.join(cores[1], intruder)  # and a member that tries to join it
    mesh.run(3000)
    assert all("intruder" not in c.snapshots(mesh.now) for c in cores)
    assert total(cores[0], "drop_bad_signature") > 0
    assert set(intruder.snapshots(mesh.now)) == {"intruder"}
    assert total(intruder, "drop_bad_signature") > 0


def test_key_rotation_never_splits_the_mesh() -> None:
    mesh, cores = mesh_of(4, keyring=Keyring([KEY_A]))
    version = 1000
    for ring in (Keyring([KEY_A, KEY_B]), Keyring([KEY_B, KEY_A]), Keyring([KEY_B])):
        for core in cores:  # one node at a time, with traffic in between
            core.set_keyring(ring)
            version += 1
            mesh.publish(core, snap(core.node_id, version, mesh.now))
            mesh.run(700)
    assert all(total(c, "drop_") == 0 for c in cores)
    for core in cores:
        latest = {c.node_id: c.snapshots(mesh.now)[c.node_id].snapshot.version for c in cores}
        assert {n: v.snapshot.version for n, v in core.snapshots(mesh.now).items()} == latest


def test_malformed_input_is_counted_and_dropped() -> None:
    mesh, cores = mesh_of(2, keyring=Keyring([KEY_A]))
    core, ring = cores[0], Keyring([KEY_A])
    src = ("10.7.7.7", 1)
    future = snap("ghost", 1, now=10 * 60_000)
    bad_snapshot = wire.pack_content([wire.pack_full(0, 0, src, b"\x81\xa1x\x01")], 1400)[0]
    def signed(kind: Kind, body: bytes, sender: int = 1, keyring: Keyring | None = ring) -> bytes:
        return forge(core, kind, sender, body, src, mesh.now, keyring)

    cases = {
        "drop_truncated": b"LM\x01",
        "drop_bad_magic": b"XX" + bytes(40),
        "drop_bad_version": signed(Kind.GOSSIP, b"")[:1] + b"\x07" + bytes(30),
        "drop_unsigned": signed(Kind.GOSSIP, b"", keyring=None),
        "drop_bad_signature": signed(Kind.GOSSIP, b"", keyring=Keyring([KEY_B])),
        "drop_oversized": signed(Kind.SYNC, bytes(20 * 100)),
        "drop_malformed": signed(Kind.GOSSIP, bytes(21)),
        "drop_bad_snapshot": signed(Kind.CONTENT, bad_snapshot),
        "drop_future": signed(Kind.CONTENT, wire.pack_content([wire.pack_full(0, 0, src, encode(future))], 1400)[0]),
        "drop_own_node_id": signed(Kind.GOSSIP, b"", sender=core.key),
        "drop_stale": wire.seal(Kind.GOSSIP, 1, b"", ring, seq=(mesh.now + WALL - FAST.max_clock_skew_ms - 1) * 1000,
                                echo=core.cookies.token(src, mesh.now)),
    }
    for counter, data in cases.items():
        before = core.counters().get(counter, 0)
        assert core.on_datagram(data, src, mesh.now) == []
        assert core.counters()[counter] == before + 1, counter
    assert "ghost" not in core.snapshots(mesh.now)


def _datagrams_of_a_live_mesh() -> list[bytes]:
    mesh, cores = mesh_of(5, keyring=Keyring([KEY_A]))
    captured: list[bytes] = []
    original = mesh.send

    def capture(src: Addr, out: Outgoing) -> None:
        captured.extend(d for _, d in out)
        original(src, out)

    mesh.send = capture  # type: ignore[method-assign]
    mesh.publish(cores[1], snap("node-1", 900, mesh.now, state=NodeState.OVERLOADED), urgent=True)
    mesh.publish(cores[2], snap("node-2", 900, mesh.now, score=0.8))
    late = mesh.add("late", keyring=Keyring([KEY_A]))
    mesh.join(late, cores[0])
    mesh.run(1500)
    mesh.down.add(cores[4].advertise)  # probes of it fail: ping-reqs and nacks
    mesh.run(1000)
    assert {d[wire.KIND_AT] for d in captured} == set(Kind)
    return captured


SAMPLES = _datagrams_of_a_live_mesh()


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(SAMPLES), st.lists(st.tuples(st.integers(0, 2000), st.integers(0, 255)), max_size=4),
       st.integers(0, 2000), st.booleans(), st.binary(max_size=64))
def test_mutated_datagrams_never_raise_and_are_accounted(sample: bytes, flips: list[tuple[int, int]], cut: int,
                                                          keyed: bool, tail: bytes) -> None:
    data = bytearray(sample)
    for pos, value in flips:
        if pos < len(data):
            data[pos] = value
    data = bytes(data[:cut]) + tail
    keyring = Keyring([KEY_A]) if keyed else None
    core = GossipCore("fuzzed", ("10.1.1.1", 7946), FAST, keyring, rng=random.Random(0), wall_offset_ms=WALL)
    core.publish(snap("fuzzed", 1), False, 0)
    out = core.on_datagram(data, ("10.2.2.2", 1), 10)  # must not raise, whatever the bytes
    counts = core.counters()
    assert counts["datagrams_received"] == 1
    dropped = sum(v for k, v in counts.items() if k.startswith("drop_"))
    try:
        wire.open_datagram(data, keyring, FAST.max_datagram)
    except wire.WireError:
        assert dropped == 1  # what the framing refuses is dropped, and counted once
    assert all(len(d) <= FAST.max_datagram for _, d in out)
    for view in core.snapshots(10).values():  # whatever got in is a valid snapshot
        assert view.snapshot.version >= 1


def test_flood_from_one_source_is_rate_limited() -> None:
    params = replace(FAST, rate_per_source=10, rate_burst=20)
    core = GossipCore("victim", ("10.1.1.1", 7946), params, None, rng=random.Random(0), wall_offset_ms=WALL)
    for port in range(1000):  # from as many ports: the allowance is the address's
        src = ("10.6.6.6", 4000 + port)
        core.on_datagram(forge(core, Kind.GOSSIP, 99, wire.pack_entries([(5, 5, 5)]), src, 0), src, 0)
    counts = core.counters()
    assert counts["drop_rate_limited"] == 980
    assert counts["pulls_sent"] == 1  # the 20 admitted asked once for the unknown node
    other = ("10.6.6.7", 4444)  # another source is not affected
    core.on_datagram(forge(core, Kind.GOSSIP, 99, wire.pack_entries([(5, 5, 5)]), other, 0), other, 0)
    assert counts["drop_rate_limited"] == core.counters()["drop_rate_limited"]


def test_peer_table_limit_holds() -> None:
    params = replace(FAST, max_peers=3)
    mesh = Mesh()
    cores = [mesh.add(f"node-{i}", params) for i in range(7)]
    for i, core in enumerate(cores):
        mesh.publish(core, snap(core.node_id, 10 + i))
        if i:
            mesh.join(core, cores[0])
    mesh.run(3000)
    assert all(len(c.table) <= 3 for c in cores)
    assert total(cores[0], "drop_table_full") > 0


# --- the owner's rules --------------------------------------------------------------------

def test_publish_rules() -> None:
    core = GossipCore("me", ("10.1.1.1", 7946), FAST, None, rng=random.Random(0), wall_offset_ms=WALL)
    core.publish(snap("me", 10), False, 0)
    with pytest.raises(ValueError, match="went back"):
        core.publish(snap("me", 9), False, 1)
    with pytest.raises(ValueError, match="different content"):
        core.publish(snap("me", 10, score=0.1), False, 1)
    with pytest.raises(ValueError, match="published by"):
        core.publish(snap("you", 11), False, 1)
    with pytest.raises(ValueError, match="start at 1"):
        GossipCore("z", ("h", 1), FAST).publish(snap("z", 0), False, 0)
    assert core.publish(snap("me", 10), False, 5) == []
    # The same content, stamped later: nothing to send.
    assert core.publish(snap("me", 10, now=700), False, 700) == []
    # Announced once, short (a version is not liveness news), under an incarnation of the
    # wall clock's seconds that its record carries.
    assert core.queue.take(1400) == [(core.key, 10, wire.VERSION_ONLY)]
    record = wire.unpack_content(wire.pack_content([core._record_for(core.key, 0)], 1400)[0])[0][0]
    assert record.incarnation == (WALL - wire.INCARNATION_EPOCH_MS) // 1000


# --- a hostile network ------------------------------------------------------------------------

def test_a_wedged_version_neither_kills_a_live_node_nor_outlives_its_pulls() -> None:
    mesh, cores = mesh_of(3)
    victim, watcher, liar = cores
    # Versions start at the owner's wall clock in ms, as the agent's do.
    held = WALL + mesh.now
    mesh.publish(victim, snap("node-0", held, mesh.now))
    mesh.run(500)
    assert watcher.table.get(victim.key).version == held
    ceiling = mesh.now + WALL + FAST.max_clock_skew_ms
    # The furthest ahead an announcement can say (its low 32 bits are read against the
    # version held: 2**31 - 1 changes at most), and just past the clock: both refused.
    for version in (held + 2**31 - 1, ceiling + 1):
        entry = wire.pack_entries([(victim.key, version, 0)])
        watcher.on_datagram(forge(watcher, Kind.GOSSIP, liar.key, entry, liar.advertise, mesh.now),
                            liar.advertise, mesh.now)
    assert watcher.counters()["drop_implausible"] == 2
    # Plausible, but never served: the liar's address does not answer the pulls.
    entry = wire.pack_entries([(victim.key, ceiling - 1, 0)])
    mesh.down.add(liar.advertise)
    watcher.on_datagram(forge(watcher, Kind.GOSSIP, liar.key, entry, liar.advertise, mesh.now),
                        liar.advertise, mesh.now)
    assert watcher.table.get(victim.key).version == ceiling - 1
    mesh.run(FAST_DETECTION_MS)  # the victim keeps answering probes meanwhile
    assert mesh.state_of("node-0")["node-1"] == "alive"
    assert watcher.counters()["keys_rewound"] == 1
    mesh.publish(victim, snap("node-0", held + 1, mesh.now))
    mesh.run(500)
    assert mesh.versions("node-0")["node-1"] == held + 1


def test_a_version_of_itself_above_its_own_is_reported_to_the_owner() -> None:
    mesh, cores = mesh_of(2)
    owner, other = cores
    forged = snap("node-0", WALL + mesh.now + 20_000, mesh.now)
    record = wire.pack_content([wire.pack_full(0, 0, owner.advertise, encode(forged))], 1400)[0]
    owner.on_datagram(forge(owner, Kind.CONTENT, other.key, record, other.advertise, mesh.now),
                      other.advertise, mesh.now)
    assert owner.newest_own_seen == forged.version
    beyond = snap("node-0", WALL + mesh.now + FAST.max_clock_skew_ms + 1, mesh.now)
    record = wire.pack_content([wire.pack_full(0, 0, owner.advertise, encode(beyond))], 1400)[0]
    owner.on_datagram(forge(owner, Kind.CONTENT, other.key, record, other.advertise, mesh.now),
                      other.advertise, mesh.now)
    assert owner.newest_own_seen == forged.version and owner.counters()["drop_implausible"] == 1
