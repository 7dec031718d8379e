"""Compiling, attaching and detaching the probes.

ProbeSet.start() compiles the C parts (SOURCES) once with BCC (about 2 s, so the
daemon calls it from a worker thread), attaches the TC programs to each interface (as tcx
links, or as cls_bpf filters on kernels before 6.6) and the tracepoints, and keeps a record
of every link, filter and clsact qdisc it added. stop(), and any failure inside start(),
removes exactly those. What cannot work here (not root, no BPF, no kernel headers, no such
interface) raises ProbeUnavailable with a one-line reason for `probes: degraded: <reason>`.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from . import abi, buckets, tc, tcx
from .maps import FlowTable, MapReader, MapSnapshot

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# Joined into one text in this order (see http.bpf.c's head): each part uses what the
# parts before it define.
SOURCES = ("http.bpf.c", "http_record.bpf.c", "http_request.bpf.c", "http_response.bpf.c",
           "http_sse.bpf.c", "http_entry.bpf.c", "tcpstats.bpf.c")
MODULES_DIR = Path("/lib/modules")
KHEADERS = Path("/sys/kernel/kheaders.tar.xz")
TRACEFS_DIRS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
TRACEPOINTS = ("sock/inet_sock_set_state", "tcp/tcp_retransmit_skb", "tcp/tcp_send_reset",
               "tcp/tcp_receive_reset")
ENTRY_ETH = "lm_tc_eth"
ENTRY_RAW = "lm_tc_raw"
# The tail-called step programs, in the order of their indexes in the lm_steps prog array
# (STEP_REQ, STEP_RESP, STEP_SSE, STEP_BODY, STEP_CLOSE, STEP_USAGE in http.bpf.c).
STEPS = ("lm_req", "lm_resp", "lm_sse", "lm_body", "lm_close", "lm_usage")

CAP_NET_ADMIN = 12
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39

# Body bytes the model search may read at each end of a request: 1 MiB costs about 0.4 ms
# of kernel time in 256 steps of 4 KiB, spread over the segments that carry it.
MAX_SCAN_LIMIT = 1 << 20


class ProbeUnavailable(Exception):
    """The probes cannot run here; str() is a one-line reason."""


@dataclass(frozen=True)
class MapSizes:
    """Entries of each bounded map (see docs/probes.md for the reasons of the defaults)."""

    inflight: int = 16384  # live connections to serving ports
    fingerprints: int = 16384  # flow x model x status rows, least recently answered evicted
    rows: int = 64  # model x port x endpoint x status rows of figures (19 KB each)
    models: int = 1024  # distinct model names
    ports: int = 64  # serving ports (per-port TCP stats)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or not 1 <= value <= 1 << 22:
                raise ValueError(f"MapSizes.{f.name} must be an integer in 1..{1 << 22}")


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0] if lines else "unknown error"


def _effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def _tracefs() -> Path | None:
    return next((d for d in TRACEFS_DIRS if (d / "events").is_dir()), None)


def preflight() -> Path:
    """Checks what start() needs before spending seconds compiling; returns tracefs."""
    if os.uname().sysname != "Linux":
        raise ProbeUnavailable(f"eBPF needs Linux, this is {os.uname().sysname}")
    caps = _effective_caps()

    def has(cap: int) -> bool:
        return bool(caps >> cap & 1)

    missing = [name for name, ok in (
        ("CAP_BPF", has(CAP_BPF) or has(CAP_SYS_ADMIN)),
        ("CAP_PERFMON", has(CAP_PERFMON) or has(CAP_SYS_ADMIN)),
        ("CAP_NET_ADMIN", has(CAP_NET_ADMIN)),
    ) if not ok]
    if missing:
        who = "not root" if os.geteuid() != 0 else "missing capabilities"
        raise ProbeUnavailable(f"{who} (needs {', '.join(missing)})")
    build = MODULES_DIR / os.uname().release / "build"
    if not (build / "include").is_dir() and not KHEADERS.exists():
        raise ProbeUnavailable(f"no kernel headers at {build}")
    tracefs = _tracefs()
    if tracefs is None:
        raise ProbeUnavailable(f"tracefs not mounted at {TRACEFS_DIRS[0]}")
    for tp in TRACEPOINTS:
        if not (tracefs / "events" / tp / "format").exists():
            raise ProbeUnavailable(f"kernel has no tracepoint {tp.replace('/', ':')}")
    return tracefs


def run_stats(prog_fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a loaded program, from its fdinfo (0 where the kernel
    shows none: BPF statistics off since it loaded)."""
    info = {}
    for line in Path(f"/proc/self/fdinfo/{prog_fd}").read_text().splitlines():
        key, _, value = line.partition(":")
        info[key.strip()] = value.strip()
    return int(info.get("run_time_ns", 0)), int(info.get("run_cnt", 0))


