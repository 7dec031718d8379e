"""The gossip port under attack, against real agents over real UDP (issue 15, items 1-3):
reflection off forged sources, replayed datagrams, version wedges, floods from many ports.

Agents listen on 127.0.0.1; attackers send from other loopback addresses (127.0.0.2...),
as they would from other hosts, so that the per-address allowance they exhaust is theirs.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import agent_config
from loadmesh.daemon.client import Client
from loadmesh.gossip import wire
from loadmesh.gossip.keyring import Keyring
from loadmesh.gossip.membership import Addr
from loadmesh.gossip.snapshot import (MAX_GPUS, MAX_MODELS, Endpoint, GpuLoad, HostLoad, LoadSnapshot, ModelLoad,
                             NodeState, encode)
from loadmesh.gossip.wire import Kind
from gossip_peer import RawPeer, hostile_asks, routine
from metrics_helpers import wait_for
from nettopo import memory_mib

KEY = secrets.token_bytes(32)
FORGED = 300
# Forged peers never answer a probe: suspect, but alive for the test's length.
SLOW_TIMERS = "suspicion_min_ms = 60000\nreap_after_ms = 120000\n"


def udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


def snapshot(node_id: str, version: int) -> LoadSnapshot:
    return LoadSnapshot(node_id=node_id, endpoints=(Endpoint("127.0.0.1", 8000),), version=version,
                        timestamp_ms=wall_ms(), state=NodeState.OK, score=0.5,
                        host=HostLoad(0.5, 1000, 2000, 1.5, None), gpus=(), models=())


# The agent answers its API from the loop that is draining a flood: on a busy machine that
# takes longer than the CLI's 2 s.
API_TIMEOUT_S = 10.0


class Target:
    """One agent and the ways a test looks at it."""

    def __init__(self, sock: str, port: int) -> None:
        self.sock = sock
        self.addr: Addr = ("127.0.0.1", port)

    def counters(self) -> dict[str, int]:
        with Client(self.sock, API_TIMEOUT_S) as client:
            return client.get("/v1/gossip")["counters"]

    def peers(self) -> dict[str, dict]:
        with Client(self.sock, API_TIMEOUT_S) as client:
            return {p["node_id"]: p for p in client.get("/v1/peers")}


def start_agent(make_agent, run_dir: Path, name: str, keyed: bool, gossip: str = "",
                with_process: bool = False):
    port = udp_port()
    sock = str(run_dir / f"{name}.sock")
    key_line = ""
    if keyed:
        key_file = run_dir / "gossip.key"
        if not key_file.exists():
            key_file.write_text(KEY.hex() + "\n")
            key_file.chmod(0o600)
        key_line = f'key_file = "{key_file}"\n'
    agent = make_agent(agent_config(sock, node_id=name,
                                    gossip=f'bind = "127.0.0.1:{port}"\n{key_line}{gossip}'))
    agent.start()
    agent.wait_ready(sock)
    target = Target(sock, port)
    return (target, agent) if with_process else target


# Where forged peers say they listen: nobody does, so the target's routine traffic to
# them (beats, rounds) does not mix with the answers a test measures.
NOWHERE = ("127.0.0.9", 9)


def send_records(peer: RawPeer, to: Addr, snaps: list[LoadSnapshot], at: Addr | None = None) -> None:
    records = [wire.pack_full(0, 0, at or peer.addr, encode(s)) for s in snaps]
    for body in wire.pack_content(records, 1400):
        peer.send(peer.seal(Kind.CONTENT, body, to), to)
        time.sleep(0.002)  # within the address's allowance


@pytest.fixture(params=[False, True], ids=["open", "keyed"])
def crowded(request, make_agent, run_dir: Path) -> Iterator[tuple[Target, RawPeer, bool]]:
    """An agent holding FORGED live peers, and a peer that put them there (a key holder
    on the keyed mesh: what an attacker captures, it signed)."""
    keyed = request.param
    target = start_agent(make_agent, run_dir, "target", keyed, SLOW_TIMERS)
    with RawPeer("insider", Keyring([KEY]) if keyed else None, host="127.0.0.3") as insider:
        insider.prove(target.addr)
        send_records(insider, target.addr, [snapshot("insider", wall_ms())])
        send_records(insider, target.addr, [snapshot(f"forged-{i}", wall_ms()) for i in range(FORGED)], NOWHERE)
        wait_for(lambda: len(target.peers()) > FORGED, 20.0, "the forged peers in the table")
        yield target, insider, keyed


def answer_bytes(victim: RawPeer, data: bytes, to: Addr, peer: bool = False,
                 unless: Callable[[bytes], bool] = lambda _: False) -> int:
    """What `to` sends `victim` in answer to `data`; for a `peer` of `to`, less what it
    gets anyway (gossip_peer.routine); less what `unless` says answers something else."""
    victim.send(data, to)
    return sum(len(d) for d, src in victim.receive(quiet_s=0.5)
               if src == to and not (peer and routine(d)) and not unless(d))


def pulls_other_than(data: bytes, peer: RawPeer, key: int) -> bool:
    """Whether data is a pull (to `peer`) that names nodes, none of them `key`."""
    if data[wire.KIND_AT] != Kind.PULL:
        return False
    full, short = wire.unpack_wants(wire.open_datagram(data, peer.keyring, 65_535).body)
    return key not in {k for k, _ in full + short}


def test_no_answer_to_an_unproven_source_is_larger_than_what_it_sent(crowded) -> None:
    target, insider, keyed = crowded
    to = target.addr
    asks = hostile_asks([f"forged-{i}" for i in range(FORGED)],
                        encode(snapshot("newcomer", wall_ms())), wall_ms())
    with RawPeer("victim", host="127.0.0.4") as victim:
        for what, (kind, body, flags) in asks.items():
            # Open mesh: anyone forges the victim's source (not the token sent there). Keyed:
            # a datagram the insider signed for itself, replayed with the victim's source.
            data = insider.seal(kind, body, to, flags) if keyed else victim.seal(kind, body, to, flags, echo=0)
            got = answer_bytes(victim, data, to)
            assert 0 < got <= len(data), (what, got, len(data))
        # The same ask from a proven source is answered in full: the bound is the proof's.
        full = answer_bytes(insider, insider.seal(Kind.SYNC, b"", to, wire.FLAG_REPLY), to, peer=True)
        assert full >= FORGED * wire.ENTRY.size
    counts = target.counters()
    assert counts["cookies_sent"] >= len(asks)
    assert "newcomer" not in target.peers()


def test_a_replayed_datagram_changes_nothing(crowded) -> None:
    target, insider, keyed = crowded
    to = target.addr
    ask = insider.seal(Kind.SYNC, b"", to, wire.FLAG_REPLY)
    assert answer_bytes(insider, ask, to, peer=True) > 0
    # The whole answer in before the replay: on a busy machine its last datagrams can come
    # after a quiet half second, and would be taken for an answer to the replay.
    deadline = time.monotonic() + 10
    while any(src == to and not routine(d) for d, src in insider.receive(quiet_s=0.5)):
        assert time.monotonic() < deadline, "the answer to the sync never ended"
    before = target.counters()
    # Again from the address it came from: refused, unanswered.
    insider.send(ask, to)
    wait_for(lambda: target.counters()["drop_replayed"] > before.get("drop_replayed", 0), 10.0,
             "the replay refused")
    answered = [(Kind(d[wire.KIND_AT]).name, d[wire.FLAGS_AT], len(d))
                for d, src in insider.receive(quiet_s=0.5) if src == to and not routine(d)]
    assert answered == []
    assert target.counters()["drop_replayed"] == before.get("drop_replayed", 0) + 1
    # From another address: a cookie, and the insider's address is not rebound.
    with RawPeer("elsewhere", host="127.0.0.5") as elsewhere:
        assert 0 < answer_bytes(elsewhere, ask, to) <= len(ask)
    assert target.peers()["insider"]["addr"] == f"{insider.addr[0]}:{insider.addr[1]}"
    # Captured longer ago than the replay window: refused whatever it carries, here a
    # node the agent never saw (a reaped node's last record, resurrected).
    old_seq = (wall_ms() - 31_000) * 1000
    ghost = wire.pack_content([wire.pack_full(0, 0, insider.addr, encode(snapshot("ghost", wall_ms())))], 1400)[0]
    # A pull of what the target wants from the insider since the sync (a RawPeer never
    # serves one, so the target asks again) may come now too: only one of the ghost counts.
    assert answer_bytes(insider, insider.seal(Kind.CONTENT, ghost, to, seq=old_seq), to, peer=True,
                        unless=lambda d: pulls_other_than(d, insider, wire.node_key("ghost"))) == 0
    assert target.counters()["drop_stale"] >= 1
    assert "ghost" not in target.peers()


def test_a_flood_from_many_ports_is_held_to_one_address_allowance(make_agent, run_dir: Path) -> None:
    target = start_agent(make_agent, run_dir, "target", keyed=True)
    before = target.counters()
    socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(64)]
    try:
        for s in socks:
            s.bind(("127.0.0.6", 0))
        junk = wire.seal(Kind.SYNC, 1, b"", Keyring([secrets.token_bytes(32)]), wire.FLAG_REPLY)
        # In bursts of 1000 that the agent has (nearly) read before the next: sent at
        # once, 20,000 overflow its 4 MB receive buffer whenever the machine is busy, and
        # the kernel, not the allowance, drops them.
        started = time.monotonic()
        for burst in range(1, 21):
            for i in range(1000):
                socks[i % len(socks)].sendto(junk, target.addr)
            wait_for(lambda: target.counters()["datagrams_received"] - before["datagrams_received"]
                     >= 950 * burst, 20.0, f"the flood's burst {burst} received")
        elapsed = time.monotonic() - started
    finally:
        for s in socks:
            s.close()
    counts = target.counters()
    checked = counts["drop_bad_signature"] - before.get("drop_bad_signature", 0)
    # 500/s and a burst of 1000 for the one address, however many ports.
    assert 0 < checked <= 1000 + 500 * (elapsed + 2), (checked, elapsed)
    assert counts["drop_rate_limited"] - before.get("drop_rate_limited", 0) >= 10_000


def mesh_of_three(make_agent, run_dir: Path) -> list[Target]:
    first = start_agent(make_agent, run_dir, "a", keyed=True)
    seed = f'seeds = ["127.0.0.1:{first.addr[1]}"]\n'
    rest = [start_agent(make_agent, run_dir, name, keyed=True, gossip=seed) for name in ("b", "c")]
    nodes = [first, *rest]
    wait_for(lambda: all(sum(p["state"] == "alive" for p in t.peers().values()) == 3 for t in nodes),
             20.0, "three agents alive at each other")
    return nodes


def test_a_wedge_attempt_leaves_the_node_alive_and_its_versions_win(make_agent, run_dir: Path) -> None:
    a, b, c = mesh_of_three(make_agent, run_dir)
    b_key = wire.node_key("b")
    forged = wall_ms() + 20_000  # plausible: within the clock skew allowed
    with RawPeer("insider", Keyring([KEY]), host="127.0.0.7") as insider:
        for target in (a, c):
            insider.prove(target.addr)
            held = target.peers()["b"]["version"]
            # The furthest ahead an announcement can say (its version's low 32 bits are
            # read against the version held: 24 days of ms ahead), a version past the
            # receiver's clock, and b dead at an incarnation 24 years ahead.
            for entry in ((b_key, held + 2**31 - 1, 0), (b_key, wall_ms() + 120_000, 0),
                          (b_key, forged, 4_000_000_000)):
                insider.send(insider.seal(Kind.GOSSIP, wire.pack_entries([entry]), target.addr), target.addr)
            # A record in b's name at a version above b's own: what a key holder can do.
            send_records(insider, target.addr, [snapshot("b", forged)])
        deadline = time.monotonic() + 10  # over twice what a death takes (SWIM's timers)
        while time.monotonic() < deadline:
            for target in (a, c):
                assert target.peers()["b"]["state"] == "alive"
            time.sleep(0.3)
    for target in (a, c):
        assert target.counters()["drop_implausible"] >= 3
        # b heard of the forged version and published above it; everyone holds that.
        wait_for(lambda t=target: t.peers()["b"]["version"] > forged, 20.0, "b's own version above the forged one")
    assert b.counters()["own_newer_seen"] >= 1


def big_snapshot(node_id: str, version: int) -> LoadSnapshot:
    """As large as a snapshot gets: 16 GPUs, 64 models."""
    gpus = tuple(GpuLoad(index=i, util_pct=50, mem_used_mib=40_000 + i, mem_total_mib=81_920, temp_c=60,
                         power_w=300 + i, power_limit_w=700, throttle_reasons=0, processes=2, healthy=True)
                 for i in range(MAX_GPUS))
    models = tuple(ModelLoad(model_id=(1 << 40) + i, port=8000, rps=12.5 + i, error_ratio=0.01, p50_ms=80.5 + i,
                             p99_ms=900.25 + i, in_flight=7 + i) for i in range(MAX_MODELS))
    return LoadSnapshot(node_id=node_id, endpoints=(Endpoint("127.0.0.1", 8000),), version=version,
                        timestamp_ms=wall_ms(), state=NodeState.OK, score=0.5,
                        host=HostLoad(0.5, 1000, 2000, 1.5, None), gpus=gpus, models=models)


def forge_ids(to: Addr, count: int) -> None:
    """`count` big snapshots of nodes that do not exist, from one address (127.0.0.8),
    each in the forged node's own name, so that each claims the anchor of that address."""
    with RawPeer("attacker", host="127.0.0.8") as attacker:
        attacker.prove(to)
        for i in range(count):
            snap = big_snapshot(f"forged-{i}", wall_ms())
            record = wire.pack_full(0, 0, NOWHERE, encode(snap))
            attacker.send(attacker.seal(Kind.CONTENT, wire.pack_content([record], 65_000)[0], to,
                                        sender=wire.node_key(snap.node_id)), to)
            time.sleep(0.0022)  # within the address's allowance


