"""The `gossip` component: this node's snapshots out to the mesh, the peers' in.

A bind failure or a bad key file stops the agent: both are the operator's configuration,
and an agent that silently ran outside the mesh (or in an open one, when a key was asked
for) would route on a view nobody else shares.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from loadmesh.daemon import logs
from loadmesh.daemon.config import GossipConfig, split_host_port
from loadmesh.daemon.health import OK, Health, StartupError
from loadmesh.daemon.http import Request, Response
from loadmesh.daemon.snapshot_component import SnapshotComponent
from loadmesh.gossip.keyring import Keyring, load_keyring
from loadmesh.gossip.protocol import PeerView, TableMark
from loadmesh.gossip.transport import GossipService, format_addr

log = logs.get("gossip")


class GossipComponent:
    name = "gossip"

    def __init__(self, node_id: str, config: GossipConfig, advertise_host: str | None,
                 snapshot: SnapshotComponent) -> None:
        """advertise_host: the operator's `advertise`, or None to let the service find
        the address peers reach it at."""
        self.node_id = node_id
        self.config = config
        self.snapshot = snapshot
        self._advertise_host = advertise_host
        self.service: GossipService | None = None

    def _keyring(self) -> Keyring | None:
        if not self.config.key_file:
            return None
        try:
            return load_keyring(self.config.key_file)
        except (OSError, ValueError) as exc:
            raise StartupError(f"gossip.key_file: {exc}") from None

    async def start(self) -> None:
        host, port = split_host_port(self.config.bind, allow_any_port=True)
        # The section is the protocol's parameters (GossipConfig extends GossipParams).
        service = GossipService(
            self.node_id, (host, port), self.config.seeds, self.config, self._keyring(),
            discovery=self.config.discovery,
            advertise=(self._advertise_host, port) if self._advertise_host and port else None)
        try:
            await service.start()
        except OSError as exc:
            raise StartupError(str(exc.strerror or exc)) from None
        if port == 0 and host in ("0.0.0.0", "::"):
            log.warning("gossip bound to any free port: peers can only find this node if "
                        "it contacts them first")
        self.service = service
        current = self.snapshot.current
        if current is not None:
            service.publish(current, urgent=True)
        self.snapshot.subscribe(service.publish)
        self.snapshot.outrun(service.newest_own_seen)

    async def stop(self) -> None:
        if self.service is not None:
            await self.service.stop()
            self.service = None

    def health(self) -> Health:
        return OK

    def set_keyring(self, key_file: str, keyring: Keyring) -> None:
        """Take a reloaded key file (a rotation step, or an open mesh closed)."""
        self.config = dataclasses.replace(self.config, key_file=key_file)
        if self.service is None:
            return
        self.service.set_keyring(keyring)
        log.info("%d key(s) from %s, the first signs", len(keyring.keys), key_file)

    async def set_seeds(self, seeds: Sequence[str]) -> None:
        """Take reloaded seeds. Seeds only matter to a node that has no live peer: it
        retries them until one answers, so a node left alone by wrong seeds joins through
        the new ones."""
        self.config = dataclasses.replace(self.config, seeds=tuple(seeds))
        if self.service is not None:
            await self.service.set_seeds(seeds)

    def views_since(self, mark: TableMark | None) -> tuple[TableMark | None, dict[str, PeerView], bool]:
        """The views of the nodes changed since mark (an earlier answer's; None: every
        node), where the table stands now, and whether those are every view there is
        (GossipCore.snapshots_since). Without a running service: none, all of them."""
        if self.service is None:
            return None, {}, True
        return self.service.snapshots_since(mark)

    def serve_gossip(self, _: Request) -> Response:
        if self.service is None:
            return Response.json({"address": None, "counters": {}})
        host, port = self.service.address
        return Response.json({"address": format_addr((host, port)),
                              "table_bytes": self.service.table_bytes(),
                              "probe_delivery": round(self.service.probe_delivery(), 3),
                              "counters": self.service.counters()})

    def serve_peers(self, _: Request) -> Response:
        rows = [] if self.service is None else self.service.peers()
        return Response.json([{"node_id": r.node_id, "state": r.state.value, "version": r.version,
                               "age_ms": r.age_ms, "addr": format_addr(r.addr)} for r in rows])