def kernel_cflags(tracefs: Path) -> list[str]:
    """-D flags for what differs between kernels: the tcp_send_reset record's layout."""
    fmt = (tracefs / "events/tcp/tcp_send_reset/format").read_text()
    flags = []
    if "sport;" not in fmt:
        flags.append("-DLM_SEND_RESET_SOCKADDR=1")
    if "enum sk_rst_reason" in fmt:
        kdir = MODULES_DIR / os.uname().release
        has_header = any((kdir / d / "include/net/rstreason.h").exists()
                         for d in ("build", "source"))
        flags.append("-DLM_RST_REASON_HEADER=1" if has_header else "-DLM_RST_REASON_ENUM=1")
    return flags


def _import_bcc() -> tuple[Any, Any]:
    """The bcc module and libbcc (for batch map reads)."""
    try:
        import bcc
        from bcc import libbcc
    except ImportError as exc:
        raise ProbeUnavailable(
            f"bcc not importable ({_one_line(str(exc))}): install Debian's python3-bpfcc"
        ) from exc
    return bcc, libbcc.lib


def _normalize_ports(ports: Iterable[int], limit: int) -> tuple[int, ...]:
    out = tuple(sorted({int(p) for p in ports}))
    if any(not 1 <= p <= 65535 for p in out):
        raise ValueError(f"ports must be in 1..65535: {out}")
    if len(out) > limit:
        raise ValueError(f"{len(out)} ports, more than MapSizes.ports={limit}")
    return out


def _bitmap(ports: Iterable[int]) -> dict[int, int]:
    words: dict[int, int] = {}
    for p in ports:
        words[p >> 6] = words.get(p >> 6, 0) | 1 << (p & 63)
    return words