def test_a_forged_id_flood_keeps_memory_bounded_and_a_real_node_gets_in(make_agent, run_dir: Path) -> None:
    """An open mesh (the hardest case: anyone may name nodes), its default bounds."""
    target, process = start_agent(make_agent, run_dir, "target", keyed=False,
                                  gossip="insecure = true\n" + SLOW_TIMERS, with_process=True)
    before = memory_mib(process.proc.pid)[0]
    flood = 3000
    forge_ids(target.addr, flood)
    wait_for(lambda: target.counters()["drop_table_full"] > 0, 20.0, "the table full")
    with Client(target.sock, API_TIMEOUT_S) as client:
        table_bytes = client.get("/v1/gossip")["table_bytes"]
    grown = memory_mib(process.proc.pid)[0] - before
    assert table_bytes <= 2 << 20
    assert len(target.peers()) < flood
    # A real node joins through the flooded agent, and gets in.
    joiner = start_agent(make_agent, run_dir, "joiner", keyed=False,
                         gossip=f'seeds = ["127.0.0.1:{target.addr[1]}"]\n')
    wait_for(lambda: target.peers().get("joiner", {}).get("state") == "alive", 20.0, "the real joiner alive at the target")
    wait_for(lambda: joiner.peers().get("target", {}).get("state") == "alive", 20.0, "the target alive at the joiner")
    # 4 MiB of encodings, about 20x that decoded.
    assert grown < 150, f"RSS grew {grown:.0f} MiB"


def test_an_open_mesh_on_a_reachable_address_must_be_asked_for(make_agent, run_dir: Path) -> None:
    sock = str(run_dir / "open.sock")
    refused = make_agent(agent_config(sock, gossip='bind = "0.0.0.0:0"')).start()
    assert refused.wait_exit() == 78
    assert "gossip.insecure = true" in refused.logs()
    allowed = make_agent(agent_config(sock, gossip='bind = "0.0.0.0:0"\ninsecure = true')).start()
    allowed.wait_ready(sock)
