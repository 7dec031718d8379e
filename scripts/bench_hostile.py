#!/usr/bin/env python3
"""The gossip port under attack, measured on real agents over real UDP (issue 15):

1. amplification: bytes an agent holding --peers peers sends to a forged source, per
   message kind, open and keyed (keyed: a datagram a key holder signed, replayed from
   the victim's address), beside what a proven source gets for the same datagram;
2. a flood from 64 ports of one address: datagrams that reached the HMAC check, a live
   peer's state, /healthz latency meanwhile;
3. a forged-id flood on an open mesh (snapshots of 16 GPUs and 64 models): the agent's
   RSS, the table, and whether a real node still gets in.

    .venv/bin/python scripts/bench_hostile.py [--peers 1000] [--flood-s 10] [--ids 5000]

Agents listen on 127.0.0.1, attackers send from other loopback addresses, as from other
hosts. Needs no root (probes off).
"""

from __future__ import annotations

import argparse
import contextlib
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from loadmesh.daemon.client import AgentUnavailable, ApiError, Client  # noqa: E402
from loadmesh.gossip import wire  # noqa: E402
from loadmesh.gossip.keyring import Keyring  # noqa: E402
from loadmesh.gossip.membership import Addr  # noqa: E402
from loadmesh.gossip.snapshot import encode  # noqa: E402
from loadmesh.gossip.wire import Kind  # noqa: E402
from gossip_peer import RawPeer, hostile_asks  # noqa: E402
from gossip_peer import routine as is_routine  # noqa: E402
from test_hostile_gossip import (NOWHERE, forge_ids, rss_mib, send_records, snapshot, udp_port,  # noqa: E402
                                 wall_ms)

LOADMESH = str(ROOT / ".venv" / "bin" / "loadmesh")
SLOW_TIMERS = "suspicion_min_ms = 600000\nreap_after_ms = 1200000\n"


class Agent:
    def __init__(self, work: Path, name: str, gossip: str) -> None:
        self.port = udp_port()
        self.addr: Addr = ("127.0.0.1", self.port)
        self.sock = str(work / f"{name}.sock")
        config = work / f"{name}.toml"
        config.write_text(f'node_id = "{name}"\nstate_dir = "{work / ("state-" + name)}"\n'
                          f'[api]\nsocket = "{self.sock}"\n[probes]\ninterfaces = []\n'
                          f'[gossip]\nbind = "127.0.0.1:{self.port}"\n{gossip}\n[metrics]\nlisten = ""\n')
        self.log = open(work / f"{name}.log", "w")
        self.proc = subprocess.Popen([LOADMESH, "agent", "--config", str(config)], stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, AgentUnavailable, ApiError), Client(self.sock) as client:
                client.get("/healthz")  # 503 until every component has started
                return
            time.sleep(0.1)
        raise RuntimeError(f"agent {name} did not start")

    def get(self, path: str) -> object:
        with Client(self.sock, timeout=10) as client:
            return client.get(path)

    def counters(self) -> dict[str, int]:
        return self.get("/v1/gossip")["counters"]  # type: ignore[index]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)
        self.log.close()


@contextlib.contextmanager
def agents(work: Path, *specs: tuple[str, str]) -> Iterator[list[Agent]]:
    made: list[Agent] = []
    try:
        for name, gossip in specs:
            made.append(Agent(work, name, gossip))
        yield made
    finally:
        for agent in made:
            agent.stop()


def answer_bytes(peer: RawPeer, data: bytes, to: Addr, routine: bool = False) -> int:
    """Bytes `to` sends `peer` after `data`; without what a live peer gets anyway
    (gossip_peer.routine) unless `routine`."""
    peer.send(data, to)
    return sum(len(d) for d, src in peer.receive(quiet_s=0.5)
               if src == to and (routine or not is_routine(d)))


def amplification(work: Path, peers: int) -> None:
    print(f"== amplification: an agent holding {peers} peers, one datagram from a forged source ==")
    print(f"{'mesh':6} {'kind':32} {'in':>6} {'out':>7} {'ratio':>6}   {'proven source gets':>18}")
    asks = hostile_asks([f"forged-{i}" for i in range(peers)], encode(snapshot("newcomer", wall_ms())), wall_ms())
    for keyed in (False, True):
        key_file = work / "amp.key"
        key_file.write_text(secrets.token_hex(32) + "\n")
        key_file.chmod(0o600)
        ring = Keyring([bytes.fromhex(key_file.read_text().strip())]) if keyed else None
        gossip = SLOW_TIMERS + (f'key_file = "{key_file}"\n' if keyed else "")
        with agents(work, (f"amp-{'keyed' if keyed else 'open'}", gossip)) as (target,), \
                RawPeer("insider", ring, host="127.0.0.3") as insider, RawPeer("victim", host="127.0.0.4") as victim:
            insider.prove(target.addr)
            send_records(insider, target.addr, [snapshot("insider", wall_ms())])
            send_records(insider, target.addr, [snapshot(f"forged-{i}", wall_ms()) for i in range(peers)], NOWHERE)
            deadline = time.monotonic() + 60
            while len(target.get("/v1/peers")) <= peers and time.monotonic() < deadline:  # type: ignore[arg-type]
                time.sleep(0.2)
            for what, (kind, body, flags) in asks.items():
                data = (insider.seal(kind, body, target.addr, flags) if keyed
                        else victim.seal(kind, body, target.addr, flags, echo=0))
                out = answer_bytes(victim, data, target.addr, routine=True)
                proven = answer_bytes(insider, insider.seal(kind, body, target.addr, flags), target.addr)
                print(f"{'keyed' if keyed else 'open':6} {what:32} {len(data):6} {out:7} {out / len(data):6.2f}"
                      f"   {proven:10} ({proven / len(data):.0f}x)")