class ProbeSet:
    """The probes on a set of interfaces for a set of serving ports."""

    def __init__(self, interfaces: Sequence[str], ports: Sequence[int],
                 sizes: MapSizes = MapSizes(), *, scan_limit: int = 65536,
                 sources: Path = HERE) -> None:
        """sources: the directory of the C parts (another tree's, for an A/B of the
        probes: scripts/bench_probes_ab.py); its maps must keep this reader's layout."""
        if isinstance(interfaces, str):
            raise TypeError("interfaces is a sequence of names, not one string")
        self._interfaces = tuple(dict.fromkeys(interfaces))
        if not self._interfaces:
            raise ValueError("probes need at least one interface")
        self.sizes = sizes
        self._ports = _normalize_ports(ports, sizes.ports)
        if not 64 <= scan_limit <= MAX_SCAN_LIMIT:
            raise ValueError(f"scan_limit must be in 64..{MAX_SCAN_LIMIT}")
        self.scan_limit = scan_limit
        self._sources = sources
        self._lock = threading.Lock()
        self._bpf: Any = None
        self._sched_cls: Any = None
        self._progs: dict[str, Any] = {}
        self._reader: MapReader | None = None
        self._tcx: bool | None = None  # whether the kernel has tcx links; None: not tried
        self._links: list[tcx.Link] = []
        self._filters: list[tc.Filter] = []
        self._clsacts: list[tuple[str, int]] = []  # clsact qdiscs we added
        self._written: dict[int, int] = {}  # bitmap words as last written

    @property
    def interfaces(self) -> tuple[str, ...]:
        return self._interfaces

    @property
    def ports(self) -> tuple[int, ...]:
        return self._ports

    @property
    def running(self) -> bool:
        return self._bpf is not None

    @property
    def attached_as(self) -> str:
        """How the TC programs are attached: "tcx links" or "cls_bpf filters"."""
        return "tcx links" if self._tcx else "cls_bpf filters"

    @property
    def attachments(self) -> tuple[tcx.Link | tc.Filter, ...]:
        """The tcx links and TC filters this probe set added and has not removed yet."""
        return (*self._links, *self._filters)

    def start(self) -> None:
        """Compiles and attaches (blocking). On failure nothing stays attached."""
        with self._lock:
            if self._bpf is not None:
                raise RuntimeError("probes already started")
            try:
                self._start()
            except ProbeUnavailable:
                self._teardown()
                raise
            except Exception as exc:
                self._teardown()
                raise ProbeUnavailable(_one_line(str(exc))) from exc

    def stop(self) -> None:
        """Detaches exactly what start() attached; safe to call again."""
        with self._lock:
            self._teardown()

    def set_ports(self, ports: Sequence[int]) -> None:
        """Changes the serving ports in place: no recompile, no reattach."""
        new = _normalize_ports(ports, self.sizes.ports)
        with self._lock:
            self._ports = new
            if self._bpf is not None:
                self._write_ports()

    def pause(self) -> None:
        """Detaches from the interfaces but keeps the programs and maps: counting stops, the
        figures so far stay, resume() needs no recompile. Used by the bench to compare
        with and without the probes under one unbroken load."""
        with self._lock:
            if self._bpf is None:
                raise RuntimeError("probes not started")
            self._detach_tc()

    def resume(self) -> None:
        """Attaches the TC programs again after pause()."""
        with self._lock:
            if self._bpf is None:
                raise RuntimeError("probes not started")
            if not self.attachments:
                try:
                    self._attach_all()
                except Exception:
                    self._detach_tc()
                    raise

    def read_maps(self, with_flows: bool = True) -> MapSnapshot:
        """Blocking read of every map (the reader calls it from a worker thread); with_flows
        False leaves out the flow table (MapReader.read)."""
        with self._lock:
            if self._reader is None:
                raise RuntimeError("probes not started")
            return self._reader.read(with_flows)

    def read_flows(self, idle_s: float) -> tuple[int, FlowTable]:
        """Blocking read of the flow table alone, for a dump: (time.monotonic_ns() of the
        read, the rows answered in the idle_s before it)."""
        with self._lock:
            if self._reader is None:
                raise RuntimeError("probes not started")
            mono_ns = time.monotonic_ns()
            return mono_ns, self._reader.flows(mono_ns - int(idle_s * 1e9))

    def prog_stats(self) -> dict[str, tuple[int, int]]:
        """(run_time_ns, run_cnt) per loaded program, from the kernel's BPF statistics
        (counted only while sysctl kernel.bpf_stats_enabled=1). Tail-called steps run
        inside their entry program's time, so lm_req and lm_resp show 0 runs."""
        with self._lock:
            if self._bpf is None:
                return {}
            return {name.decode() if isinstance(name, bytes) else name: run_stats(fn.fd)
                    for name, fn in self._bpf.funcs.items()}

    def program_fd(self, name: str) -> int:
        """The file descriptor of a loaded program (an entry, lm_tc_eth or lm_tc_raw, or a
        step): for BPF_PROG_TEST_RUN in scripts/bench_probe_steps.py."""
        with self._lock:
            if name not in self._progs:
                raise KeyError(f"no program {name!r} loaded")
            return self._progs[name].fd

    # ---- inside the lock ----

    def _start(self) -> None:
        tracefs = preflight()
        bcc, lib = _import_bcc()
        self._sched_cls = bcc.BPF.SCHED_CLS
        with IPRoute() as ipr:  # before compiling: a wrong name fails in milliseconds
            links = {ifname: self._link(ipr, ifname) for ifname in self._interfaces}
        entries = sorted({entry for _, _, entry in links.values()})
        self._bpf = self._compile(bcc, tracefs)
        self._progs = {name: self._prog(name) for name in (*entries, *STEPS)}
        steps = self._bpf[b"lm_steps"]
        for i, name in enumerate(STEPS):
            steps[ctypes.c_int(i)] = ctypes.c_int(self._progs[name].fd)
        self._written = {}
        self._write_ports()
        for name, indexes in ((b"free_rows", range(self.sizes.rows)),
                              (b"spare_rows", range(self.sizes.rows,
                                                    self.sizes.rows + abi.const("LM_SPARE_ROWS")))):
            queue = self._bpf[name]
            for i in indexes:
                queue.push(ctypes.c_uint32(i))
        self._reader = MapReader(self._bpf, lib)
        self._attach_all()

    def _compile(self, bcc: Any, tracefs: Path) -> Any:
        cflags = [
            f"-I{self._sources}",
            f"-DLM_INFLIGHT_ENTRIES={self.sizes.inflight}",
            f"-DLM_FP_ENTRIES={self.sizes.fingerprints}",
            f"-DLM_ROWS={self.sizes.rows}",
            f"-DLM_MODEL_ENTRIES={self.sizes.models}",
            f"-DLM_PORT_ENTRIES={self.sizes.ports}",
            f"-DLM_SCAN_LIMIT={self.scan_limit}",
            f"-DLM_HIST_SUB_BITS={buckets.SUB_BITS}",
            f"-DLM_HIST_MAX_EXP={buckets.MAX_EXP}",
            f"-DLM_HIST_BUCKETS={buckets.N_BUCKETS}",
            *kernel_cflags(tracefs),
        ]
        # #line: the compiler's messages name the part and its own line numbers
        text = "\n".join(f'#line 1 "{name}"\n' + (self._sources / name).read_text()
                         for name in SOURCES)
        try:
            return bcc.BPF(text=text.encode(), cflags=cflags)
        except Exception as exc:
            msg = _one_line(str(exc))
            if "compile" in msg:
                raise ProbeUnavailable(f"BPF program does not compile: {msg} (see stderr)")
            raise ProbeUnavailable(f"BPF not supported: {msg}") from exc

    def _prog(self, name: str) -> Any:
        """Loads (and so verifies) a program."""
        try:
            return self._bpf.load_func(name.encode(), self._sched_cls)
        except Exception as exc:
            raise ProbeUnavailable(f"BPF not supported: {_one_line(str(exc))}") from exc

    @staticmethod
    def _link(ipr: Any, ifname: str) -> tuple[int, int, str]:
        """(ifindex, link type, entry program) of an interface."""
        try:
            ifindex, link_type = tc.link(ipr, ifname)
        except LookupError as exc:
            raise ProbeUnavailable(str(exc)) from exc
        if link_type in (tc.ARPHRD_ETHER, tc.ARPHRD_LOOPBACK):
            return ifindex, link_type, ENTRY_ETH
        if link_type == tc.ARPHRD_NONE:  # WireGuard, tun: packets start at the IP header
            return ifindex, link_type, ENTRY_RAW
        raise ProbeUnavailable(f"interface {ifname}: link type {link_type} not supported")

    def _attach_all(self) -> None:
        with IPRoute() as ipr:
            for ifname in self._interfaces:
                self._attach(ipr, ifname)

    def _attach(self, ipr: Any, ifname: str) -> None:
        ifindex, link_type, entry = self._link(ipr, ifname)
        prog = self._progs[entry]
        hooks = tc.directions(link_type)
        try:
            if tc.has_clsact(ipr, ifindex):
                for parent in (tc.INGRESS, tc.EGRESS):
                    tc.remove_stale(ipr, ifname, ifindex, parent)
            if self._tcx is not False and self._attach_tcx(ifname, ifindex, hooks, prog.fd):
                return
            if not tc.has_clsact(ipr, ifindex):
                tc.add_clsact(ipr, ifindex)
                self._clsacts.append((ifname, ifindex))
            for parent in hooks:
                self._filters.append(tc.add_filter(ipr, ifname, ifindex, parent, prog.fd,
                                                   prog.name.decode()))
        except NetlinkError as exc:
            raise ProbeUnavailable(f"cannot attach to {ifname}: {exc}") from exc

    def _attach_tcx(self, ifname: str, ifindex: int, hooks: tuple[int, ...],
                    prog_fd: int) -> bool:
        """Attaches through tcx links; False when this kernel has none (found out on the
        first attach, then the loader uses cls_bpf filters everywhere)."""
        for parent in hooks:
            try:
                self._links.append(tcx.attach(ifname, ifindex, parent == tc.INGRESS, prog_fd))
            except OSError as exc:
                if self._tcx is None and exc.errno in (errno.EINVAL, errno.ENOSYS):
                    log.info("probes: no tcx links on this kernel (%s); attaching as cls_bpf "
                             "filters", exc.strerror)
                    self._tcx = False
                    return False
                raise ProbeUnavailable(f"cannot attach to {ifname}: {exc.strerror}") from exc
            self._tcx = True
        return True

    def _write_ports(self) -> None:
        words = _bitmap(self._ports)
        table = self._bpf[b"serving_ports"]
        for idx in set(words) | set(self._written):
            value = words.get(idx, 0)
            if self._written.get(idx) != value:
                table[ctypes.c_int(idx)] = ctypes.c_uint64(value)
        self._written = words

    def _teardown(self) -> None:
        """Removes our links and filters, then the clsact qdiscs we added, then the programs
        and tracepoints. Keeps going past errors so one failure does not strand the rest."""
        self._detach_tc()
        self._reader = None
        self._progs = {}
        if self._bpf is not None:
            try:
                self._bpf.cleanup()
            except Exception:
                log.exception("could not release the BPF programs")
            self._bpf = None

    def _detach_tc(self) -> None:
        for link in reversed(self._links):
            try:
                tcx.detach(link)
            except OSError:
                log.exception("could not close tcx link %s", link)
        self._links = []
        if self._filters or self._clsacts:
            try:
                with IPRoute() as ipr:
                    for f in reversed(self._filters):
                        try:
                            tc.del_filter(ipr, f)
                        except Exception:
                            log.exception("could not remove filter %s", f)
                    for ifname, ifindex in reversed(self._clsacts):
                        try:
                            if not tc.del_clsact_if_unused(ipr, ifindex):
                                log.info("left clsact on %s: it holds other filters now",
                                         ifname)
                        except Exception:
                            log.exception("could not remove clsact on %s", ifname)
            except Exception:
                log.exception("could not open rtnetlink to detach the probes")
        self._filters = []
        self._clsacts = []
