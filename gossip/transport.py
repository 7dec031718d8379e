"""The gossip service: one UDP socket and the asyncio loop driving the protocol core.

The core decides everything; this module only moves bytes and time: it feeds received
datagrams and the loop's monotonic clock to the core, sends what the core returns, and
wakes the core at its next deadline. Names (seeds) are resolved with the loop's
getaddrinfo, which runs in a worker thread, so nothing here blocks the event loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections import Counter
from collections.abc import Sequence

from loadmesh.gossip.config import GossipParams
from loadmesh.gossip.discovery import Discovery
from loadmesh.gossip.keyring import Keyring
from loadmesh.gossip.membership import Addr
from loadmesh.gossip.protocol import GossipCore, Outgoing, PeerRow, PeerView, TableMark
from loadmesh.gossip.snapshot import LoadSnapshot

log = logging.getLogger(__name__)

# Bursts come with joins (a whole table at once); the kernel caps what it grants.
_SOCKET_BUFFER = 4 << 20
_SEED_REFRESH_S = 60.0
_ERROR_LOG_INTERVAL_S = 60.0


def parse_seed(seed: str) -> Addr:
    """"host:port" or "[v6]:port"; ValueError otherwise."""
    host, sep, port = seed.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ValueError(f"an IPv6 seed needs brackets: [{host}]:{port}")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected host:port, got {seed!r}")
    return host, int(port)


def format_addr(addr: Addr) -> str:
    """parse_seed's inverse: "host:port", or "[v6]:port"."""
    host, port = addr
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, service: GossipService) -> None:
        self.service = service
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:  # type: ignore[override]
        self.service._on_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP unreachable from a stopped peer, mostly: the failure detector handles it.
        self.service._errors["socket_errors"] += 1

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class GossipService:
    def __init__(
        self,
        node_id: str,
        bind: tuple[str, int],
        seeds: Sequence[str],
        params: GossipParams,
        keyring: Keyring | None,
        discovery: bool = False,
        *,
        advertise: tuple[str, int] | None = None,
        discovery_interfaces: list[str] | None = None,
    ) -> None:
        self.node_id = node_id
        self.bind = bind
        self.seeds = [parse_seed(s) for s in seeds]
        self.params = params
        self.keyring = keyring
        self.discovery_enabled = discovery
        self.discovery_interfaces = discovery_interfaces
        self._advertise = advertise
        self._errors: Counter[str] = Counter()
        self._last_error_log = -_ERROR_LOG_INTERVAL_S
        self.core: GossipCore | None = None
        self.discovery: Discovery | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._protocol: _Protocol | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")
        self._seed_task: asyncio.Task[None] | None = None

    # --- life cycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and join; OSError naming the address when the bind fails."""
        if self._transport is not None:
            raise RuntimeError("gossip service already started")
        loop = self._loop = asyncio.get_running_loop()
        host, port = self.bind
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        try:
            transport, protocol = await loop.create_datagram_endpoint(
                lambda: _Protocol(self), local_addr=(host, port), family=family)
        except OSError as e:
            raise OSError(e.errno, f"gossip cannot bind UDP {format_addr(self.bind)}: {e.strerror or e}") from e
        self._transport, self._protocol = transport, protocol
        sock = transport.get_extra_info("socket")
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, option, _SOCKET_BUFFER)
            except OSError:
                pass  # the default buffers still work, with more loss under bursts
        bound = sock.getsockname()[:2]
        if self._advertise is not None:
            advertise = self._advertise
        elif not ipaddress.ip_address(bound[0]).is_unspecified:
            advertise = bound
        else:
            advertise = (await self._guess_host(family), bound[1])
        self.core = GossipCore(self.node_id, advertise, self.params, self.keyring,
                               wall_offset_ms=self._wall_offset_ms())
        if self.keyring is None:
            log.warning("gossip: no key file configured, the mesh is open: anyone who can reach "
                        "%s can read and inject load snapshots", format_addr(bound))
        log.info("gossip: listening on %s, advertising %s", format_addr(bound), format_addr(advertise))
        if self.seeds:
            self._seed_task = loop.create_task(self._keep_seeds())
        if self.discovery_enabled:
            self.discovery = Discovery(self.node_id, advertise, self._on_discovered, self.discovery_interfaces)
            await self.discovery.start()
        self._tick()

    async def stop(self) -> None:
        """Leave: cancel the timers and tasks and release the socket. Never raises."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._seed_task is not None:
            self._seed_task.cancel()
            try:
                await self._seed_task
            except (asyncio.CancelledError, Exception):
                pass
            self._seed_task = None
        if self.discovery is not None:
            try:
                await self.discovery.stop()
            except Exception as e:
                log.warning("gossip: stopping discovery: %s", e)
            self.discovery = None
        if self._transport is not None:
            self._transport.close()
            assert self._protocol is not None
            # The socket is closed once connection_lost has run.
            try:
                await asyncio.wait_for(asyncio.shield(self._protocol.closed), 1.0)
            except asyncio.TimeoutError:
                pass
            self._transport = None

    @property
    def address(self) -> Addr:
        """Where this node listens (the real port when bound to port 0)."""
        if self._transport is None:
            raise RuntimeError("gossip service not started")
        return self._transport.get_extra_info("sockname")[:2]

    # --- the daemon's side -----------------------------------------------------------------

    def publish(self, snapshot: LoadSnapshot, urgent: bool) -> None:
        """Make snapshot this node's own and spread it (at once to a few peers)."""
        core = self._started()
        self._send(core.publish(snapshot, urgent, self._now_ms()))
        self._reschedule()

    def peers(self) -> list[PeerRow]:
        """Every node this one knows, this node first."""
        return self._started().peers(self._now_ms())

    def snapshots_since(self, mark: TableMark | None) -> tuple[TableMark, dict[str, PeerView], bool]:
        """node_id -> PeerView(snapshot, state, age_ms) of the nodes changed since mark,
        this node's own included (GossipCore.snapshots_since)."""
        return self._started().snapshots_since(mark, self._now_ms())

    def table_bytes(self) -> int:
        """Snapshot encodings held for peers (GossipParams.max_table_bytes bounds it)."""
        return self.core.table.bytes if self.core is not None else 0

    def probe_delivery(self) -> float:
        """The share of this node's pings to live peers answered straight: (1 - loss)**2
        (gossip/probes.py, Delivery); announcements are repeated more below 1."""
        return self.core.delivery.ratio if self.core is not None else 1.0

    def newest_own_seen(self) -> int:
        """The highest version of this node that peers hold, when above its own (else
        what it was when last above, or 0): the owner must publish above it."""
        return self.core.newest_own_seen if self.core is not None else 0

    def counters(self) -> dict[str, int]:
        counts = self.core.counters() if self.core is not None else {}
        counts.update(self._errors)
        return counts

    async def set_seeds(self, seeds: Sequence[str]) -> None:
        """Take new seeds (a reload): resolved now for the core's join retries, and kept
        re-resolved like the seeds the service started with. ValueError on a bad seed."""
        self.seeds = [parse_seed(s) for s in seeds]
        core = self._started()
        core.set_seeds(await self._resolve())
        if self.seeds and self._seed_task is None:
            assert self._loop is not None
            self._seed_task = self._loop.create_task(self._keep_seeds())

    def set_keyring(self, keyring: Keyring | None) -> None:
        """Take a new keyring (a rotation step) without restarting."""
        self.keyring = keyring
        if self.core is not None:
            self.core.set_keyring(keyring)

    # --- driving the core ------------------------------------------------------------------

    def _started(self) -> GossipCore:
        if self.core is None:
            raise RuntimeError("gossip service not started")
        return self.core

    def _now_ms(self) -> int:
        assert self._loop is not None
        return int(self._loop.time() * 1000)

    def _wall_offset_ms(self) -> int:
        return time.time_ns() // 1_000_000 - self._now_ms()

    def _send(self, out: Outgoing) -> None:
        transport = self._transport
        if transport is None:
            return
        for addr, data in out:
            transport.sendto(data, addr)

    def _on_datagram(self, data: bytes, addr: tuple[str, int]) -> None:
        core = self.core
        if core is None:
            return
        try:
            self._send(core.on_datagram(data, addr[:2], self._now_ms()))
        except Exception:
            # The core drops bad input itself; this is a bug, and one datagram must not
            # take the agent down.
            self._internal_error("handling a datagram from %s", format_addr(addr[:2]))
        self._reschedule()

    def _tick(self) -> None:
        self._timer, self._timer_at = None, float("inf")
        core = self.core
        if core is None or self._transport is None:
            return
        core.wall_offset_ms = self._wall_offset_ms()
        try:
            self._send(core.on_tick(self._now_ms()))
        except Exception:
            self._internal_error("on a timer")
        self._reschedule()

    def _reschedule(self) -> None:
        if self.core is None or self._transport is None or self._loop is None:
            return
        # +1 ms: the core works in whole milliseconds and must find its deadline passed.
        at = (self.core.next_deadline() + 1) / 1000.0
        if at < self._timer_at:
            if self._timer is not None:
                self._timer.cancel()
            self._timer_at = at
            self._timer = self._loop.call_at(at, self._tick)

    def _internal_error(self, what: str, *args: object) -> None:
        self._errors["internal_errors"] += 1
        now = time.monotonic()
        if now - self._last_error_log >= _ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.exception("gossip: internal error " + what, *args)

    # --- finding peers ---------------------------------------------------------------------

    async def _guess_host(self, family: int) -> str:
        """An address peers can reach this node at, when bound to a wildcard.

        The route to a literal seed names the right interface without sending anything;
        otherwise the host name's address; otherwise loopback. Peers that hear from this
        node use the address its datagrams come from anyway."""
        for host, port in self.seeds:
            try:
                if ipaddress.ip_address(host).version != (6 if family == socket.AF_INET6 else 4):
                    continue
            except ValueError:
                continue
            probe = socket.socket(family, socket.SOCK_DGRAM)
            try:
                probe.connect((host, port))
                return probe.getsockname()[0]
            except OSError:
                continue
            finally:
                probe.close()
        assert self._loop is not None
        try:
            infos = await asyncio.wait_for(
                self._loop.getaddrinfo(socket.gethostname(), None, family=family, type=socket.SOCK_DGRAM), 2.0)
            for *_, sockaddr in infos:
                if not ipaddress.ip_address(sockaddr[0]).is_loopback:
                    return sockaddr[0]
        except (OSError, asyncio.TimeoutError):
            pass
        return "::1" if family == socket.AF_INET6 else "127.0.0.1"

    async def _resolve(self) -> list[Addr]:
        assert self._loop is not None and self._transport is not None
        family = self._transport.get_extra_info("socket").family
        out: list[Addr] = []
        for host, port in self.seeds:
            try:
                infos = await self._loop.getaddrinfo(host, port, family=family, type=socket.SOCK_DGRAM)
            except (OSError, UnicodeError) as e:  # IDNA refuses some names with UnicodeError
                log.warning("gossip: cannot resolve seed %s: %s", format_addr((host, port)), e)
                continue
            for *_, sockaddr in infos:
                if sockaddr[:2] not in out:
                    out.append(sockaddr[:2])
        return out

    async def _keep_seeds(self) -> None:
        """Join through the seeds; re-resolve them now and then, as DNS may move them."""
        joined = False
        while True:
            addrs = await self._resolve()
            core = self.core
            if core is not None and addrs:
                if joined:
                    core.set_seeds(addrs)
                else:
                    self._send(core.join(addrs, self._now_ms()))
                    self._reschedule()
                    joined = True
            await asyncio.sleep(_SEED_REFRESH_S if joined else self.params.join_retry_ms / 1000.0)

    def _on_discovered(self, addr: Addr) -> None:
        core = self.core
        if core is None or addr == core.advertise:
            return
        # Join only strangers: an address already in the table brings nothing.
        if any(p.gossip_addr == addr for p in core.table):
            return
        self._send(core.join([addr], self._now_ms(), remember=False))
        self._reschedule()
