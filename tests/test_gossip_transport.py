"""GossipService over real UDP sockets on 127.0.0.1, several nodes in one event loop."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable

import pytest

from loadmesh.gossip import discovery as discovery_module
from loadmesh.gossip.config import GossipParams
from loadmesh.gossip.keyring import Keyring
from loadmesh.gossip.membership import PeerState
from loadmesh.gossip.protocol import PeerView
from loadmesh.gossip.snapshot import Endpoint, HostLoad, LoadSnapshot, NodeState
from loadmesh.gossip.transport import GossipService, parse_seed

KEY = bytes(range(32))
PARAMS = GossipParams(interval_ms=50, probe_interval_ms=200, probe_timeout_ms=50, suspicion_min_ms=1500,
                      push_pull_interval_ms=2000, join_retry_ms=200, dead_sync_interval_ms=1000)


def views(svc: GossipService) -> dict[str, PeerView]:
    """Every view the service holds: what it answers a reader that has read nothing yet."""
    return svc.snapshots_since(None)[1]


def snap(node: str, version: int, score: float = 0.5) -> LoadSnapshot:
    return LoadSnapshot(node_id=node, endpoints=(Endpoint("127.0.0.1", 8000),), version=version,
                        timestamp_ms=time.time_ns() // 1_000_000, state=NodeState.OK, score=score,
                        host=HostLoad(score, 1000, 2000, 1.0, None), gpus=(), models=())


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), 30))


async def start_mesh(n: int, keyring: Keyring | None = Keyring([KEY]), seed_name: str = "127.0.0.1"
                     ) -> list[GossipService]:
    first = GossipService("svc-0", ("127.0.0.1", 0), [], PARAMS, keyring)
    await first.start()
    seeds = [f"{seed_name}:{first.address[1]}"]
    services = [first] + [GossipService(f"svc-{i}", ("127.0.0.1", 0), seeds, PARAMS, keyring) for i in range(1, n)]
    for i, svc in enumerate(services):
        if i:
            await svc.start()
        svc.publish(snap(svc.node_id, 100 + i), urgent=True)
    return services


async def stop_all(services: list[GossipService]) -> None:
    for svc in services:
        await svc.stop()


def test_services_converge_and_release_their_sockets() -> None:
    async def main() -> None:
        services = await start_mesh(5)
        try:
            names = {s.node_id for s in services}
            await wait_for(lambda: all(set(views(s)) == names for s in services))
            services[3].publish(snap("svc-3", 500, score=0.9), urgent=False)
            await wait_for(lambda: all(views(s)["svc-3"].snapshot.version == 500 for s in services))
            rows = services[0].peers()
            assert rows[0].node_id == "svc-0"
            assert {r.state for r in rows} == {PeerState.ALIVE}
            assert {r.addr for r in rows} == {("127.0.0.1", s.address[1]) for s in services}
            # Nothing new is published for twice the shortest suspicion: the probes
            # alone keep every peer alive, each answered.
            pings = services[0].counters()["pings_sent"]
            periods = 2 * PARAMS.suspicion_min_ms // PARAMS.probe_interval_ms
            await wait_for(lambda: services[0].counters()["pings_sent"] >= pings + periods)
            assert {r.state for r in services[0].peers()} == {PeerState.ALIVE}
            counts = services[1].counters()
            assert counts["pings_sent"] > 0 and counts["acks_sent"] > 0
            assert counts["suspicions"] == 0
            assert counts["datagrams_sent"] > 0 and counts["bytes_received"] > 0
            assert not any(k.startswith("drop_") and v for k, v in counts.items() if k != "drop_pulls_full")
            ports = [s.address[1] for s in services]
        finally:
            await stop_all(services)
        for port in ports:  # stop() released every socket
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(("127.0.0.1", port))
            sock.close()

    run(main)


def test_a_stopped_service_is_declared_dead() -> None:
    async def main() -> None:
        services = await start_mesh(3)
        try:
            await wait_for(lambda: all(len(views(s)) == 3 for s in services))
            await services[2].stop()
            await wait_for(lambda: all(views(s)["svc-2"].state is PeerState.DEAD for s in services[:2]))
        finally:
            await stop_all(services[:2])

    run(main)


def test_wrong_key_node_is_rejected() -> None:
    async def main() -> None:
        services = await start_mesh(3)
        seed = f"127.0.0.1:{services[0].address[1]}"
        intruder = GossipService("intruder", ("127.0.0.1", 0), [seed], PARAMS, Keyring([bytes(range(2, 34))]))
        await intruder.start()
        intruder.publish(snap("intruder", 1), urgent=True)
        try:
            await wait_for(lambda: all(len(views(s)) == 3 for s in services))
            # The intruder keeps knocking (every join_retry_ms) and the seed keeps refusing
            # it: by the third refusal the seed has gossiped with the others for rounds.
            await wait_for(lambda: services[0].counters().get("drop_bad_signature", 0) >= 3)
            assert all("intruder" not in views(s) for s in services)
            assert set(views(intruder)) == {"intruder"}
        finally:
            await stop_all(services + [intruder])

    run(main)


def test_seed_given_by_name_is_resolved() -> None:
    async def main() -> None:
        services = await start_mesh(2, seed_name="localhost")
        try:
            await wait_for(lambda: all(len(views(s)) == 2 for s in services))
        finally:
            await stop_all(services)

    run(main)


def test_open_mesh_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        with caplog.at_level(logging.WARNING, logger="loadmesh.gossip.transport"):
            services = await start_mesh(2, keyring=None)
            try:
                await wait_for(lambda: all(len(views(s)) == 2 for s in services))
            finally:
                await stop_all(services)
        warnings = [r for r in caplog.records if "mesh is open" in r.getMessage()]
        assert len(warnings) == 2  # once per service

    run(main)


def test_bind_failure_names_the_address() -> None:
    async def main() -> None:
        taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        svc = GossipService("busy", ("127.0.0.1", port), [], PARAMS, None)
        try:
            with pytest.raises(OSError, match=f"127.0.0.1:{port}"):
                await svc.start()
        finally:
            taken.close()
        with pytest.raises(RuntimeError):
            svc.publish(snap("busy", 1), urgent=False)

    run(main)


def test_seed_syntax() -> None:
    assert parse_seed("gpu-b03.example:7946") == ("gpu-b03.example", 7946)
    assert parse_seed("[::1]:7946") == ("::1", 7946)
    for bad in ("nohost", "::1:7946", "host:0", "host:x", ":7946"):
        with pytest.raises(ValueError):
            parse_seed(bad)


def test_discovery_joins_peers_on_the_lan() -> None:
    async def main() -> None:
        services = [GossipService(f"mdns-{i}", ("127.0.0.1", 0), [], PARAMS, Keyring([KEY]), discovery=True,
                                  discovery_interfaces=["127.0.0.1"]) for i in range(2)]
        for i, svc in enumerate(services):
            await svc.start()
            svc.publish(snap(svc.node_id, 10 + i), urgent=True)
        try:
            reasons = [s.discovery.reason for s in services if s.discovery and s.discovery.reason]
            if reasons:
                pytest.skip(f"no multicast here: {reasons[0]}")
            await wait_for(lambda: all(len(views(s)) == 2 for s in services), timeout=15)
        finally:
            await stop_all(services)

    run(main)


def test_discovery_fails_soft(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(**kwargs: object) -> None:
        raise OSError("no multicast route")

    monkeypatch.setattr(discovery_module, "AsyncZeroconf", broken)

    async def main() -> None:
        svc = GossipService("alone", ("127.0.0.1", 0), [], PARAMS, None, discovery=True)
        await svc.start()
        try:
            assert svc.discovery is not None and "no multicast route" in svc.discovery.reason
            assert not svc.discovery.running
            svc.publish(snap("alone", 1), urgent=False)
            assert [p.node_id for p in svc.peers()] == ["alone"]
        finally:
            await svc.stop()

    run(main)
