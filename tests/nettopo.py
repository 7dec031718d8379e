"""Network namespaces for tests: a namespace behind a veth pair, N namespaces on a bridge,
processes inside them. Every context manager removes what it created (processes first,
then links, then namespaces) on every way out, including failures half-way through setup.

Names carry the test process's pid so parallel runs do not collide, and stay within the
15 characters Linux allows for interface names. Needs root and iproute2.

    with veth_netns() as topo:                      # namespace + veth + IPv4/IPv6
        with topo.ns.popen(["python3", "-m", "http.server"]) as proc:
            ...connect to topo.ns_v4 / topo.ns_v6 from the host side...

    with bridge_mesh(3) as nodes:                   # 3 namespaces on one bridge
        nodes[0].ns.run(["ping", "-c1", nodes[1].v4])
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from loadmesh.probes import MapSizes, ProbeSet

_counter = itertools.count()


def _claim_net_a() -> int:
    """A subnet number of this process's own, held (a lock on a file) until it exits: the
    host side of veth_netns carries 10.<A>.<B>.1 in the test's namespace, and two test
    processes (pytest-xdist workers, another checkout's run) with the same A would route
    each other's traffic (four workers' pids modulo 50 meet about one run in nine)."""
    for a in range(200, 250):
        lock = open(f"/run/lock/loadmesh-tests-net-{a}", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        _held_locks.append(lock)
        return a
    raise RuntimeError("all 50 test subnets 10.200-249.x are held by running test processes")


_held_locks: list[TextIO] = []
# Subnets 10.<A>.<B>.0/24 and fd6c:6d<A>:<B>::/64: A claimed for this process, B from a
# counter, so concurrent test processes and topologies get disjoint addresses.
_NET_A = _claim_net_a()


def _unique(prefix: str) -> str:
    name = f"{prefix}{os.getpid() % 100000}x{next(_counter)}"
    if len(name) > 12:  # leaves room for a 3-character suffix within 15
        raise ValueError(f"name {name!r} too long: use a shorter prefix")
    return name


def _canonical(ip: str) -> str:
    return str(ipaddress.ip_address(ip))


def sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True)


@dataclass(frozen=True)
class Netns:
    name: str

    def argv(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], check: bool = True,
            timeout: float | None = 60) -> subprocess.CompletedProcess[str]:
        """Runs a command inside the namespace and waits for it."""
        return subprocess.run(self.argv(argv), check=check, capture_output=True, text=True,
                              timeout=timeout)

    @contextlib.contextmanager
    def popen(self, argv: Sequence[str], ready: str | None = None,
              ready_timeout: float = 20, **kwargs) -> Iterator[subprocess.Popen[str]]:
        """Starts a process inside the namespace and stops it on exit. ready: a line the
        process prints on stdout once it is ready; popen waits for it."""
        proc = subprocess.Popen(self.argv(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True, **kwargs)
        try:
            if ready is not None:
                _wait_ready(proc, ready, ready_timeout)
            yield proc
        finally:
            stop_process(proc)

    def pids(self) -> list[int]:
        out = sh(["ip", "netns", "pids", self.name], check=False).stdout
        return [int(p) for p in out.split()]


def _wait_ready(proc: subprocess.Popen[str], ready: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"process exited before ready ({proc.returncode}): {err[-2000:]}")
        if ready in line:
            return
    raise TimeoutError(f"process not ready after {timeout} s")


def stop_process(proc: subprocess.Popen[str], grace: float = 3) -> None:
    """SIGTERM to the process group we started, SIGKILL after the grace period."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for stream in (proc.stdout, proc.stderr, proc.stdin):
        if stream is not None:
            stream.close()


def cpu_s(pid: int) -> float:
    """User and system CPU time of a process, all its threads. Softirq work (a veth's
    receive, the probes' programs with it) runs in the context of the task that sent the
    packet and is charged to it."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory_mib(pid: int) -> tuple[float, float]:
    """A process's resident set now and at its peak (VmRSS, VmHWM), in MiB."""
    kib: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            kib[key] = int(value.split()[0])
    return kib["VmRSS"] / 1024, kib["VmHWM"] / 1024