def flood(work: Path, seconds: float) -> None:
    print(f"\n== flood: {seconds:g} s of junk from 64 ports of one address at a keyed 2-node mesh ==")
    key_file = work / "flood.key"
    key_file.write_text(secrets.token_hex(32) + "\n")
    key_file.chmod(0o600)
    keyed = f'key_file = "{key_file}"\n'
    with agents(work, ("flood-a", keyed)) as (a,):
        with agents(work, ("flood-b", keyed + f'seeds = ["127.0.0.1:{a.port}"]\n')) as (b,):
            deadline = time.monotonic() + 20
            while a.get("/v1/peers")[-1]["state"] != "alive" and time.monotonic() < deadline:  # type: ignore[index]
                time.sleep(0.2)
            before = a.counters()
            stop = threading.Event()
            sent = [0]

            def attack() -> None:
                socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(64)]
                for s in socks:
                    s.bind(("127.0.0.6", 0))
                junk = wire.seal(Kind.SYNC, 1, b"", Keyring([secrets.token_bytes(32)]), wire.FLAG_REPLY)
                i = 0
                while not stop.is_set():
                    with contextlib.suppress(OSError):
                        socks[i % 64].sendto(junk, a.addr)
                        sent[0] += 1
                    i += 1
                for s in socks:
                    s.close()

            thread = threading.Thread(target=attack)
            thread.start()
            latencies, states = [], set()
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t0 = time.monotonic()
                with Client(a.sock, timeout=10) as client:
                    client.get("/healthz")
                latencies.append((time.monotonic() - t0) * 1000)
                states.add(next(p["state"] for p in a.get("/v1/peers") if p["node_id"] == "flood-b"))  # type: ignore[union-attr]
                time.sleep(0.1)
            stop.set()
            thread.join()
            time.sleep(1)
            after = a.counters()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    print(f"sent {sent[0]} ({sent[0] / seconds:.0f}/s); received {delta['datagrams_received']}; "
          f"rate-limited {delta.get('drop_rate_limited', 0)}; reached the HMAC check "
          f"{delta.get('drop_bad_signature', 0)} ({delta.get('drop_bad_signature', 0) / seconds:.0f}/s)")
    print(f"peer flood-b seen as: {sorted(states)}; became suspect {delta.get('became_suspect', 0)} times")
    print(f"/healthz during the flood: p50 {statistics.median(latencies):.1f} ms, "
          f"max {max(latencies):.1f} ms ({len(latencies)} requests)")


def forged_ids(work: Path, ids: int) -> None:
    print(f"\n== forged ids: {ids} ids of 16 GPUs and 64 models each, at an open mesh ==")
    with agents(work, ("ids", "insecure = true\n" + SLOW_TIMERS)) as (target,):
        time.sleep(1)
        before = rss_mib(target.proc.pid)
        t0 = time.monotonic()
        forge_ids(target.addr, ids)
        took = time.monotonic() - t0
        time.sleep(2)
        stats = target.get("/v1/gossip")
        rss = rss_mib(target.proc.pid)
        held = len(target.get("/v1/peers")) - 1  # type: ignore[arg-type]
        t1 = time.monotonic()
        with agents(work, ("joiner", f'insecure = true\nseeds = ["127.0.0.1:{target.port}"]\n')):
            while time.monotonic() - t1 < 30:
                rows = {p["node_id"]: p["state"] for p in target.get("/v1/peers")}  # type: ignore[union-attr]
                if rows.get("joiner") == "alive":
                    break
                time.sleep(0.2)
            joined = time.monotonic() - t1
        best = []
        for _ in range(20):
            t2 = time.monotonic()
            with contextlib.suppress(Exception), Client(target.sock, timeout=10) as client:
                client.get("/v1/best", model="x")
            best.append((time.monotonic() - t2) * 1000)
    print(f"sent {ids} ids in {took:.1f} s; held {held} peers, {stats['table_bytes']} bytes of "  # type: ignore[index]
          f"snapshots; refused {stats['counters'].get('drop_table_full', 0)}")  # type: ignore[index]
    print(f"RSS {before:.0f} -> {rss:.0f} MiB (+{rss - before:.0f}); a real node started, joined and was "
          f"alive at it within {joined:.1f} s; /v1/best after: p50 {statistics.median(best):.1f} ms, max {max(best):.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--flood-s", type=float, default=10.0)
    parser.add_argument("--ids", type=int, default=5000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loadmesh-hostile-") as tmp:
        work = Path(tmp)
        amplification(work, args.peers)
        flood(work, args.flood_s)
        forged_ids(work, args.ids)


if __name__ == "__main__":
    main()
