"""LAN discovery with mDNS/DNS-SD: this node registers `_loadmesh._udp.local.` and joins
every peer it finds registered.

Discovery only finds addresses to join through; membership, merging and authentication
are the protocol's. It fails soft: when zeroconf cannot start (no multicast route, port
5353 unavailable, no interface), the node runs on its seeds alone and `reason` says why.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

log = logging.getLogger(__name__)

SERVICE_TYPE = "_loadmesh._udp.local."
_RESOLVE_TIMEOUT_MS = 3000
# DNS-SD instance names are at most 63 bytes.
_MAX_INSTANCE_BYTES = 63


def _instance(node_id: str) -> str:
    name = node_id.encode()[:_MAX_INSTANCE_BYTES].decode(errors="ignore")
    return f"{name}.{SERVICE_TYPE}"


class Discovery:
    def __init__(self, node_id: str, addr: tuple[str, int], on_found: Callable[[tuple[str, int]], None],
                 interfaces: list[str] | None = None) -> None:
        self.node_id = node_id
        self.addr = addr
        self.on_found = on_found
        # None: every interface; tests pin it to loopback.
        self.interfaces = interfaces
        self.reason = ""
        self._zc: AsyncZeroconf | None = None
        self._browser: AsyncServiceBrowser | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> bool:
        return self._zc is not None

    async def start(self) -> None:
        """Register and browse; on failure, log once and leave `reason` set."""
        try:
            host = ipaddress.ip_address(self.addr[0])
            version = IPVersion.V6Only if host.version == 6 else IPVersion.V4Only
            kwargs = {"ip_version": version}
            if self.interfaces is not None:
                kwargs["interfaces"] = self.interfaces
            self._zc = AsyncZeroconf(**kwargs)  # type: ignore[arg-type]
            info = AsyncServiceInfo(SERVICE_TYPE, _instance(self.node_id), addresses=[host.packed],
                                    port=self.addr[1], properties={"node_id": self.node_id})
            await self._zc.async_register_service(info)
            self._browser = AsyncServiceBrowser(self._zc.zeroconf, SERVICE_TYPE, handlers=[self._on_change])
        except Exception as e:  # zeroconf raises OSError, its own errors, ValueError...
            self.reason = f"mDNS discovery unavailable: {e}"
            log.warning("gossip: %s; joining through seeds only", self.reason)
            await self.stop()

    def _on_change(self, zeroconf: Zeroconf, service_type: str, name: str,
                   state_change: ServiceStateChange) -> None:
        if state_change is ServiceStateChange.Removed or name == _instance(self.node_id):
            return
        task = asyncio.get_running_loop().create_task(self._resolve(zeroconf, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, zeroconf: Zeroconf, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        try:
            if not await info.async_request(zeroconf, _RESOLVE_TIMEOUT_MS):
                return
        except Exception as e:  # a peer's bad record must not stop discovery
            log.debug("gossip: cannot resolve %s: %s", name, e)
            return
        if info.port:
            for address in info.parsed_addresses():
                self.on_found((address, info.port))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._browser is not None:
            await self._browser.async_cancel()
            self._browser = None
        if self._zc is not None:
            zc, self._zc = self._zc, None
            try:
                await zc.async_unregister_all_services()
            finally:
                await zc.async_close()