@contextlib.contextmanager
def netns(prefix: str = "lmt") -> Iterator[Netns]:
    """A fresh network namespace with lo up; on exit its processes are killed (they are the
    test's own) and it is deleted."""
    ns = Netns(_unique(prefix))
    sh(["ip", "netns", "add", ns.name])
    try:
        ns.run(["ip", "link", "set", "lo", "up"])
        yield ns
    finally:
        for pid in ns.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        sh(["ip", "netns", "del", ns.name], check=False)


@dataclass(frozen=True)
class VethTopo:
    """A namespace behind a veth pair: host_if stays in the test's namespace."""

    ns: Netns
    host_if: str
    ns_if: str
    host_v4: str
    ns_v4: str
    host_v6: str
    ns_v6: str


@contextlib.contextmanager
def veth_netns(prefix: str = "lmt") -> Iterator[VethTopo]:
    """A namespace joined to this one by a veth pair with IPv4 /24 and IPv6 /64 addresses
    on both ends (DAD off, so IPv6 works at once)."""
    b = next(_counter) % 250
    v4 = f"10.{_NET_A}.{b}"
    v6 = f"fd6c:6d{_NET_A:02x}:{b:x}:"
    with netns(prefix) as ns, contextlib.ExitStack() as stack:
        host_if = ns.name + "h"
        ns_if = ns.name + "n"
        sh(["ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if])
        stack.callback(sh, ["ip", "link", "del", host_if], False)
        sh(["ip", "link", "set", ns_if, "netns", ns.name])
        sh(["ip", "addr", "add", f"{v4}.1/24", "dev", host_if])
        sh(["ip", "-6", "addr", "add", f"{v6}:1/64", "dev", host_if, "nodad"])
        sh(["ip", "link", "set", host_if, "up"])
        ns.run(["ip", "addr", "add", f"{v4}.2/24", "dev", ns_if])
        ns.run(["ip", "-6", "addr", "add", f"{v6}:2/64", "dev", ns_if, "nodad"])
        ns.run(["ip", "link", "set", ns_if, "up"])
        yield VethTopo(ns, host_if, ns_if, f"{v4}.1", f"{v4}.2", _canonical(f"{v6}:1"),
                       _canonical(f"{v6}:2"))


@dataclass(frozen=True)
class MeshNode:
    ns: Netns
    ifname: str  # inside ns
    v4: str
    v6: str


@contextlib.contextmanager
def bridge_mesh(n: int, prefix: str = "lmb") -> Iterator[list[MeshNode]]:
    """n namespaces, each with one veth port on a bridge that lives in its own namespace
    (so the test's namespace is not touched at all). Addresses 10.A.B.(i+1)/24 and
    fd6c:6dA:B::(i+1)/64."""
    if not 1 <= n <= 200:
        raise ValueError("1..200 nodes")
    b = next(_counter) % 250
    with netns(prefix) as switch, contextlib.ExitStack() as stack:
        br = switch.name + "br"
        switch.run(["ip", "link", "add", br, "type", "bridge"])
        switch.run(["ip", "link", "set", br, "up"])
        nodes = []
        for i in range(n):
            ns = stack.enter_context(netns(prefix))
            port, inner = ns.name + "p", ns.name + "i"
            sh(["ip", "link", "add", port, "type", "veth", "peer", "name", inner])
            stack.callback(_del_link, port, switch)
            sh(["ip", "link", "set", inner, "netns", ns.name])
            sh(["ip", "link", "set", port, "netns", switch.name])
            switch.run(["ip", "link", "set", port, "master", br])
            switch.run(["ip", "link", "set", port, "up"])
            v4, v6 = f"10.{_NET_A}.{b}.{i + 1}", f"fd6c:6d{_NET_A:02x}:{b:x}::{i + 1:x}"
            ns.run(["ip", "addr", "add", f"{v4}/24", "dev", inner])
            ns.run(["ip", "-6", "addr", "add", f"{v6}/64", "dev", inner, "nodad"])
            ns.run(["ip", "link", "set", inner, "up"])
            nodes.append(MeshNode(ns, inner, v4, _canonical(v6)))
        yield nodes


def tc_filters(ifname: str, direction: str, ns: Netns | None = None) -> list[dict]:
    """Filters under a clsact hook ("ingress" or "egress"), as `tc -j` lists them, without
    the per-prio chain headers; [] when the interface has no clsact."""
    argv = ["tc", "-j", "filter", "show", "dev", ifname, direction]
    out = (ns.run(argv, check=False) if ns else sh(argv, check=False)).stdout.strip()
    return [f for f in json.loads(out or "[]") if "options" in f]


def qdisc_kinds(ifname: str, ns: Netns | None = None) -> list[str]:
    argv = ["tc", "-j", "qdisc", "show", "dev", ifname]
    out = (ns.run(argv) if ns else sh(argv)).stdout.strip()
    return [q["kind"] for q in json.loads(out or "[]")]


_TCX_QUERY = """
import json, socket
from loadmesh.probes import tcx
idx = socket.if_nametoindex({ifname!r})
print(json.dumps(tcx.prog_ids(idx, {ingress!r})))
"""


def tcx_progs(ifname: str, direction: str, ns: Netns | None = None) -> list[int]:
    """Ids of the programs on an interface's tcx hook ("ingress" or "egress")."""
    from loadmesh.probes import tcx

    ingress = direction == "ingress"
    if ns is None:
        return tcx.prog_ids(socket.if_nametoindex(ifname), ingress)
    code = _TCX_QUERY.format(ifname=ifname, ingress=ingress)
    return json.loads(ns.run([sys.executable, "-c", code]).stdout)


def attached(ifname: str, ns: Netns | None = None) -> list[str]:
    """Everything on an interface's TC hooks (tcx programs, clsact filters, the clsact
    qdisc itself), one line each: [] when nothing is."""
    out = []
    for direction in ("ingress", "egress"):
        out += [f"tcx {direction} prog {i}" for i in tcx_progs(ifname, direction, ns)]
        out += [f"tc {direction} {f['kind']} {f['options'].get('bpf_name', '')}"
                for f in tc_filters(ifname, direction, ns)]
    return out + [f"qdisc {k}" for k in qdisc_kinds(ifname, ns) if k == "clsact"]


@contextlib.contextmanager
def probes_on(ifname: str, ports: Sequence[int], sizes: MapSizes | None = None
              ) -> Iterator[ProbeSet]:
    """The probes started on ifname for `ports` (with the default map sizes unless given),
    stopped on every way out, and nothing of theirs left on the interface's hooks after.
    Where they cannot load the test is skipped, but not as root (CI): there a skip would
    hide a broken probe."""
    import pytest

    from loadmesh.probes import MapSizes, ProbeSet, ProbeUnavailable

    probes = ProbeSet([ifname], list(ports), sizes or MapSizes())
    try:
        probes.start()
    except ProbeUnavailable as exc:
        if os.geteuid() == 0:
            raise
        pytest.skip(f"probes unavailable: {exc}")
    try:
        yield probes
    finally:
        probes.stop()
        assert attached(ifname) == []


def _del_link(name: str, where: Netns) -> None:
    """Deletes a veth wherever set-up got it to (here or in `where`): one end takes the
    other with it."""
    if sh(["ip", "link", "del", name], check=False).returncode != 0:
        where.run(["ip", "link", "del", name], check=False)


def leftovers(prefix: str) -> list[str]:
    """Namespaces and links of this process whose names start with prefix: what a test
    can assert is empty after cleanup."""
    mine = f"{prefix}{os.getpid() % 100000}x"
    names = sh(["ip", "netns", "list"]).stdout.split()
    links = sh(["ip", "-o", "link", "show"]).stdout.splitlines()
    found = [n for n in names if n.startswith(mine)]
    found += [line.split(":")[1].strip().split("@")[0] for line in links
              if line.split(":")[1].strip().startswith(mine)]
    return found
